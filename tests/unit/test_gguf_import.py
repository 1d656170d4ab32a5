"""`longctx checkpoint import`: a GGUF file written here, as llama.cpp writes one, from a random
transformers Llama comes back as a Hugging Face directory on which longctx's logits equal the original
model's; and the import's refusals, each before any weight is read. No network."""

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import test_hf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from longctx.checkpoint import gguf_import  # noqa: E402
from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402
from longctx.cli import main  # noqa: E402
from longctx.config.hf import HFFormatError, read_hf_config  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

TOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet, byte 0 to 255: printable Latin-1 bytes stand for themselves, the
    others (control characters, space...) for chr(256 + n), n counting them in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


# a byte-level BPE vocabulary: GPT-2's 256 byte symbols, three merges that make " the", BOS and EOS
BYTE_SYMBOLS = byte_symbols()
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = BYTE_SYMBOLS + ["Ġt", "he", "Ġthe", "<s>", "</s>"]
THE, BOS, EOS = TOKENS.index("Ġthe"), TOKENS.index("<s>"), TOKENS.index("</s>")
# transformers' name (within model.layers.i) -> llama.cpp's (within blk.i)
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def tiny_llama(tie=False, bf16_exact=False):
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=HEADS * HEAD_DIM, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=10000.0,
                                   tie_word_embeddings=tie, initializer_range=0.1)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (initialised to 1: randomised so a swapped norm shows)
                p.uniform_(0.5, 1.5)
            if bf16_exact:
                p.copy_(p.bfloat16().float())
    return model


def llama_cpp_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q / k rows as llama.cpp stores them: each head's rows [first half | second half] (the
    rotate-half RoPE pairs i and i + head_dim / 2) interleaved to 0, h/2, 1, h/2 + 1, ..."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER_NAMES[module]}.{kind}"


def write_gguf(model, path, permute=True, extra_tensors=(), name="tiny llama"):
    """`model` as a llama GGUF file (F32 tensors), with the byte-level BPE tokenizer."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in TOKENS])  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model has no output.weight (transformers then ties)
        if permute and (".q_proj." in hf or ".k_proj." in hf):
            t = llama_cpp_rows(t, HEADS if ".q_proj." in hf else KV_HEADS)
        w.add_tensor(gguf_name(hf), t.float().contiguous().numpy())
    for tensor_name, array in extra_tensors:
        w.add_tensor(tensor_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def max_err(hf_dir, reference) -> float:
    """Max |longctx's logits on `hf_dir` - the transformers model `reference`'s| (test_hf's comparison)."""
    return test_hf.max_err(load_hf(hf_dir), reference, test_hf.tokens(vocab=len(TOKENS), seq=48))


def test_import_matches_the_model_that_was_written(tmp_path, capsys):
    model = tiny_llama()
    source = write_gguf(model, tmp_path / "tiny.gguf")
    out = tmp_path / "imported"
    assert main(["checkpoint", "import", str(source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"hf:{out}" in printed and "2 layers" in printed and f"{sum(p.numel() for p in model.parameters()):,}" \
        in printed and f"vocabulary {len(TOKENS)}" in printed and "fp32" in printed
    assert max_err(out, model) <= TOL  # llama.cpp's q/k permutation undone, every tensor where it belongs
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS, EOS)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode(" the cat", add_special_tokens=False).ids[0] == THE  # the file's merges came along
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    with pytest.raises(GGUFImportError, match="not empty.*--force"):
        import_gguf(source, out)
    (out / "stale.txt").write_text("from an earlier import")
    import_gguf(hf_source := f"hf:{source}", out, force=True)  # hf:FILE.gguf is read too; --force replaces
    assert not (out / "stale.txt").exists() and max_err(out, model) <= TOL, hf_source


def test_the_comparison_catches_q_k_rows_left_in_llama_cpp_order(tmp_path):
    """A file written without llama.cpp's permutation is read by transformers as permuted: the import
    (longctx = transformers) passes, and the comparison with the original model fails."""
    model = tiny_llama()
    out = tmp_path / "imported"
    import_gguf(write_gguf(model, tmp_path / "plain.gguf", permute=False), out)
    assert max_err(out, model) > 100 * TOL


def test_auto_dtype_keeps_bf16_exact_weights_in_bf16_and_tied_embeddings_tied(tmp_path):
    model = tiny_llama(tie=True, bf16_exact=True)
    out = tmp_path / "imported"
    result = import_gguf(write_gguf(model, tmp_path / "tied.gguf"), out)
    assert (result.dtype, result.max_logit_diff <= TOL) == ("bf16", True)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    assert max_err(out, model) <= TOL
    assert import_gguf(tmp_path / "tied.gguf", tmp_path / "fp32", dtype="fp32").dtype == "fp32"


def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch):
    source = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(source.read_bytes())
    split = tmp_path / "model-00001-of-00002.gguf"
    split.write_bytes(source.read_bytes())
    rope = write_gguf(tiny_llama(), tmp_path / "rope.gguf",
                      extra_tensors=[("rope_freqs.weight", torch.ones(HEAD_DIM // 2).numpy())])
    for bad, match in [
        (dict(source=tmp_path / "missing.gguf"), "no such file"),
        (dict(source=text), "not a GGUF file"),
        (dict(source=tmp_path / "two"), "2 .gguf files"),
        (dict(source=split), "split GGUF"),
        (dict(source=rope), "rope_freqs"),
        (dict(source=source, out=tmp_path), "holds the file being imported"),
        (dict(source=source, dtype="fp16"), "expected fp32, bf16 or auto"),
    ]:
        with pytest.raises(GGUFImportError, match=match):
            import_gguf(**{"out": out, **bad})
    real_find_spec = gguf_import.find_spec
    monkeypatch.setattr(gguf_import, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(GGUFImportError, match=r"pip install gguf\b"):
        import_gguf(source, out)
    assert not out.exists()
    assert main(["checkpoint", "import", str(source)]) == 2  # no output directory
    with pytest.raises(HFFormatError, match="longctx checkpoint import"):  # hf:FILE.gguf elsewhere: how to import
        read_hf_config(source)


def test_a_tensor_transformers_would_drop_is_refused(tmp_path):
    """A q bias that the llama metadata does not declare: transformers' reader skips it silently."""
    bias = ("blk.0.attn_q.bias", torch.ones(HEADS * HEAD_DIM).numpy())
    source = write_gguf(tiny_llama(), tmp_path / "bias.gguf", extra_tensors=[bias])
    with pytest.raises(GGUFImportError, match="blk.0.attn_q.bias"):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
