"""An export of a MoE that started from a Hugging Face config.json and trained without a balancing loss keeps
that config.json's router_aux_loss_coef (its family's default where it has none): config.json says
output_router_logits=false either way, and the 0.0 written before left whoever turns it on for the export (a
transformers fine-tune) with no balancing loss where the source model has 0.01 (OLMoE's). A run that trained
with one writes its own; a from-scratch run has no source to keep. The checkpoints here hold a manifest only
(the weights' values do not enter config.json)."""

import json

import pytest

from longctx.checkpoint import export
from longctx.checkpoint.manifest import FORMAT
from longctx.config.hf import model_fields_from_hf

OLMOE = dict(model_type="olmoe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
             vocab_size=64, num_experts=4, num_experts_per_tok=2, output_router_logits=False,
             max_position_embeddings=64)


def _export(tmp_path, monkeypatch, hf, init_from=True, **over):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(hf))
    model = {**model_fields_from_hf(hf), "init_from": f"hf:{source}" if init_from else "", "preset": "hf", **over}
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 1, "model": model, "files": []}))
    monkeypatch.setattr(export, "load_model_weights", lambda *_: None)
    out = export.export_hf(step, tmp_path / "out")[0]
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("given, kept", [(0.01, 0.01), (None, 0.01), (0.3, 0.3)])
def test_the_source_coefficient_is_kept(tmp_path, monkeypatch, given, kept):
    hf = {**OLMOE, **({"router_aux_loss_coef": given} if given is not None else {})}
    written = _export(tmp_path, monkeypatch, hf)
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (False, kept)


def test_a_run_with_its_own_balancing_loss_writes_its_own(tmp_path, monkeypatch):
    written = _export(tmp_path, monkeypatch, {**OLMOE, "router_aux_loss_coef": 0.01},
                      **{"moe.aux_loss": 0.02, "moe.aux_loss_scope": "pooled"})
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.02)


def test_a_run_from_scratch_has_none_to_keep(tmp_path, monkeypatch):
    written = _export(tmp_path, monkeypatch, {**OLMOE, "router_aux_loss_coef": 0.01}, init_from=False)
    assert written["router_aux_loss_coef"] == 0.0
