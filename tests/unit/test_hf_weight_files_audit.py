"""Audit regressions (Hugging Face import): which stored tensors are the model's weights.

A directory holding both model.safetensors and a sharded index is
two models, and transformers reads the single file (it looks for it first) while longctx read the index. A
sharded save_pretrained into a directory that held a single-file save leaves exactly that (its clean-up
removes old shards only), so each read another model without a word; now it is one clear error. And a tied
model stored under lm_head.weight alone (safetensors' save_model keeps that one name of a shared tensor), which
transformers reads and longctx refused as weights that disagree with config.json."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from test_hf import hf_config, tokens  # noqa: E402

from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402


def _model(seed):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config())).eval()


def test_a_single_file_beside_a_sharded_index_is_refused_not_read_as_the_other_model(tmp_path):
    first, second = _model(1), _model(2)
    first.save_pretrained(tmp_path)  # model.safetensors
    second.save_pretrained(tmp_path, max_shard_size="50KB")  # shards + index; model.safetensors stays
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    t = tokens(seq=16)
    with torch.no_grad():  # the premise: transformers reads the single file, the first model
        assert torch.equal(theirs(t).logits, first(t).logits)
        assert not torch.equal(theirs(t).logits, second(t).logits)
    with pytest.raises(HFFormatError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        load_hf(tmp_path)


def test_a_stale_index_beside_a_single_file_save_is_said_as_such(tmp_path):
    """The other order: shards and index, then a single-file save, which removes the shards and leaves the index
    (transformers reads the single file); the error was "lists shards that are not in ... a partial download?"."""
    _model(2).save_pretrained(tmp_path, max_shard_size="50KB")
    _model(1).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("model-*.safetensors"))
    with pytest.raises(HFFormatError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        load_hf(tmp_path)


def _saved_by_safetensors(tmp_path, tie: bool):
    """A transformers model written with safetensors' save_model (as tools that save a model's state with it do):
    of the tied embedding and head it keeps one name, lm_head.weight."""
    from safetensors.torch import save_model

    config = hf_config(tie=tie)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).eval()
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_model(model, str(tmp_path / "model.safetensors"))
    return model


def test_a_tied_model_stored_under_its_head_name_alone_reads_as_transformers_reads_it(tmp_path):
    """transformers ties symmetrically when it loads, so a tied checkpoint holding lm_head.weight and no
    model.embed_tokens.weight is the same model; longctx refused it as weights that disagree with config.json."""
    model = _saved_by_safetensors(tmp_path, tie=True)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" not in f.keys()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    t = tokens(seq=16)
    with torch.no_grad():
        assert torch.equal(theirs(t).logits, model(t).logits)
        assert (load_hf(tmp_path)(t) - theirs(t).logits).abs().max().item() <= 1e-4


def test_an_untied_model_without_its_embedding_is_still_refused(tmp_path):
    _saved_by_safetensors(tmp_path, tie=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(HFFormatError, match="model.embed_tokens.weight"):
        load_hf(tmp_path)
