"""bf16 numerics of the model against transformers on the same weights, both measured against a float64
computation (transformers' eager LlamaForCausalLM / Qwen3ForCausalLM in float64).

Two ways a run computes in bf16: train.dtype = bf16 on the CPU or on one GPU is fp32 weights under bf16
autocast (step/loss.py; FSDP gathers fp32 there), and FSDP on GPUs gathers bf16 weights (parallel/fsdp/
shard.py mixed_precision), as generation casts the model (generate/loading.py). Each is compared with
transformers run the same way: the loss, logits and every gradient no worse than 2x transformers' error
(fp32 RMSNorm statistics, fp32 RoPE, fp32 softmax statistics in attention and in the loss, also chunked).

- q/k RMSNorm (Qwen3, OLMoE) under autocast: the norm's fp32 weight made q and k fp32 while v stayed bf16,
  so one process (train, eval score mode) failed inside the attention kernel ("expected scalar type Float
  but found BFloat16") and a ring layout (torch.stack([k, v]) promotes) silently ran attention in fp32.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longctx.models.hf import hf_name, load_hf  # noqa: E402
from longctx.ops.chunked import ChunkedLocalCore  # noqa: E402

BF16 = torch.bfloat16
VOCAB, SEQ = 256, 512


def hf_model(family: str, tmp_path, std: float = 0.1):
    """A random transformers model (norm weights randomised) and ours loaded from its saved directory."""
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=std)  # large: logits of order 1
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    hf = cls(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / family, safe_serialization=True)
    return hf, load_hf(tmp_path / family)


def tokens():
    t = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    return t, torch.cat([t[:, 1:], torch.full((1, 1), -100)], 1)


def hf_run(model, autocast: bool):
    t, _ = tokens()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(t, labels=t)
    out.loss.backward()
    return out.loss.detach().double(), out.logits.detach().double(), \
        {n: p.grad.double() for n, p in model.named_parameters()}


def ours_run(model, autocast: bool):
    t, labels = tokens()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = model(t, labels=labels)
        with torch.no_grad():
            logits = model(t)
    loss.backward()
    return loss.detach().double(), logits.detach().double(), \
        {hf_name(n): p.grad.double() for n, p in model.named_parameters()}


def float64_reference(hf):
    ref = copy.deepcopy(hf).double()
    ref.config._attn_implementation = "eager"
    return hf_run(ref, False)


def errors(run, ref) -> dict:
    """Relative errors against the float64 reference: loss, logits, and the gradients (all, and the worst)."""
    (loss, logits, grads), (r_loss, r_logits, r_grads) = run, ref

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    flat = torch.cat([grads[n].flatten() for n in r_grads]), torch.cat([r_grads[n].flatten() for n in r_grads])
    return {"loss": abs(float(loss - r_loss)) / abs(float(r_loss)), "logits": rel(logits, r_logits),
            "grads": rel(*flat), "worst grad": max(rel(grads[n], r_grads[n]) for n in r_grads)}


def assert_no_worse(ours: dict, theirs: dict, what: str):
    for key, err in ours.items():
        # (the loss is one mean over 511 tokens: its rounding errors partly cancel, by chance more on one side or
        # the other, so it gets a floor; fp32 softmax statistics keep it ~1e-4, bf16 ones gave 4e-3)
        assert err <= 2 * theirs[key] + (2e-4 if key == "loss" else 1e-4), \
            f"{what}: {key} relative error {err:.2e} against transformers' {theirs[key]:.2e}"


# (name, chunked: the LM head + loss in chunks of 128 tokens and memory.attention_chunk = 128)
WAYS = [("plain", False), ("chunked", True)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("way, chunked", WAYS, ids=[w for w, _ in WAYS])
def test_fp32_weights_under_bf16_autocast_are_no_worse_than_transformers(tmp_path, family, way, chunked):
    """train.dtype = bf16 on the CPU or one GPU: fp32 weights, bf16 autocast (Qwen3: q/k RMSNorm)."""
    hf, ours = hf_model(family, tmp_path)
    if chunked:
        ours.loss_chunk = 128
        for block in ours.layers:
            block.attention.core = ChunkedLocalCore(128)
    ref = float64_reference(hf)
    assert_no_worse(errors(ours_run(ours, True), ref), errors(hf_run(hf, True), ref), f"{family} {way}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_weights_are_no_worse_than_transformers_in_bf16(tmp_path, family):
    """FSDP's bf16 gathers on GPUs, and generation's cast of the model: bf16 weights (under autocast
    as a training forward runs them)."""
    hf, ours = hf_model(family, tmp_path)
    ref = float64_reference(hf)
    ours.to(BF16)
    ours.init_rope()
    theirs = errors(hf_run(hf.to(BF16), False), ref)
    assert_no_worse(errors(ours_run(ours, True), ref), theirs, f"{family} bf16 weights, autocast")
    assert_no_worse(errors(ours_run(ours, False), ref), theirs, f"{family} bf16 weights")


@pytest.mark.parametrize("span", ["head", "all"])
def test_qk_normed_attention_inputs_share_the_compute_dtype(tmp_path, span):
    """Under autocast the attention core gets q, k and v in bf16, whatever dtype the q/k norms' weights
    have (per head: Qwen3; over the projection: OLMoE)."""
    _, ours = hf_model("qwen3", tmp_path)
    if span == "all":  # OLMoE's span: norms over every head's projection together
        from longctx.models.llama import RMSNorm

        for block in ours.layers:
            a = block.attention
            a.qk_norm_all = True
            a.q_norm, a.k_norm = RMSNorm(a.heads * a.head_dim, 1e-5), RMSNorm(a.kv_heads * a.head_dim, 1e-5)
            a.q_norm.reset_parameters()
            a.k_norm.reset_parameters()
    seen = []
    for block in ours.layers:
        core = block.attention.core
        block.attention.core = lambda q, k, v, doc, core=core: (seen.append((q.dtype, k.dtype, v.dtype)),
                                                               core(q, k, v, doc))[1]
    ours_run(ours, True)
    assert seen and all(d == (BF16, BF16, BF16) for d in seen), seen
