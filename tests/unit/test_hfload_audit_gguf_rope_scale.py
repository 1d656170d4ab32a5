"""GGUF import: RoPE scaling that llama.cpp applies without a `rope.scaling.type` key is refused, not dropped.

llama.cpp reads a file's linear RoPE factor from `ARCH.rope.scaling.factor`, or the older `ARCH.rope.scale_linear`
(written by the convert.py of 2023 for linear-scaled models: SuperHOT, LongChat, Vicuna-16k), and takes the scaling
type as "linear" when the file has no `ARCH.rope.scaling.type`; it also multiplies cos and sin by
`ARCH.rope.scaling.attn_factor`. transformers' GGUF reader maps none of these keys, so such a file imported as a
model with unscaled RoPE: positions past the first few differ from the file's model, and the logits check after
writing (transformers against longctx, both without the scaling) passed. Audit regression: only a
`rope.scaling.type` other than none was refused."""

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import test_gguf_import as G  # noqa: E402

from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402


def _file_with(tmp_path, monkeypatch, keys: dict):
    """The tiny llama GGUF of test_gguf_import, with `keys` (suffix after "llama." -> value) in its metadata."""
    add_eps = gguf.GGUFWriter.add_layer_norm_rms_eps

    def add_eps_and_keys(writer, value):  # (write_gguf's last hyperparameter: the extra keys go beside it)
        add_eps(writer, value)
        for suffix, v in keys.items():
            if isinstance(v, str):
                writer.add_string(f"llama.{suffix}", v)
            else:
                writer.add_float32(f"llama.{suffix}", v)

    monkeypatch.setattr(gguf.GGUFWriter, "add_layer_norm_rms_eps", add_eps_and_keys)
    return G.write_gguf(G.tiny_llama(), tmp_path / "scaled.gguf")


@pytest.mark.parametrize("keys, named", [
    ({"rope.scale_linear": 4.0}, "llama.rope.scale_linear = 4"),
    ({"rope.scaling.factor": 2.0}, "llama.rope.scaling.factor = 2"),
    ({"rope.scaling.attn_factor": 0.5}, "llama.rope.scaling.attn_factor = 0.5"),
], ids=["old-scale-linear", "factor-without-type", "attn-factor"])
def test_scaling_llama_cpp_applies_without_a_type_key_is_refused(tmp_path, monkeypatch, keys, named):
    source = _file_with(tmp_path, monkeypatch, keys)
    with pytest.raises(GGUFImportError, match=rf"{named}.*transformers' GGUF reader"):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keys", [
    {"rope.scaling.type": "none", "rope.scaling.factor": 4.0},  # (llama.cpp never scales with type none)
    {"rope.scaling.factor": 1.0, "rope.scaling.attn_factor": 1.0},  # (identity)
    {"rope.scale_linear": 0.0},  # (0: llama.cpp's "not set")
], ids=["type-none", "factor-one", "zero"])
def test_metadata_whose_scaling_is_the_identity_imports(tmp_path, monkeypatch, keys):
    source = _file_with(tmp_path, monkeypatch, keys)
    result = import_gguf(source, tmp_path / "out")
    assert result.max_logit_diff <= 1e-4
