"""FlexMoE's copy slots run as two grouped GEMMs (parallel/expert/placement.py own_and_copy_experts: the rank's own
experts on the parameters, its copy slots on the fetched copies) and give the plain expert-parallel layer's outputs
and every gradient: in the edge cases a placement can make on 2 expert ranks (a rank with an empty copy slot, a
rank receiving no rows for its own experts, one receiving none for its copies: zero-row GEMMs), with pipelined
chunks (parallel.expert_pipeline_chunks), checkpointed expert pieces (memory.expert_chunk) and bf16 autocast.
Memory: tests/distributed/test_copies_mem107.py."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned
from longctx.models.moe import MoEFeedForward
from longctx.parallel.expert import dispatch
from longctx.parallel.expert.install import use_expert_parallel
from longctx.parallel.expert.placement import Placement

# 4 experts on 2 ranks (0, 1 on rank 0; 2, 3 on rank 1), 2 copy slots a rank; holders (rank, slot, share)
PLACEMENTS = {
    # rank 0: its own experts' rows all on rank 1's copies (no own rows), one copy of expert 2 and an empty slot
    "no-own-rows": Placement(2, 2, 2, ((0, 1, 2, -1), (2, 3, 0, 1)),
                             (((0, 0, 0.0), (1, 2, 1.0)), ((0, 1, 0.0), (1, 3, 1.0)),
                              ((1, 0, 0.5), (0, 2, 0.5)), ((1, 1, 1.0),))),
    # rank 1: copies of experts 0 and 1 that take no rows (zero-row copy GEMMs); rank 0 an empty slot
    "no-copy-rows": Placement(2, 2, 2, ((0, 1, 2, -1), (2, 3, 0, 1)),
                              (((0, 0, 1.0), (1, 2, 0.0)), ((0, 1, 1.0), (1, 3, 0.0)),
                               ((1, 0, 0.4), (0, 2, 0.6)), ((1, 1, 1.0),))),
}
# name: (pipelined chunks, memory.expert_chunk, bf16 autocast)
VARIANTS = {"whole": (1, 0, False), "pipeline3": (3, 0, False), "expert-chunk": (1, 16, False),
            "pipeline3-expert-chunk": (3, 16, False), "autocast": (1, 0, True), "autocast-expert-chunk": (1, 16, True)}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _run(base, mesh, x, grad, placement, chunks, expert_chunk, bf16):
    holder = nn.Sequential(copy.deepcopy(base))
    use_expert_parallel(holder, mesh, chunks)
    holder[0].experts.chunk = expert_chunk
    holder[0].experts.placement = placement
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = holder[0](xi)
    y.float().backward(grad)
    return {"y": y.detach().float(), "x": xi.grad,
            **{n: _local(p.grad).clone() for n, p in holder[0].named_parameters()}}


def _compare():
    """Per (placement, variant): the largest difference of the placed layer's outputs and gradients from the plain
    layer's, over their largest magnitude; and this rank's (own, copy) rows."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("expert_data", "expert"))
    cfg = ModelConfig(dim=32, ffn_dim=64, moe_experts=4, moe_top_k=2, moe_expert_dim=48, moe_router="softmax")
    torch.manual_seed(0)
    base = MoEFeedForward(cfg)
    for p in base.experts.parameters():
        nn.init.normal_(p, std=0.05)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(40 + 7 * rank, 32, generator=gen)
    grad = torch.randn(40 + 7 * rank, 32, generator=gen)
    out, rows, split = {}, {}, dispatch.own_and_copy_experts

    def seen(x, counts, weights, copies, own_rows, chunk=0):  # (the rows each of the two GEMMs got)
        rows.setdefault(placed, (own_rows, x.shape[0] - own_rows))
        return split(x, counts, weights, copies, own_rows, chunk)
    dispatch.own_and_copy_experts = seen
    for name, (chunks, expert_chunk, bf16) in VARIANTS.items():
        plain = _run(base, mesh, x, grad, None, chunks, expert_chunk, bf16)
        for placed, placement in PLACEMENTS.items():
            got = _run(base, mesh, x, grad, placement, chunks, expert_chunk, bf16)
            out[placed, name] = {k: ((got[k] - plain[k]).abs().max() / plain[k].abs().max().clamp_min(1e-30)).item()
                                 for k in plain}
    dispatch.own_and_copy_experts = split
    return out, rows


@pytest.fixture(scope="module")
def compared():
    return run_spawned(2, _compare)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("placed", list(PLACEMENTS))
def test_copy_slots_run_apart_give_the_plain_layers_outputs_and_gradients(placed, variant, compared):
    tolerance = 2e-2 if VARIANTS[variant][2] else 1e-5  # (bf16: the weight gradients summed in another order)
    (_, rows0), (_, rows1) = compared
    # the edge cases are real: (own rows, copy rows) of each rank's first call
    assert rows0["no-own-rows"][0] == 0 and rows0["no-own-rows"][1] > 0 and rows1["no-own-rows"][1] > 0
    assert rows1["no-copy-rows"][1] == 0 and rows1["no-copy-rows"][0] > 0 and rows0["no-copy-rows"][1] > 0
    for rank, (per_case, _) in enumerate(compared):
        worst = per_case[placed, variant]
        print(placed, variant, rank, f"{max(worst.values()):.2e}")
        assert {"y", "x", "experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= set(worst)
        assert max(worst.values()) <= tolerance, (rank, worst)
