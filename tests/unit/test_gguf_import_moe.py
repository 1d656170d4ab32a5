"""GGUF import of the MoE families (docs/checkpoints.md said qwen2_moe and qwen3_moe files "can pass" its checks,
and none had been tried). A tiny Qwen2-MoE (4 experts, top-2, shared expert and its gate) and Qwen3-MoE (4 experts,
top-2, every layer sparse) are written as llama.cpp's convert_hf_to_gguf.py writes them: experts stacked into
blk.N.ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the shared expert as ffn_*_shexp and its gate as
ffn_gate_inp_shexp; expert_count, expert_used_count, expert_feed_forward_length and
expert_shared_feed_forward_length in the metadata.

What transformers' reader (5.2x) does with them, which these tests hold: it reads the expert tensors under their
names without ".weight" (the import refused every such file as "dropping" them); it ignores
expert_feed_forward_length and expert_shared_feed_forward_length (Qwen2MoeConfig's 1408 / 5632 and
Qwen3MoeConfig's 768 are taken whatever the file says), so a file of other expert sizes cannot be read; and it
reads the shared-expert gate only in the 1-D form older conversions wrote (current ones write it (1, hidden))."""

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import test_gguf_import as G  # noqa: E402
import test_hf  # noqa: E402

from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

# transformers' name (within model.layers.i) -> llama.cpp's (within blk.i); stacked experts are written apart
NAMES = {**G.LAYER_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# the expert sizes transformers' reader takes (its config classes' defaults: it does not read the file's keys)
READ_SIZES = {"qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
              "qwen3_moe": dict(moe_intermediate_size=768)}


def tiny_moe(family: str, **sizes):
    """2 layers, 4 experts, top-2, every layer sparse; qwen3_moe with a head size (16) that only
    attention.key_length gives (hidden / heads is 32), qwen2_moe with its q/k/v biases and shared expert."""
    extra = dict(head_dim=16, norm_topk_prob=True) if family == "qwen3_moe" else {}
    cfg = transformers.AutoConfig.for_model(
        family, **{**READ_SIZES[family], **sizes, **extra}, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, vocab_size=len(G.TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, max_position_embeddings=128,
        rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # (norms 1 and biases 0 at init: randomised so a wrong mapping shows; the router
        for name, p in model.named_parameters():  # spread so tokens take different experts)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
    return model


def write_moe_gguf(model, path, shexp_gate_2d=False):
    """`model` as convert_hf_to_gguf.py writes a qwen2moe / qwen3moe file (F32). The shared-expert gate (1, hidden)
    is written 1-D, as older conversions wrote it (squeezed), unless `shexp_gate_2d` (current ones)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), ARCH[cfg.model_type])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(G.TOKENS)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in G.TOKENS])
    w.add_token_merges(G.MERGES)
    for name, t in gguf_tensors(model, shexp_gate_2d):
        w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tensors(model, shexp_gate_2d):
    """(llama.cpp's name, tensor): transformers' fused experts.gate_up_proj (experts, 2 x ff, hidden) split into
    ffn_gate_exps and ffn_up_exps (experts, ff, hidden), as the converter splits it."""
    for hf, t in model.state_dict().items():
        if hf in G.TOP_NAMES:
            yield G.TOP_NAMES[hf], t
            continue
        _, _, i, rest = hf.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            ff = t.shape[1] // 2
            yield f"blk.{i}.ffn_gate_exps.weight", t[:, :ff]
            yield f"blk.{i}.ffn_up_exps.weight", t[:, ff:]
        elif rest == "mlp.experts.down_proj":
            yield f"blk.{i}.ffn_down_exps.weight", t
        else:
            module, kind = rest.rsplit(".", 1)
            if module == "mlp.shared_expert_gate" and not shexp_gate_2d:
                t = t.squeeze(0)
            yield f"blk.{i}.{NAMES[module]}.{kind}", t


def logits_err(ours, model) -> float:
    return test_hf.max_err(ours, model, test_hf.tokens(vocab=len(G.TOKENS), seq=48))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_the_written_file_as_the_model(tmp_path, family):
    """The reference: the file written here is one transformers reads back to the model it came from."""
    model = tiny_moe(family)
    path = write_moe_gguf(model, tmp_path / "moe.gguf")
    read = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, local_files_only=True,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    assert logits_err(lambda t: read(t).logits, model) <= G.TOL


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_a_moe_file_imports_exactly(tmp_path, family):
    model = tiny_moe(family)
    result = import_gguf(write_moe_gguf(model, tmp_path / "moe.gguf"), tmp_path / "out", dtype="fp32")
    assert result.architecture == family
    assert logits_err(load_hf(tmp_path / "out"), model) <= G.TOL


@pytest.mark.parametrize("family, sizes, key", [
    ("qwen2_moe", dict(moe_intermediate_size=32), r"qwen2moe\.expert_feed_forward_length = 32.*1408"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=6000),
     r"qwen2moe\.expert_shared_feed_forward_length = 6000.*5632"),
    ("qwen3_moe", dict(moe_intermediate_size=1000), r"qwen3moe\.expert_feed_forward_length = 1000.*768"),
])
def test_expert_sizes_transformers_does_not_read_are_refused_naming_the_key(tmp_path, family, sizes, key):
    """Smaller experts than transformers' default were refused as metadata that "does not describe its tensors ...
    convert again", larger ones crashed in transformers (RuntimeError, size mismatch) after building the model."""
    source = write_moe_gguf(tiny_moe(family, **sizes), tmp_path / "moe.gguf")
    with pytest.raises(GGUFImportError, match=key):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_2d_shared_expert_gate_is_refused_before_reading(tmp_path):
    """(1, hidden), as current conversions write it: transformers' reader adds a dimension to it and fails with a
    size mismatch (a RuntimeError out of the import) after building the model."""
    source = write_moe_gguf(tiny_moe("qwen2_moe"), tmp_path / "moe.gguf", shexp_gate_2d=True)
    with pytest.raises(GGUFImportError, match=r"blk\.0\.ffn_gate_inp_shexp\.weight.*\(1, 64\)"):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
