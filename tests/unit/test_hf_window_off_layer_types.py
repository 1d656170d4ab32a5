"""A windowed Qwen config.json that carries layer_types (transformers >= 4.53 writes them: the windowed layers
"sliding_attention"): the refusal of a length past the window said "set use_sliding_window false", but an explicit
layer_types wins (windowed_layers, as transformers' config classes read it), so that change alone was refused again
with the same advice (and transformers' own cache fails on such a file). The advice now names layer_types too, and
following it loads."""

import json

import pytest
from test_hf import hf_config

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.config.hf import HFFormatError
from longctx.errors import ConfigError
from longctx.eval.request import prepare

WINDOWED = dict(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"])
ADVICE = 'use_sliding_window false and every layer_types entry to "full_attention"'


def _write(tmp_path, **extra) -> str:
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen2", **{**WINDOWED, **extra})))
    return f"hf:{tmp_path}"


@pytest.mark.parametrize("use", [True, False])
def test_the_advice_names_layer_types_and_following_it_loads(tmp_path, use):
    hf = _write(tmp_path, use_sliding_window=use)
    with pytest.raises(HFFormatError, match=ADVICE):
        load_config(overrides=[f"--model.init_from={hf}", "--model.max_seq_len=256", "--train.seq_len=256"])
    _write(tmp_path, use_sliding_window=False, layer_types=["full_attention"] * 2)
    m = load_config(overrides=[f"--model.init_from={hf}", "--model.max_seq_len=256", "--train.seq_len=256"]).model
    assert m.max_seq_len == 256


def test_evals_refusal_past_the_window_names_layer_types_too(tmp_path):
    hf = _write(tmp_path)
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", hf, "--task", "ppl", "--lengths", "128", "--tokenizer", "byte"])
    with pytest.raises(ConfigError, match=f"set {ADVICE} in"):
        prepare(args, rest, 1)


def test_a_qwen_without_layer_types_is_told_use_sliding_window_alone(tmp_path):
    config = {k: v for k, v in hf_config("qwen2", **WINDOWED).items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFFormatError, match=r"or set use_sliding_window false in config.json"):
        load_config(overrides=[f"--model.init_from=hf:{tmp_path}", "--model.max_seq_len=256"])
