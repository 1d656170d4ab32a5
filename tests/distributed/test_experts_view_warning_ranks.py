"""FSDP2 warned "FSDP2-wrapped module (FSDPExperts) returned a view tensor" where the experts' output was a view
that an autograd Function made of its own input: ops/grouped.py's contiguous-gradient identity (the experts run
with no exchange: the kernel's output was the module's) and job/comm.py's AllToAllV over one rank (hierarchical
dispatch with one rank a node: parallel.expert_ranks_per_node = 1, the node's exchange a no-op). Both now hand back
a tensor that is no view (comm.all_to_all_v_grad, grouped.py's hook), the gradients unchanged. One 2-rank job."""

import contextlib
import warnings

import pytest

from longctx.config import to_dict
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned_many
from longctx.ops.grouped import cpu_kernel_available
from longctx.planner.validate import Case, case_config

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="this torch has no CPU torch._grouped_mm kernel")

VIEW = "returned a view tensor"


def _views(record) -> list[str]:
    return sorted({str(w.message)[:60] for w in record if VIEW in str(w.message)})


def _sharded_experts():
    """fully_shard over the experts alone, run with no dispatcher (the kernel path, fp32, aligned widths): the
    warnings, and the weights' gradients against the same experts unsharded, kernel and loop."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from longctx.job import comm
    from longctx.models.moe_experts import Experts
    from longctx.ops.grouped import use_loop

    def build():
        torch.manual_seed(0)
        experts = Experts(4, 8, 16)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.3)
        return experts

    g = torch.Generator().manual_seed(1)
    x, counts = torch.randn(12, 8, generator=g), torch.tensor([5, 0, 4, 3])
    sharded = fully_shard(build(), mesh=comm.world_mesh())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = sharded(x.clone().requires_grad_(), counts)
        y.sum().backward()  # (an expanded gradient: the kernel's backward needs it contiguous)
    grads = [p.grad.full_tensor() for p in sharded.parameters()]
    reference = []
    for loop in (False, True):
        plain = build()
        with use_loop() if loop else contextlib.nullcontext():
            plain(x.clone().requires_grad_(), counts).sum().backward()
        reference.append([p.grad for p in plain.parameters()])
    return {"views": _views(record), "same_as_kernel": all(torch.equal(a, b) for a, b in zip(grads, reference[0])),
            "same_as_loop": all(torch.equal(a, b) for a, b in zip(grads, reference[1]))}


def _hierarchical_one_rank_nodes(raw):
    """One training step of debug-moe over 2 expert ranks as 2 nodes of one rank (validate_ranks, as the planner's
    validation runs it): the warnings it raised."""
    from longctx.planner.validate_ranks import setup_case, train_step

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train_step(*setup_case(raw))
    return {"views": _views(record)}


@pytest.fixture(scope="module")
def ranks():
    one_rank_nodes = MeshShape(expert=2, dp_shard=2, expert_ranks_per_node=1)
    raw = to_dict(case_config(Case("hier1", "debug-moe", 256, one_rank_nodes)))
    return run_spawned_many(2, [("experts", _sharded_experts, ()), ("hier1", _hierarchical_one_rank_nodes, (raw,))])


def test_sharded_experts_return_no_view_and_the_same_gradients(ranks):
    for rank in ranks["experts"]:
        assert rank["views"] == []
        assert rank["same_as_kernel"] and rank["same_as_loop"]


def test_hierarchical_dispatch_with_one_rank_nodes_returns_no_view(ranks):
    assert [r["views"] for r in ranks["hier1"]] == [[], []]
