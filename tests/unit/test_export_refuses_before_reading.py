"""`longctx checkpoint export` of a model its family's config.json cannot express (a sigmoid router, a switch
or dense-layer Mixtral) is refused from the manifest, before the whole model is built and its weights read
(for a large MoE: minutes and the model's size in host memory, then the same refusal). The checkpoints here hold
a manifest only: before the refusal moved ahead, export built the model and failed reading the missing weights."""

import json

import pytest

from longctx.checkpoint import export
from longctx.checkpoint.manifest import FORMAT
from longctx.config.hf import HFFormatError, model_defaults

MODEL = {**model_defaults(), "dim": 32, "layers": 2, "heads": 2, "kv_heads": 2, "ffn_dim": 16, "vocab_size": 64,
         "max_seq_len": 64, "moe.experts": 4, "moe.top_k": 1, "preset": "debug"}
CASES = {
    "switch-mixtral": ({"family": "mixtral", "moe.router": "switch"}, "mixtral renormalises its top-1 weight"),
    "sigmoid": ({"family": "olmoe", "qk_norm": True, "qk_norm_span": "all", "moe.router": "sigmoid"},
                "model.moe.router=sigmoid"),
    "mixtral-dense": ({"family": "mixtral", "moe.dense_layers": "0"}, "model.moe.dense_layers"),
}


@pytest.mark.parametrize("name", CASES)
def test_refused_from_the_manifest(tmp_path, monkeypatch, name):
    keys, said = CASES[name]
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 1, "model": {**MODEL, **keys},
                                                    "files": []}))

    def read(*_):
        raise AssertionError("the weights were read before the refusal")

    monkeypatch.setattr(export, "load_model_weights", read)
    with pytest.raises(HFFormatError, match="cannot be written as a Hugging Face") as err:
        export.export_hf(step, tmp_path / "out")
    assert said in str(err.value)
    assert not (tmp_path / "out").exists()
