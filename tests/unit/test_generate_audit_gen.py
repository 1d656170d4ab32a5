"""`longctx generate` under many prompts and combined features (audit): a --prompts JSON line whose
strings hold characters str.splitlines() breaks at (U+2028, U+2029, U+0085, \\x1c-\\x1e; json.dumps with
ensure_ascii=False writes them raw) is read whole, as JSON Lines are separated by "\\n" only; an EOS id
outside the model's vocabulary (a config.json may name one) with --min-new-tokens is ignored, as
transformers' MinNewTokensLengthLogitsProcessor ignores it, in plain and speculative decoding (it indexed
past the logits: an IndexError after the weights had loaded); a prompt or --stop holding a lone surrogate
(bytes that are not UTF-8 on the command line, a JSON "\\ud800" escape) is one error before work (the prompt
was a TypeError traceback from the tokenizer, the stop never matched without a word, an "id" failed the output
line's write after the generation); a limits list that
does not fit the prompts, or a negative limit, is refused (it was cut, or failed deep in the cache)."""

import json
from types import SimpleNamespace

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.prompts import read_prompts
from longctx.generate.sampling import Sampling
from longctx.generate.speculative import speculative_generate
from longctx.models.llama import build_model

SEPARATORS = ["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x0b", "\x0c"]


def _read(path):
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=False))


def test_a_prompt_holding_a_unicode_line_separator_is_one_line(tmp_path):
    rows = [{"prompt": f"def f(x):{sep}    return x", "id": i} for i, sep in enumerate(SEPARATORS)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    got = _read(path)
    assert [p["text"] for p in got] == [r["prompt"] for r in rows] and [p["id"] for p in got] == list(range(8))
    # Windows line ends still read, and a bad line is still named by its "\n" line number
    path.write_text(json.dumps(rows[0], ensure_ascii=False) + "\r\n\r\n{\"prompt\": 3}\r\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="line 3 has no \"prompt\" string"):
        _read(path)


def _model(seed, layers):
    return build_model(load_config(overrides=[f"--model.layers={layers}", "--model.vocab_size=64"]).model,
                       seed=seed).eval()


def test_an_eos_id_past_the_vocabulary_is_ignored_by_min_new_tokens():
    target, draft = _model(1, 2), _model(2, 1)
    prompt = [5, 9, 3, 17, 2]
    sampling = Sampling(min_new_tokens=4)
    free = generate(target, [prompt], max_new_tokens=10, sampling=sampling)[0].tokens
    eos = [free[1], 64 + 1000]  # (the first one, in the vocabulary, is held back for 4 tokens: it still counts)
    want = generate(target, [prompt], max_new_tokens=10, sampling=sampling, eos_ids=eos[:1])[0]
    got = generate(target, [prompt, prompt[:2]], max_new_tokens=10, sampling=sampling, eos_ids=eos)[0]
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    spec = speculative_generate(target, ModelDrafter(draft, 40), prompt, max_new_tokens=10, k=3, sampling=sampling,
                                eos_ids=eos)
    assert spec.tokens == want.tokens
    sampled = Sampling(temperature=1.0, min_new_tokens=4)
    torch.manual_seed(0)
    assert len(generate(target, [prompt], max_new_tokens=6, sampling=sampled, eos_ids=eos)[0].tokens) >= 4


@pytest.mark.parametrize("limits", [[4, 9], [4, 9, 2], [-3], -3])
def test_limits_that_do_not_fit_the_prompts_are_refused(limits):
    # (a list of another length was cut silently or failed on a row it lacked; a negative limit failed on
    # the cache's max_len, which the caller never gave)
    target, draft = _model(1, 2), _model(2, 1)
    prompts = [[1, 2, 3], [4, 5]] if isinstance(limits, list) and len(limits) == 3 else [[1, 2, 3]]
    with pytest.raises(ValueError, match="max_new_tokens must be one int >= 0 for every prompt"):
        generate(target, prompts, max_new_tokens=limits)
    if not isinstance(limits, list):
        with pytest.raises(ValueError, match="max_new_tokens must be one int >= 0"):
            speculative_generate(target, ModelDrafter(draft, 40), prompts[0], max_new_tokens=limits, k=2)
    assert generate(target, [[1, 2, 3]], max_new_tokens=0)[0].finish_reason == "length"  # (0: the reach's room)


@pytest.fixture
def hf_dir(tmp_path):
    """A Llama config.json alone: generate's checks read no weights."""
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _prepare(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--tokenizer",
                                                            "byte", "--max-new-tokens", "4", *argv])
    return prepare(args, rest)


def test_a_lone_surrogate_in_a_prompt_or_a_stop_is_one_error_before_work(hf_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "abc\\ud800def"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"prompt 2 \(--prompts line 2\) holds U\+D800 at character 3, a lone"):
        _prepare(hf_dir, "--prompts", str(path))
    with pytest.raises(ConfigError, match=r"the prompt holds U\+DCFF"):  # (argv's byte 0xff, not UTF-8)
        _prepare(hf_dir, "--prompt", "caf\udcff")
    with pytest.raises(ConfigError, match=r"--stop .* holds U\+DC80 .* no generated text could hold it"):
        _prepare(hf_dir, "--prompt", "hello", "--stop", "\udc80x")
    path.write_text('{"prompt": "fine", "id": ["a", "b\\udfff"]}\n', encoding="utf-8")  # (its line: not writable)
    with pytest.raises(ConfigError, match=r"line 1: its \"id\" holds U\+DFFF"):
        _prepare(hf_dir, "--prompts", str(path))
    assert _prepare(hf_dir, "--prompt", "caf\u00e9 \U0001F600", "--stop", "\u00e9").prompts[0]["ids"]
