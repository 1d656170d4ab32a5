"""Randomized audit of `longctx checkpoint import` (GGUF -> Hugging Face directory) against an independent
reference (tests/gguf_fuzz119_reference.py): seeded random tiny llama / qwen2 / qwen3 files (GQA head counts, tied
or untied embeddings, RoPE bases and scaling kinds, vocabulary sizes, F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 /
Q5_0 / Q5_1 tensors) written with the `gguf` package are imported, and the directory is compared with what the
file's bytes say: config fields, every weight (dequantized by gguf.quants, llama.cpp's q/k row order undone from
the convention), the tokenizer, and logits against transformers' own model class built from the draw's numbers
and against transformers reading the GGUF file itself. Files with RoPE scaling, and damaged files, must be refused
before any weight is read, with a message naming the problem. (longctx has no GGUF export: nothing to round-trip.)
"""

import json
import re

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import gguf_fuzz119_reference as R  # noqa: E402
from longctx.checkpoint import gguf_import  # noqa: E402
from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

SEEDS = range(24)
SEQ = 24


def _rope_theta(config: dict) -> float:
    return config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")


def _check_config(d, out):
    config = json.loads((out / "config.json").read_text())
    got = {k: config.get(k) for k in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                      "hidden_size", "intermediate_size", "vocab_size", "tie_word_embeddings",
                                      "max_position_embeddings")}
    assert got == dict(model_type=d.family, num_hidden_layers=d.layers, num_attention_heads=d.heads,
                       num_key_value_heads=d.kv_heads, hidden_size=d.hidden, intermediate_size=d.ffn,
                       vocab_size=d.vocab, tie_word_embeddings=d.tie, max_position_embeddings=d.context)
    assert _rope_theta(config) == pytest.approx(d.rope_theta, rel=1e-6)
    assert config["rms_norm_eps"] == pytest.approx(d.norm_eps, rel=1e-6)
    # longctx's reading of the directory (what train / generate build) says the same
    cfg = load_hf(out).cfg
    assert (cfg.family, cfg.layers, cfg.heads, cfg.kv_heads, cfg.dim, cfg.ffn_dim, cfg.vocab_size,
            cfg.tie_embeddings, cfg.rope_scaling) == (d.family, d.layers, d.heads, d.kv_heads, d.hidden, d.ffn,
                                                      d.vocab, d.tie, "none")
    assert (cfg.head_dim or cfg.dim // cfg.heads) == d.head_dim
    assert cfg.rope_theta == pytest.approx(d.rope_theta, rel=1e-6) and cfg.norm_eps == pytest.approx(d.norm_eps,
                                                                                                       rel=1e-6)


def _check_weights(d, out, want):
    got = load_file(str(out / "model.safetensors"))
    if d.tie:  # (a tied lm_head may be left out of the file, or saved equal to the embedding)
        assert "lm_head.weight" not in got or torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
        got.setdefault("lm_head.weight", got["model.embed_tokens.weight"])
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), f"{name}: max diff {(got[name] - value).abs().max().item():.3g}"


def _check_tokenizer(d, out):
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == d.vocab
    assert all(tok.token_to_id(t) == i for i, t in enumerate(d.tokens))  # ids in the file's order
    text = " the cat sat at the mat, héllo\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [d.tokens.index("Ġthe"), d.tokens.index("Ġcat")]  # the file's merges came along
    assert tok.decode(ids) == text
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen.get("bos_token_id"), gen.get("eos_token_id")) == (d.tokens.index("<s>"), d.tokens.index("</s>"))


@torch.no_grad()
def _check_logits(d, source, out, want):
    tokens = torch.randint(0, d.vocab, (2, SEQ), generator=torch.Generator().manual_seed(d.seed))
    ours = load_hf(out)(tokens).float()
    reference = R.reference_model(d, want)(tokens).logits
    bound = 1e-4 * max(1.0, reference.abs().max().item())
    assert (ours - reference).abs().max().item() <= bound
    direct = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                               dtype=torch.float32, local_files_only=True).eval()
    assert (ours - direct(tokens).logits).abs().max().item() <= bound


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_gguf_imports_as_its_bytes_say(tmp_path, seed):
    d = R.draw(seed)
    source = tmp_path / f"fuzz{seed}.gguf"
    made = R.write(d, source)
    out = tmp_path / "out"
    scaled = {k: v for k, v in d.rope_scaling.items() if d.rope_scaling.get("rope.scaling.type") != "none"}
    if scaled:  # transformers' reader drops RoPE scaling: refused, naming the key, before any weight is read
        kind = scaled["rope.scaling.type"]
        with pytest.raises(GGUFImportError, match=rf"{d.family}\.rope\.scaling\.type = '{kind}'"):
            import_gguf(source, out)
        assert not out.exists()
        return
    result = import_gguf(source, out, dtype="fp32")
    assert result.stored_types == _counts(d)
    want = R.expected(d, source)
    for name, value in made.items():  # the reference itself: F32 tensors come back exactly as they were made
        if d.types.get(name, R.Q.F32) == R.Q.F32:
            assert torch.equal(want[R.hf_name(name)], torch.from_numpy(value)), name
    _check_config(d, out)
    _check_weights(d, out, want)
    _check_tokenizer(d, out)
    _check_logits(d, source, out, want)


def _counts(d) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in d.types.values():
        counts[kind.name] = counts.get(kind.name, 0) + 1
    return counts


def _refused_before_work(monkeypatch, source, out, match):
    """The import refuses `source` with a message matching `match`, before transformers builds the model."""
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the refusal")

    monkeypatch.setattr(gguf_import, "load_model", no_weights)
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(source, out)
    assert not out.exists()


@pytest.mark.parametrize("cut", [0.05, 0.5, 0.97])
def test_a_truncated_file_is_refused_before_work(tmp_path, monkeypatch, cut):
    d = R.draw(0)
    whole = tmp_path / "whole.gguf"
    R.write(d, whole)
    data = whole.read_bytes()
    source = tmp_path / "cut.gguf"
    source.write_bytes(data[:int(len(data) * cut)])
    _refused_before_work(monkeypatch, source, tmp_path / "out", "truncated")


@pytest.mark.parametrize("arch", ["notallama", "mistral"])
def test_an_unknown_architecture_is_refused_naming_it(tmp_path, monkeypatch, arch):
    """Audit regression (mistral): gguf-py has no `mistral` architecture (llama.cpp writes Mistral models as
    `llama`), and transformers' reader raised NotImplementedError (a traceback) once loading had begun."""
    d = R.draw(0)
    source = tmp_path / "odd.gguf"
    R.write(d, source, arch=arch)
    _refused_before_work(monkeypatch, source, tmp_path / "out", f"general.architecture = '{arch}'")


def test_a_missing_tensor_is_refused_naming_it(tmp_path, monkeypatch):
    d = R.draw(1)
    source = tmp_path / "missing.gguf"
    R.write(d, source, drop=("blk.0.ffn_up.weight",))
    _refused_before_work(monkeypatch, source, tmp_path / "out", r"lacks 1 tensor\(s\): blk\.0\.ffn_up\.weight")


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.0.attn_k.weight", "token_embd.weight"])
def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path, monkeypatch, name):
    d = R.draw(1)
    for key in d.types:
        d.types[key] = R.Q.F32
    rows, cols = R.shapes(d)[name]
    source = tmp_path / "shape.gguf"
    R.write(d, source, reshape={name: (rows + 2, cols)})
    named = rf"another shape .*{re.escape(name)} \({rows + 2}, {cols}\) where"
    _refused_before_work(monkeypatch, source, tmp_path / "out", named)


def test_the_tokenizer_gives_no_id_the_model_lacks(tmp_path):
    """Audit regression: transformers' byte-level GGUF tokenizer adds GPT-2's `<|endoftext|>` as id = the file's
    token count when the file does not list it (a Llama 3 file, or this one), so the imported tokenizer had 1 token
    more than the model's embedding rows: the text "<|endoftext|>" encoded to an id that crashed the model (index
    out of range) and training refused the tokenizer as larger than model.vocab_size."""
    from longctx.data.tokenizer import load_tokenizer

    d = R.draw(0)
    R.write(d, tmp_path / "a.gguf")
    import_gguf(tmp_path / "a.gguf", tmp_path / "out", dtype="fp32")
    tokenizer = load_tokenizer(str(tmp_path / "out" / "tokenizer.json"))
    assert tokenizer.vocab_size == d.vocab  # (was d.vocab + 1)
    ids = tokenizer.encode("hello <|endoftext|>")
    assert max(ids) < d.vocab
    with torch.no_grad():
        load_hf(tmp_path / "out")(torch.from_numpy(ids).long().unsqueeze(0))
