"""Do Double-Ring's inner hops wait behind its outer transfer? Lanes (own process groups) vs one group.

Four gloo ranks, ctx 4, window 2 (two windows of two). Two measurements, each with the outer
transfer on its own process group (the `ring_outer` lane, what longctx does) and on the inner
hops' group (what it did before), the two alternating repeat by repeat:

1. hop latency: every rank posts a large outer transfer, then a small inner hop, and times the
   inner hop until it completes (median over repeats). If the inner hop queues behind the outer
   transfer, its latency is the outer transfer's; overlapped, it is the hop's alone (both are
   measured too, `alone_s`).
2. a whole Double-Ring attention forward + backward (median step time).

Prints one JSON document. Usage: python benchmarks/ring_overlap.py [--outer-mb 64] [--seq 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.ring import TAG_KV, TAG_OUTER_KV, Schedule
from longctx.parallel.context.sequence import shard_sequence


@contextlib.contextmanager
def one_group():
    """The lanes hidden: every transfer on the context dim's own group (the behaviour before lanes)."""
    saved = dict(comm._LANES)
    comm._LANES.clear()
    try:
        yield
    finally:
        comm._LANES.update(saved)


def _hop_latency(ctx_mesh, big, small) -> float:
    sched = Schedule(4, 2, comm.local_rank(ctx_mesh))
    inner, outer = comm.lane(ctx_mesh, "ring"), comm.lane(ctx_mesh, "ring_outer", "ring")
    comm.barrier(ctx_mesh)
    big_in, small_in = torch.empty_like(big), torch.empty_like(small)
    far = comm.exchange(outer, [(big, sched.outer_next, TAG_OUTER_KV)], [(big_in, sched.outer_prev, TAG_OUTER_KV)])
    t0 = time.perf_counter()
    comm.exchange(inner, [(small, sched.inner_next, TAG_KV)], [(small_in, sched.inner_prev, TAG_KV)]).wait()
    took = time.perf_counter() - t0
    far.wait()
    return took


def _alone(ctx_mesh, t, tag) -> float:
    """One transfer with nothing else in flight: the inner hop's size on the inner peers (TAG_KV), the
    outer transfer's on the outer peers."""
    sched = Schedule(4, 2, comm.local_rank(ctx_mesh))
    peers = (sched.inner_next, sched.inner_prev) if tag == TAG_KV else (sched.outer_next, sched.outer_prev)
    comm.barrier(ctx_mesh)
    t0 = time.perf_counter()
    comm.exchange(ctx_mesh, [(t, peers[0], tag)], [(torch.empty_like(t), peers[1], tag)]).wait()
    return time.perf_counter() - t0


def _attention_step(mesh, q, k, v) -> float:
    comm.barrier(comm.sub_mesh(mesh, "ctx"))
    t0 = time.perf_counter()
    out = distributed_attention(q, k, v, mesh, causal=True, window=2)
    out.sum().backward()
    return time.perf_counter() - t0


def measure(outer_mb: float, seq: int, repeats: int) -> dict:
    mesh = ParallelDims(dp_shard=1, head=1, ctx=4, window=2, world_size=4).build_mesh("cpu")
    ctx_mesh = comm.sub_mesh(mesh, "ctx")
    big, small = torch.ones(int(outer_mb * 2**20) // 4), torch.ones(1024)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, seq, 8, 64, generator=gen), mesh).requires_grad_() for _ in range(3))
    modes = (("lanes", contextlib.nullcontext), ("one_group", one_group))
    hops, steps = {m: [] for m, _ in modes}, {m: [] for m, _ in modes}
    alone = {"inner_hop_s": [], "outer_transfer_s": []}
    for i in range(repeats + 1):  # the modes alternate, so drift on a shared machine hits both alike
        alone["inner_hop_s"].append(_alone(ctx_mesh, small, TAG_KV))
        alone["outer_transfer_s"].append(_alone(ctx_mesh, big, TAG_OUTER_KV))
        for name, ctxmgr in modes if i % 2 else modes[::-1]:
            with ctxmgr():
                hops[name].append(_hop_latency(ctx_mesh, big, small))
                steps[name].append(_attention_step(mesh, q, k, v))
    dist.barrier()
    return {"alone_s": {m: statistics.median(t[1:]) for m, t in alone.items()},
            "hop_latency_s": {m: statistics.median(t[1:]) for m, t in hops.items()},
            "attention_step_s": {m: statistics.median(t[1:]) for m, t in steps.items()}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--outer-mb", type=float, default=64)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    ranks = run_spawned(4, measure, a.outer_mb, a.seq, a.repeats)
    r0 = ranks[0]
    print(json.dumps({
        "bench": "ring_overlap", "ctx": 4, "window": 2, "backend": "gloo", "outer_mb": a.outer_mb, "seq": a.seq,
        "torch": torch.__version__, "per_rank": ranks,
        "hop_latency_ratio_one_group_vs_lanes": r0["hop_latency_s"]["one_group"] / r0["hop_latency_s"]["lanes"],
        "attention_step_ratio_one_group_vs_lanes":
            r0["attention_step_s"]["one_group"] / r0["attention_step_s"]["lanes"],
    }, indent=2))


if __name__ == "__main__":
    main()
