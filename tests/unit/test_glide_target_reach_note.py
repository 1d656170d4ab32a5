"""A GliDe draft trained on sequences past its frozen target's reach is told so (the target's K/V there
are extrapolated, and generate refuses such prompts); within the reach, nothing is said."""

import dataclasses

from longctx.config import load_config
from longctx.train.glide import past_target_reach


def _cfg(target, seq_len, stages=""):
    cfg = load_config(overrides=["--model.layers=1"])
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len, stages=stages),
                               draft=dataclasses.replace(cfg.draft, target=target))


def _hf_target(tmp_path, positions):
    from longctx.models.hf import save_hf
    from longctx.models.llama import build_model

    model = build_model(load_config(overrides=["--model.layers=1"]).model)
    out = save_hf(model, tmp_path / "t")
    import json
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(cfg))
    return f"hf:{out}"


def test_a_draft_past_its_targets_reach_is_told(tmp_path):
    target = _hf_target(tmp_path, 128)
    note = past_target_reach(_cfg(target, 2048))
    assert "2,048-token sequences, past the 128 positions" in note and "--train.seq_len 128" in note
    assert "past the 128" in past_target_reach(_cfg(target, 128, "128:2:4,512:1:2"))


def test_a_draft_within_its_targets_reach_is_not(tmp_path):
    assert past_target_reach(_cfg(_hf_target(tmp_path, 256), 256)) == ""
