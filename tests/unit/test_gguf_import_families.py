"""GGUF import of the other families (docs/checkpoints.md said only llama files had been tried): a qwen2 file
(q/k/v biases, tied or untied embeddings) imports and matches the model it was written from.

Audit regression: transformers' GGUF reader takes a Qwen3 file's head size from Qwen3Config's
default (128) and ignores the file's qwen3.attention.key_length. A file of another head size was refused as
"metadata that does not describe its tensors ... convert the model again", which no conversion fixes; the
refusal now names the key and the head size transformers would use. A file whose key_length is the one
transformers uses imports and matches the model it was written from."""

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import test_gguf_import as G  # noqa: E402
import test_hf  # noqa: E402

from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

NAMES = {**G.LAYER_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def tiny(family: str, head_dim: int = 0, tie: bool = False):
    extra = dict(head_dim=head_dim) if head_dim else {}
    cfg = transformers.AutoConfig.for_model(
        family, **extra, tie_word_embeddings=tie, vocab_size=len(G.TOKENS), hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
        max_position_embeddings=128, rope_theta=10000.0, initializer_range=0.1)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # (norms initialised to 1 and biases to 0: randomised so a wrong mapping shows)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


def write_family_gguf(model, path):
    """`model` as llama.cpp writes a qwen2 / qwen3 file (no q/k row permutation), with its key_length."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), cfg.model_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(G.TOKENS)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in G.TOKENS])
    w.add_token_merges(G.MERGES)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf in G.TOP_NAMES:
            name = G.TOP_NAMES[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{NAMES[module]}.{kind}"
        w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_qwen3_file_of_another_head_size_is_refused_naming_key_length(tmp_path):
    source = write_family_gguf(tiny("qwen3", 16), tmp_path / "q.gguf")
    with pytest.raises(GGUFImportError, match=r"qwen3\.attention\.key_length = 16.*head_dim 128"):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, head_dim, tie", [("qwen3", 128, False), ("qwen2", 0, False), ("qwen2", 0, True)])
def test_a_file_of_each_family_imports_exactly(tmp_path, family, head_dim, tie):
    model = tiny(family, head_dim, tie)
    import_gguf(write_family_gguf(model, tmp_path / "q.gguf"), tmp_path / "out", dtype="fp32")
    err = test_hf.max_err(load_hf(tmp_path / "out"), model, test_hf.tokens(vocab=len(G.TOKENS), seq=48))
    assert err <= G.TOL
