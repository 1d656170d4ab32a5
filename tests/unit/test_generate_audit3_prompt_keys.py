"""A --prompts line that sets a decoding setting of its own under another API's name is refused, as
"max_tokens" and "temperature" are (generate/settings.py PER_RUN_KEYS). Before this audit the current
OpenAI name of the limit ("max_completion_tokens"), vLLM's "min_tokens" and "ignore_eos", OpenAI's
"top_logprobs" and "echo", and transformers' "num_return_sequences" were read by nothing: a line asking
for 16 tokens was decoded to --max-new-tokens (256 by default), without a word."""

import json
from types import SimpleNamespace

import pytest

from longctx.errors import ConfigError
from longctx.generate.prompts import read_prompts


def _read(path):
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=False))


@pytest.mark.parametrize("key, value, flag", [
    ("max_completion_tokens", 16, "--max-new-tokens"),  # (OpenAI's chat API, max_tokens deprecated there)
    ("min_tokens", 4, "--min-new-tokens"),               # (vLLM's SamplingParams)
    ("ignore_eos", True, "--ignore-eos"),                # (vLLM's)
    ("top_logprobs", 5, "--logprobs"),                   # (OpenAI's chat API)
    ("echo", True, "--echo"),                            # (OpenAI's completions API)
    ("num_return_sequences", 3, "--num-samples"),        # (transformers' generate)
])
def test_a_line_setting_a_run_setting_under_another_apis_name_is_refused(tmp_path, key, value, flag):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", key: value}) + "\n")
    with pytest.raises(ConfigError, match=f"line 2 sets '{key}': decoding settings are the run's.*{flag}"):
        _read(path)


def test_a_lines_metadata_stays_free(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "id": 1, "seed": 2, "source": "x", "tokens_expected": 16}) + "\n")
    assert _read(path) == [{"text": "a", "line": 1, "id": 1, "seed": 2}]  # ("line": where it is, for errors)
