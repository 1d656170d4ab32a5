"""The export of a yarn model whose checkpoint records fewer trained positions than yarn's original x factor
(a run trained from scratch under the scaling, or an extension whose original length the weights never reached):
config.json's max_position_embeddings is original x factor (config/hf_export.py _max_positions: transformers
before 4.56 derive yarn's factor from that ratio), and every reader of a yarn config.json (vLLM, longctx's own
hf: reader) trusts original x factor whatever it says. The export then reaches further than its checkpoint,
silently: its note even said that max_position_embeddings "is the positions the weights trained on"."""

import json
import warnings

import pytest
import torch.distributed.checkpoint as dcp

from longctx.checkpoint.export import export_hf
from longctx.checkpoint.manifest import write_manifest
from longctx.config import load_config
from longctx.config.load import to_dict
from longctx.config.positions import model_reach
from longctx.models.llama import build_model

_YARN = ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=128"]


def _checkpoint(tmp_path, trained: int, overrides=()):
    """A one-step checkpoint of a tiny yarn model whose manifest records `trained` positions."""
    cfg = load_config(overrides=["--model.layers=1", "--model.dim=32", "--model.ffn_dim=64", *_YARN, *overrides])
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():  # (DCP's "assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build_model(cfg.model).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(cfg)["model"], tokenizer="byte", trained_positions=trained)
    return step


def _reach(init_from: str) -> int:
    return model_reach(load_config(overrides=[f"--model.init_from={init_from}", "--train.seq_len=64"]).model).positions


@pytest.mark.parametrize("scaling, written, reach", [
    ([], 512, 512),  # max_position_embeddings original x factor (128 x 4)
    (["--model.rope_factor=2.5", "--model.rope_original_max_len=101"], 64, 252),  # (252.5: the record)
])
def test_an_export_that_reaches_further_than_its_checkpoint_says_so(tmp_path, scaling, written, reach):
    step = _checkpoint(tmp_path, trained=64, overrides=scaling)
    out, _, _, notes = export_hf(step, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == written
    assert (_reach(str(step)), _reach(f"hf:{out}")) == (64, reach)  # the export is trusted further, silently
    # (the note said "max_position_embeddings is 512: the 64 positions the weights trained on": untrue)
    assert written == 64 or not any(f"is {written}: the 64 positions" in n for n in notes), notes
    said = [n for n in notes if "trust" in n]
    assert len(said) == 1 and f"{reach} positions" in said[0] and "the 64 the weights trained on" in said[0], notes


@pytest.mark.parametrize("trained, noted", [(512, False), (1024, True)])
def test_an_export_that_reaches_as_far_as_its_checkpoint_adds_no_such_note(tmp_path, trained, noted):
    """At original x factor, or past it (max_position_embeddings is then the record, and the 4.56 note says why),
    the export reaches what its checkpoint does: no reach note."""
    step = _checkpoint(tmp_path, trained=trained)
    out, _, _, notes = export_hf(step, tmp_path / "hf")
    assert _reach(str(step)) == _reach(f"hf:{out}") == trained
    assert not any("trust" in n for n in notes), notes
    assert any("transformers before 4.56" in n for n in notes) == noted
