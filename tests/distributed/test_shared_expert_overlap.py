"""A MoE layer's shared experts overlapped with the expert-parallel return transfer (issue 52: "the shared
expert is overlapped with dispatch where the schedule allows"), on 4 gloo ranks, expert parallel over all 4:

- the layer with a gated shared expert gives the one-device layer's outputs and gradients (its input, router,
  shared expert and gate, 1e-6 in fp32), with the flat exchange (overlapped), pipelined chunks (not), and the
  hierarchical dispatch over nodes of 2 ranks (overlapped inside the node) and of 1 (nothing to overlap);
- the order is the overlap: the shared expert's forward runs after the results' transfer back is issued and
  before it is waited for (job/split_transfer.py: StartAllToAllV / WaitAllToAllV), and its backward between
  the gradients' transfer out being issued and waited for; with pipelined chunks the shared expert runs after them;
- what the overlap adds to the backward's peak (the routed gradients in flight beside the shared expert's) is
  what memory/expert_transients.py counts for it (shared_overlap_transient_bytes), within 10% (routing moves rows).
What the overlap saves on an emulated link: benchmarks/shared_expert_overlap.py (docs/benchmarks.md)."""

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned_many
from longctx.job.split_transfer import StartAllToAllV, WaitAllToAllV
from longctx.models.moe import MoEFeedForward


def _config(dim: int, shared_dim: int) -> ModelConfig:
    return ModelConfig(dim=dim, ffn_dim=64, moe_experts=8, moe_top_k=2, moe_expert_dim=48, moe_shared_experts=1,
                       moe_shared_dim=shared_dim, moe_shared_gate=True)


def _layer(dim=32, shared_dim=64) -> nn.Module:
    torch.manual_seed(0)
    layer = MoEFeedForward(_config(dim, shared_dim))
    for p in layer.parameters():
        nn.init.normal_(p, std=0.05)
    return layer


def _grads(layer, x):
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.square().sum().backward()
    return y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _events(layer):
    """Record, in order: the transfers' halves (forward and backward) and the shared expert's forward and backward."""
    events, saved = [], {}
    for cls, name in ((StartAllToAllV, "start"), (WaitAllToAllV, "wait")):
        fwd, bwd = cls.forward, cls.backward
        saved[cls] = (fwd, bwd)

        def forward(ctx, *a, _f=fwd, _n=name):
            events.append(f"{_n} forward")
            return _f(ctx, *a)

        def backward(ctx, *a, _b=bwd, _n=name):
            events.append(f"{_n} backward")
            return _b(ctx, *a)
        cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)
    layer.shared.register_forward_hook(lambda *a: events.append("shared forward"))
    layer.shared.register_full_backward_hook(lambda *a: events.append("shared backward"))
    return events, saved


def _parity():
    from longctx.parallel.expert.install import use_expert_parallel

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    base = _layer()
    rank = torch.distributed.get_rank()
    x = torch.randn(30 + 5 * rank, 32, generator=torch.Generator().manual_seed(100 + rank))
    y1, gx1, gw1 = _grads(copy.deepcopy(base), x)
    out = {}
    options_of = {"flat": {}, "chunks3": {"pipeline_chunks": 3}, "nodes2": {"ranks_per_node": 2},
                  "nodes1": {"ranks_per_node": 1}}
    for name, options in options_of.items():
        layer = copy.deepcopy(base)
        use_expert_parallel(nn.Sequential(layer), mesh, **options)
        events, saved = _events(layer)
        try:
            y, gx, gw = _grads(layer, x)
        finally:
            for cls, (fwd, bwd) in saved.items():
                cls.forward, cls.backward = staticmethod(fwd), staticmethod(bwd)
        # the router's, the shared expert's and its gate's (the routed experts' gradients sum over the group's
        # tokens under expert parallelism: tests/distributed/test_expert_dispatchers.py)
        mine = [n for n in gw if not n.startswith("experts.")]
        out[name] = {"events": events, "compared": mine,
                     "worst": max((y - y1).abs().max().item(), (gx - gx1).abs().max().item(),
                                  max((gw[n] - gw1[n]).abs().max().item() for n in mine))}
    return out


def _peaks():
    """The layer's backward peak (LiveStorages: bytes created and alive at once, beyond the gradients it leaves),
    overlapped and not, and what memory/transients.py counts for it."""
    from torch.distributed.tensor import DTensor

    from live_storage import LiveStorages
    from longctx.memory.expert_transients import shared_overlap_transient_bytes
    from longctx.memory.policy import MemoryPolicy
    from longctx.memory.transients import ffn_backward_bytes
    from longctx.parallel.expert.install import use_expert_parallel

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    layer, tokens = _layer(dim=64, shared_dim=256), 512
    dispatcher = use_expert_parallel(nn.Sequential(layer), mesh)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(torch.distributed.get_rank()),
                    requires_grad=True)
    out = {}
    for name, overlaps in (("overlapped", True), ("after", False)):
        dispatcher.overlaps_beside = lambda overlaps=overlaps: overlaps
        y = layer(x)
        mode = LiveStorages()
        with mode:
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        grads = [p.grad for p in layer.parameters() if p.grad is not None and not isinstance(p.grad, DTensor)]
        out[name] = mode.peak(besides=[*grads, x.grad])
        layer.zero_grad(set_to_none=True)
        x.grad = None
    cfg = _config(64, 256)
    out["counted"] = ffn_backward_bytes(cfg, tokens, 4, True)
    out["overlap_counted"] = shared_overlap_transient_bytes(cfg, tokens, 4, MemoryPolicy("none"), 4)
    return out


def test_shared_experts_overlap_the_return_transfer_exactly():
    got = run_spawned_many(4, [("parity", _parity, ())])["parity"]
    for rank in got:
        for name in ("flat", "chunks3", "nodes2", "nodes1"):
            assert rank[name]["worst"] < 1e-6, (name, rank[name]["worst"])
            assert {"shared.w1.weight", "shared_gate.weight"} <= set(rank[name]["compared"]), rank[name]["compared"]
        events = rank["flat"]["events"]
        fwd = [e for e in events if "forward" in e]
        bwd = [e for e in events if "backward" in e]
        assert fwd == ["start forward", "shared forward", "wait forward"], events
        assert bwd == ["wait backward", "shared backward", "start backward"], events
        assert [e for e in rank["chunks3"]["events"] if "start" in e or "wait" in e] == []  # (AllToAllV's path)
        assert rank["chunks3"]["events"] == ["shared forward", "shared backward"]
        # hierarchical: overlapped with the exchange inside a node of 2; a node of 1 rank exchanges nothing there
        assert rank["nodes2"]["events"] == events, rank["nodes2"]["events"]
        assert rank["nodes1"]["events"] == ["shared forward", "shared backward"], rank["nodes1"]["events"]


def test_the_overlap_backward_peak_is_counted():
    """Overlapped, the shared experts' backward holds the routed gradients in flight (2 x dim per routed row):
    measured against memory/expert_transients.py shared_overlap_transient_bytes on top of the feed-forward's count."""
    for rank in run_spawned_many(4, [("peaks", _peaks, ())])["peaks"]:
        # (the routed phase itself moves with the rows a rank receives: the skew term's, not this one's)
        assert rank["after"] <= 1.15 * rank["counted"], rank
        added = rank["overlapped"] - rank["after"]
        assert 0.9 * rank["overlap_counted"] <= added <= 1.1 * rank["overlap_counted"], rank
