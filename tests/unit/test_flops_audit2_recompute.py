"""The recomputed FLOPs memory/accounting.py counts (`recompute_flops`: `longctx bench memory`'s
recompute_flops_per_token, the planner's step time and its "compute (N% recompute)" bottleneck) against
torch's FlopCounterMode on a real backward under each policy, less the same model's under `none`.

torch's non-reentrant checkpoint stops a recomputation once the last tensor its forward saved is back
(early stop), so the matmul at the end of `post` whose output nothing saves (the SwiGLU's down projection
w2; a MoE layer's ungated shared expert's, which runs after the combine) is never run again; under
full recomputation with block chunks the block's own recomputation also stops before the last chunk's
`post`, which its chunk's checkpoint re-runs. The count had every `pre` and `post` matmul re-run in full:
llama3-8b's blocks 37% over what selective recomputation re-runs. The same stop cuts memory.expert_chunk's
pieces on torch._grouped_mm short of their w2 (counted 6 d expert_dim per row, 4 run)."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from longctx.config import load_config
from longctx.memory.accounting import estimate_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from longctx.ops.grouped import cpu_kernel_available, grouped_path, use_loop

B, S = 2, 64
MOE = ["--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.dense_layers=0", "--model.moe.expert_dim=96"]
MODELS = {
    "dense": [],
    "moe": MOE,
    "moe-shared": [*MOE, "--model.moe.shared_experts=1"],
    "moe-shared-gate": [*MOE, "--model.moe.shared_experts=1", "--model.moe.shared_gate=true"],
}
POLICIES = [("selective", 0.0, 0), ("full", 0.0, 0), ("selective", 0.5, 0), ("full", 0.5, 0),
            ("selective", 0.0, 16), ("full", 0.0, 16), ("full", 0.0, 64)]


def _masked_core(q, k, v, doc_ids):
    """Causal attention with every S x S score computed (as FlopCounterMode counts a plain kernel)."""
    s, g = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    hidden = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _counted(base, policy: str, fraction: float, chunk: int, tokens, positions) -> int:
    model = copy.deepcopy(base)
    for block in model.layers:
        block.attention.core = _masked_core
    apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    with use_loop(), FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", MODELS)
def test_recompute_flops_are_what_backward_runs_again(name):
    cfg = load_config(overrides=["--model.preset=debug", "--model.layers=2", *MODELS[name]]).model
    base = build_model(cfg, "cpu").train()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    none = _counted(base, "none", 0.0, 0, tokens, positions)
    for policy, fraction, chunk in POLICIES:
        measured = _counted(base, policy, fraction, chunk, tokens, positions) - none
        est = estimate_activations(cfg, S, B, policy=MemoryPolicy(policy, fraction, 1, block_chunk=chunk))
        # (the counter sees the masked core's full S x S scores; the count is the causal half of them)
        scores = cfg.layers * B * S * 2 * S * cfg.heads * cfg.resolved_head_dim if policy == "full" else 0
        assert est.recompute_flops + scores == measured, (policy, fraction, chunk)


class _GroupedMMFlops(TorchDispatchMode):
    """FLOPs of torch._grouped_mm calls, which FlopCounterMode does not count: 2 per multiply-add."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._grouped_mm.default:
            a, b = args[0], args[1]  # [n, k] x [E, k, m] -> [n, m], or [k, n] x [n, m] -> [E, k, m]
            self.flops += 2 * (a.shape[0] * a.shape[1] * b.shape[1] if out.dim() == 3 else out.numel() * a.shape[-1])
        return out


@pytest.mark.skipif(not cpu_kernel_available(), reason="torch._grouped_mm does not run on this CPU")
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_expert_pieces_rerun_what_the_grouped_kernel_saves_before(policy):
    """memory.expert_chunk runs the routed experts in checkpointed pieces. On torch._grouped_mm (what a GPU runs,
    and a CPU where the shapes allow) autograd saves the down projection's inputs before it runs, so a piece's
    recomputation stops there: w1 and w3 again, 4 d expert_dim per row, not 6 (the count had 6)."""
    cfg = load_config(overrides=["--model.preset=debug", "--model.layers=2", *MOE]).model
    base = build_model(cfg, "cpu").train()
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(S).expand(B, S)

    def counted(policy: str, chunk: int) -> int:
        model = copy.deepcopy(base)
        for block in model.layers:
            block.attention.core = _masked_core
            if cfg.is_moe and hasattr(block.feed_forward, "experts"):
                block.feed_forward.experts.chunk = chunk
        apply_memory_policy(model.layers, policy, 0.0)
        x = torch.zeros(32, cfg.dim)
        assert grouped_path(x, base.layers[1].feed_forward.experts.w1.transpose(1, 2)) == "torch._grouped_mm"
        with FlopCounterMode(display=False) as counter, _GroupedMMFlops() as grouped:
            model(tokens, positions, None, labels=tokens).backward()
        return counter.get_total_flops() + grouped.flops

    measured = counted(policy, 32) - counted("none", 0)
    est = estimate_activations(cfg, S, B, policy=MemoryPolicy(policy, 0.0, 1, expert_chunk=32))
    scores = cfg.layers * B * S * 2 * S * cfg.heads * cfg.resolved_head_dim if policy == "full" else 0
    assert est.recompute_flops + scores == measured
