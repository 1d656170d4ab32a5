"""The MoE layer's dispatch costs the same number of operations at any number of experts (issue 52,
the CPU proxy of "MoE dispatch near dense"): routing, the sort-based permutation, the grouped experts
(torch._grouped_mm, one operation for every expert) and the weighted combine, forward and backward,
counted op by op as they pass the dispatcher at 8, 64 and 128 experts. The loop over experts
(ops/grouped.py use_loop, the reference) is counted too, to show the count would see a per-expert
loop. And the kernel path gives the reference's outputs and gradients, uniform and skewed routing."""

import argparse
import collections
import contextlib
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from host_sync import no_host_sync
from longctx.bench import moe as bench
from longctx.bench import moe_gpu
from longctx.config import ModelConfig
from longctx.models.moe import MoEFeedForward
from longctx.ops.grouped import cpu_kernel_available, use_loop

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="this torch has no CPU torch._grouped_mm")

EXPERTS = (8, 64, 128)
DIM, EXPERT_DIM, TOKENS = 64, 32, 384


class OpCount(TorchDispatchMode):
    """Every aten operation that passes the dispatcher, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _layer(experts: int, router: str = "softmax", top_k: int = 2, skewed: bool = False) -> MoEFeedForward:
    """A layer with a gated shared expert; `skewed`: expert 0's selection bias puts it in every token's top-k."""
    groups = dict(moe_groups=4, moe_topk_groups=2) if router == "sigmoid" else {}
    cfg = ModelConfig(dim=DIM, ffn_dim=2 * EXPERT_DIM, moe_experts=experts, moe_top_k=top_k, moe_expert_dim=EXPERT_DIM,
                      moe_router=router, moe_shared_dim=EXPERT_DIM, moe_shared_gate=True, **groups)
    torch.manual_seed(experts)
    layer = MoEFeedForward(cfg)
    for p in layer.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if skewed:
        layer.router.expert_bias[0] = 10.0
    return layer


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, TOKENS // 2, DIM, generator=gen), torch.randn(2, TOKENS // 2, DIM, generator=gen)


def _forward_backward(layer: MoEFeedForward, x: torch.Tensor, grad: torch.Tensor):
    """Output, and the gradients of the input and of every parameter."""
    x = x.clone().requires_grad_()
    y = layer(x)
    params = [p for p in layer.parameters() if p.requires_grad]
    return y.detach(), torch.autograd.grad(y, [x, *params], grad)


def _ops(layer: MoEFeedForward, loop: bool = False) -> collections.Counter:
    x, grad = _inputs()
    _forward_backward(layer, x, grad)  # warm-up: any first-call probe out of the count
    with use_loop() if loop else contextlib.nullcontext(), OpCount() as count:
        _forward_backward(layer, x, grad)
    return count.ops


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_forward_backward_issues_as_many_ops_at_any_number_of_experts(router, skewed):
    counts = {e: _ops(_layer(e, router, skewed=skewed)) for e in EXPERTS}
    totals = {e: sum(c.values()) for e, c in counts.items()}
    assert len(set(totals.values())) == 1, f"aten ops per forward + backward by experts: {totals}"
    assert counts[EXPERTS[0]] == counts[EXPERTS[-1]]
    assert counts[EXPERTS[0]]["aten._grouped_mm.default"] == 9  # 3 projections x (forward, 2 gradients)


def test_the_count_sees_a_loop_over_experts():
    """The reference loop (one matmul per expert and gradient) is counted growing with the experts:
    what the test above would report if a per-expert loop came back."""
    totals = {e: sum(_ops(_layer(e), loop=True).values()) for e in EXPERTS}
    assert totals[8] < totals[64] < totals[128], totals
    assert totals[128] - totals[64] >= 9 * 64, totals  # at least 9 matmuls per extra expert


def test_forward_backward_reads_nothing_on_the_host():
    layer = _layer(64, skewed=True)
    x, grad = _inputs()
    _forward_backward(layer, x, grad)
    with no_host_sync():
        _forward_backward(layer, x, grad)


def _max_errors(layer: MoEFeedForward) -> list[float]:
    x, grad = _inputs(seed=1)
    fast = _forward_backward(layer, x, grad)
    with use_loop():
        ref = _forward_backward(layer, x, grad)
    pairs = [(fast[0], ref[0]), *zip(fast[1], ref[1])]
    return [float((a - b).abs().max()) for a, b in pairs]


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_the_kernel_path_equals_the_reference_loop(experts, skewed):
    errors = _max_errors(_layer(experts, skewed=skewed))
    assert max(errors) <= 1e-5, errors


def test_every_token_on_one_expert_equals_the_reference():
    """Top-1, expert 0 takes every token: one group holds every row, every other group is empty."""
    layer = _layer(64, top_k=1, skewed=True)
    chosen = layer.router(_inputs(seed=1)[0].reshape(-1, DIM)).experts
    assert (chosen == 0).all()
    errors = _max_errors(layer)
    assert max(errors) <= 1e-5, errors


def test_the_compiled_layer_equals_the_eager_one():
    """torch.compile of the layer (what train.compile does to a block's `post`): the routing, the
    sort-based permutation and the weighted combine fused, the fp32 grouped GEMMs run eagerly between
    the graphs (ops/grouped.py); outputs and gradients of the eager layer within 1e-5, both routings."""
    layer = _layer(16)
    compiled = torch.compile(layer)
    x, grad = _inputs(seed=2)
    for bias in (0.0, 10.0):  # uniform, then every token's top-k holding expert 0
        layer.router.expert_bias[0] = bias
        fast, ref = _forward_backward(compiled, x, grad), _forward_backward(layer, x, grad)
        errors = [float((a - b).abs().max()) for a, b in [(fast[0], ref[0]), *zip(fast[1], ref[1])]]
        assert max(errors) <= 1e-5, (bias, errors)


@pytest.mark.slow
def test_the_bf16_layer_compiles_into_one_graph():
    """In bf16 (the GPU's dtype) the grouped GEMMs trace too: the whole layer, forward and backward,
    is one graph (fullgraph=True refuses any break) whose results are the eager layer's to bf16 rounding."""
    layer = _layer(16).to(torch.bfloat16)
    x, grad = (t.to(torch.bfloat16) for t in _inputs(seed=2))
    fast = _forward_backward(torch.compile(layer, fullgraph=True), x, grad)
    ref = _forward_backward(layer, x, grad)
    for a, b in [(fast[0], ref[0]), *zip(fast[1], ref[1])]:
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)


@pytest.mark.slow
def test_the_gpu_benchmark_times_the_compiled_layer(capsys):
    """`longctx bench moe --device cuda --compile`'s code, run on the CPU (bf16): the compiled layer
    is timed beside the kernel, the loop and the dense layer."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--dim", "64", "--experts", "8", "--expert-dim", "32", "--seq-len", "128",
                         "--routing", "uniform,skewed", "--repeats", "1", "--compile"])
    assert moe_gpu.main(args, device=torch.device("cpu")) == 0
    rows = json.loads(capsys.readouterr().out)["timing"]
    assert [r["routing"] for r in rows] == ["uniform", "skewed"]
    assert all(r["moe_compiled_s"] > 0 and r["compiled_over_dense"] > 0 for r in rows)
