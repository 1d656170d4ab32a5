"""checkpoint/identity.py under a fine-tune that leaves a safetensors file's ends alone (an audit for silent wrong
results): a LoRA merged into every layer's attention q and k, the embedding (first in the file), the last layer's
v_proj and the final norm (last) unchanged. Its ENDS fingerprint (config.json, headers, first and last MiB) was the
target's own, so a GliDe draft trained against the target was used beside the fine-tune without a word
(generate/drafts.py) and a draft run resumed against it (checkpoint/manifest.py check_draft_matches). A draft that
recorded its target before the TENSORS part existed is still compared, by ENDS."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from longctx.checkpoint import identity
from longctx.checkpoint.identity import weights_identity
from longctx.checkpoint.manifest import CheckpointError, check_draft_matches
from longctx.errors import ConfigError
from longctx.generate.drafts import _check_target_identity

DIM, LAYERS = 512, 2  # each projection 1 MiB in fp32: the last MiB is the last v_proj and the norm


def _tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(2048, DIM, generator=g)}  # (4 MiB: the file's first MiB)
    for i in range(LAYERS):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{name}.weight"] = torch.randn(DIM, DIM, generator=g)
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(DIM)
    out["model.norm.weight"] = torch.ones(DIM)
    return out


def _hf_dir(path, tensors) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": DIM}))
    save_file(tensors, path / "model.safetensors")
    return f"hf:{path}"


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """hf: sources of a target, its LoRA fine-tune (q and k), a copy of the target and another seed's model."""
    root = tmp_path_factory.mktemp("identity")
    base = _tensors(0)
    g = torch.Generator().manual_seed(1)
    tuned = dict(base)
    for i in range(LAYERS):
        for name in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            tuned[key] = base[key] + 0.01 * torch.randn(DIM, 4, generator=g) @ torch.randn(4, DIM, generator=g)
    a = _hf_dir(root / "a", base)
    shutil.copytree(root / "a", root / "copy")
    return {"a": a, "tuned": _hf_dir(root / "tuned", tuned), "copy": f"hf:{root / 'copy'}",
            "other": _hf_dir(root / "other", _tensors(7))}


def _record(identity: str) -> dict:
    return {"target": {"identity": identity, "path": "/somewhere/a"}}


def test_a_fine_tune_that_keeps_the_files_ends_is_another_target(targets):
    a, tuned = weights_identity(targets["a"]), weights_identity(targets["tuned"])
    assert a != tuned, "a LoRA merged into q and k has the target's identity"
    assert weights_identity(targets["copy"]) == a
    assert not identity.same_weights(a, tuned) and identity.same_weights(a, weights_identity(targets["copy"]))


def test_a_draft_of_the_target_is_refused_beside_its_fine_tune(targets):
    _accepted_beside_one_refused_beside_other(weights_identity(targets["a"]), targets["copy"], targets["tuned"])


def test_a_draft_recorded_before_the_tensor_samples_is_compared_by_the_files_ends(targets):
    old = weights_identity(targets["a"]).split(".")[0]  # (what a draft recorded before: ENDS, 16 hex digits)
    assert len(old) == 16
    _accepted_beside_one_refused_beside_other(old, targets["a"], targets["other"])  # (its own target still accepted)


def _accepted_beside_one_refused_beside_other(recorded: str, same: str, other: str) -> None:
    """A draft whose record holds the target identity `recorded`: generate (_check_target_identity) and a resume
    (check_draft_matches) take it beside the weights `same` and refuse it beside `other`."""
    record = _record(recorded)
    _check_target_identity(record, "draft", same)
    with pytest.raises(ConfigError, match="other weights"):
        _check_target_identity(record, "draft", other)
    manifest = {"draft": {"kind": "glide", "layers": 1, "vocab": 0, **record}}
    check_draft_matches(manifest, 1, "ckpt", target_identity=weights_identity(same))
    with pytest.raises(CheckpointError, match="other weights"):
        check_draft_matches(manifest, 1, "ckpt", target_identity=weights_identity(other))
