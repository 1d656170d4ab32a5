"""Our Llama against transformers.LlamaForCausalLM on random tiny configs (fp32, logits within 1e-4)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.models.hf import HFFormatError, config_from_hf, load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

TOL = 1e-4

CASES = {
    "gqa-2kv-untied": dict(heads=4, kv_heads=2, rope_theta=500000.0, tie=False, llama3=False),
    "gqa-2kv-tied": dict(heads=4, kv_heads=2, rope_theta=500000.0, tie=True, llama3=False),
    "llama3-scaling-untied": dict(heads=8, kv_heads=2, rope_theta=500000.0, tie=False, llama3=True),
    "llama3-scaling-tied": dict(heads=4, kv_heads=2, rope_theta=500000.0, tie=True, llama3=True),
    "mha-theta10k": dict(heads=4, kv_heads=4, rope_theta=10000.0, tie=False, llama3=False),
}


def hf_config(case, form):
    """A transformers LlamaConfig dict in the classic (rope_theta + rope_scaling) or new (rope_parameters) form."""
    c = CASES[case]
    d = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
             num_hidden_layers=2, num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
             vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=c["tie"],
             hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="float32",
             initializer_range=0.1)  # larger than usual: logits of order 1 make 1e-4 a strict bound
    # original_max_position_embeddings small, so positions up to 200 exercise all three frequency bands
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32) if c["llama3"] else None
    if form == "classic":
        d.update(rope_theta=c["rope_theta"], rope_scaling=scaling)
    else:
        d["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": c["rope_theta"]}
    return d


def random_hf_dir(tmp_path, case, form, shards=1):
    """Write a random HF checkpoint made by transformers itself (independent of our writer)."""
    cfg = transformers.LlamaConfig(**hf_config(case, form))
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: randomise so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    d = tmp_path / f"{case}-{form}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config(case, form)))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if shards == 1:
        save_file(state, str(d / "model.safetensors"))
    else:
        names = list(state)
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in part}, str(d / fname))
            weight_map.update({n: fname for n in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d, model


def tokens(vocab=300, seq=200):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", ["classic", "rope_parameters"])
def test_load_hf_logits_match_transformers(tmp_path, case, form):
    d, ref = random_hf_dir(tmp_path, case, form, shards=1 if form == "classic" else 3)
    ours = load_hf(d, dtype=torch.float32)
    t = tokens()
    with torch.no_grad():
        err = (ours(t) - ref(t).logits).abs().max().item()
    assert err <= TOL, f"max abs logits error {err}"
    assert ours.cfg.tie_embeddings == CASES[case]["tie"]
    assert (ours.cfg.rope_scaling == "llama3") == CASES[case]["llama3"]


def test_parity_check_can_fail(tmp_path):
    """The comparison is sensitive to the classic mapping bug: q/k rows in the interleaved (Meta)
    RoPE order instead of Hugging Face's half-split order."""
    d, ref = random_hf_dir(tmp_path, "gqa-2kv-untied", "classic")
    ours = load_hf(d)
    hd = ours.cfg.resolved_head_dim
    interleave = torch.arange(hd).view(2, hd // 2).t().reshape(-1)  # 0, hd/2, 1, hd/2+1, ...
    with torch.no_grad():
        for layer in ours.layers:
            for w in (layer.attention.wq.weight, layer.attention.wk.weight):
                heads = w.shape[0] // hd
                w.copy_(w.view(heads, hd, -1)[:, interleave].reshape_as(w))
    t = tokens()
    with torch.no_grad():
        assert (ours(t) - ref(t).logits).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("case", list(CASES))
def test_save_hf_loads_in_transformers(tmp_path, case):
    c = CASES[case]
    cfg = load_config(overrides=[
        "--model.dim=64", "--model.ffn_dim=160", "--model.layers=2", f"--model.heads={c['heads']}",
        f"--model.kv_heads={c['kv_heads']}", f"--model.rope_theta={c['rope_theta']}",
        f"--model.tie_embeddings={c['tie']}", "--model.vocab_size=300",
        f"--model.rope_scaling={'llama3' if c['llama3'] else 'none'}", "--model.rope_original_max_len=32",
    ]).model
    ours = build_model(cfg, seed=7)
    out = save_hf(ours, tmp_path / "export", max_shard_bytes=200_000)  # force several shards
    assert (out / "model.safetensors.index.json").is_file()
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    t = tokens()
    with torch.no_grad():
        err = (ours(t) - theirs(t).logits).abs().max().item()
    assert err <= TOL
    back = load_hf(out)
    for (n, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n


def test_bf16_load(tmp_path):
    d, _ = random_hf_dir(tmp_path, "gqa-2kv-untied", "classic")
    m = load_hf(d, dtype=torch.bfloat16)
    assert m.tok_embeddings.weight.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32


def test_unsupported_or_broken_checkpoints_are_explained(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        load_hf(tmp_path)
    d, _ = random_hf_dir(tmp_path, "gqa-2kv-untied", "classic")
    (d / "model.safetensors").unlink()
    with pytest.raises(HFFormatError, match="neither model.safetensors"):
        load_hf(d)
    with pytest.raises(HFFormatError, match="attention_bias"):
        config_from_hf({**hf_config("gqa-2kv-untied", "classic"), "attention_bias": True})
    with pytest.raises(HFFormatError, match="rope type 'yarn'"):
        config_from_hf({**hf_config("gqa-2kv-untied", "classic"), "rope_scaling": {"rope_type": "yarn", "factor": 2}})
