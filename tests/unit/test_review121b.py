"""Review of the pad_token_id import (model.padding_idx): a resume of a run from hf:DIR that an earlier longctx wrote.

That run trained every embedding row (its saved config.toml, which lists every [model] key, has no padding_idx).
Resolved again from config.json, the resume set model.padding_idx to its pad_token_id and silently stopped training a
row the run had trained (a 2-step SmolLM2-like run with pad_token_id 2 went on with padding_idx 2, nothing said, and
its config.toml rewritten so). The resume keeps -1, as the run trained, and says so; a run written now keeps its own.
"""

import json

import pytest

from longctx.config import load_config, to_toml
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError

HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
          max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=2)


def _run(tmp_path, written_before: bool):
    """A run directory of a run from hf:DIR (pad_token_id 2), its config.toml as longctx writes it: without the
    padding_idx line where an earlier version wrote it."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF))
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=[f"--model.init_from=hf:{hf}", "--train.seq_len=64", f"--train.run_dir={run}"])
    assert cfg.model.padding_idx == 2
    text = to_toml(cfg)
    if written_before:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("padding_idx ="))
    (run / "config.toml").write_text(text)
    return run


def test_a_run_written_before_padding_idx_resumes_training_every_row(tmp_path):
    run = _run(tmp_path, written_before=True)
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto"], False)
    assert cfg.model.padding_idx == -1
    assert "model.padding_idx -1" in resumed.describe() and "pad_token_id" in resumed.describe()
    assert "padding_idx = -1" in to_toml(cfg)  # (the config.toml the resume writes keeps it)


def test_a_run_written_now_keeps_its_own_and_a_given_one_wins(tmp_path):
    run = _run(tmp_path, written_before=False)
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto"], False)
    assert cfg.model.padding_idx == 2 and "padding_idx" not in resumed.describe()
    (tmp_path / "old").mkdir()
    old = _run(tmp_path / "old", written_before=True)
    given = [f"--train.run_dir={old}", "--checkpoint.resume=auto", "--model.padding_idx=2"]
    with pytest.raises(ConfigError, match=r"model.padding_idx -1 -> 2.*--checkpoint.allow_changes true"):
        load_run_config(None, given, False)  # (a change of the model a resume makes only when asked)
    cfg, resumed = load_run_config(None, given + ["--checkpoint.allow_changes=true"], False)
    assert cfg.model.padding_idx == 2 and "as this run trained" not in resumed.describe()
