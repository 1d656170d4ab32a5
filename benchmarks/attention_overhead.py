"""Per-call overhead of longctx's Ulysses attention against a bare all-to-all + SDPA baseline.

Two gloo ranks, head 2 x ctx 1, causal, one sequence of --seq tokens, 8 heads of 64. Each rank
runs forward + backward of
  - longctx: `distributed_attention` (checks, layout, all-to-all with byte counters, the kernel
    with its log-sum-exp, custom autograd);
  - bare: the least code that does the same work: three all-to-alls (q, k, v) from sequence to
    head shards, `F.scaled_dot_product_attention`, one all-to-all back, each all-to-all an
    autograd function whose backward is the reverse all-to-all.
CPU-seconds per call (time.process_time, this process only: what the rank's own work costs, not
the wait for the other) are the median over --repeats; both run alternately in one process.
Prints one JSON document. Usage: python benchmarks/attention_overhead.py [--seqs 1024 2048 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.parallel.context.attention import distributed_attention

HEADS, HEAD_DIM = 8, 64


class _AllToAll(torch.autograd.Function):
    """[n, ...] chunks to the n ranks of `group`; backward: the same exchange, reversed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def bare_ulysses(q, k, v, group, n):
    """q, k, v [b, s/n, heads, d] -> out [b, s/n, heads, d]: all-to-all, SDPA, all-to-all."""
    b, s, h, d = q.shape

    def to_heads(x):  # [b, s, h, d] -> [b, h/n, n*s, d] (SDPA layout)
        chunks = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4)
        return _AllToAll.apply(chunks, group).permute(1, 3, 0, 2, 4).reshape(b, h // n, n * s, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=True)
    chunks = out.reshape(b, h // n, n, s, d).permute(2, 0, 3, 1, 4)  # [n dest, b, s, h/n, d]
    return _AllToAll.apply(chunks, group).permute(1, 2, 0, 3, 4).reshape(b, s, h, d)


def _cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(seqs: list[int], repeats: int) -> dict:
    torch.set_num_threads(1)
    mesh = ParallelDims(dp_shard=1, head=2, ctx=1, world_size=2).build_mesh("cpu")
    group = comm.group_of(comm.lane(comm.sub_mesh(mesh, "head"), "ulysses"))
    out = {}
    for seq in seqs:
        gen = torch.Generator().manual_seed(seq)
        q, k, v, dout = (torch.randn(1, seq // 2, HEADS, HEAD_DIM, generator=gen) for _ in range(4))
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]

        def longctx_call(inputs=inputs, dout=dout):
            distributed_attention(*inputs, mesh, causal=True).backward(dout)

        def bare_call(inputs=inputs, dout=dout):
            bare_ulysses(*inputs, group, 2).backward(dout)

        times = {"longctx": [], "bare": []}
        for i in range(repeats + 2):
            for name, fn in (("longctx", longctx_call), ("bare", bare_call))[:: 1 if i % 2 else -1]:
                dist.barrier()
                times[name].append(_cpu_seconds(fn))
        med = {name: statistics.median(t[2:]) for name, t in times.items()}
        out[seq] = {"longctx_cpu_s": med["longctx"], "bare_cpu_s": med["bare"],
                    "longctx_vs_bare": med["longctx"] / med["bare"]}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 8192])
    p.add_argument("--repeats", type=int, default=21)
    a = p.parse_args()
    ranks = run_spawned(2, measure, a.seqs, a.repeats)
    print(json.dumps({"bench": "attention_overhead", "layout": "head 2 x ctx 1 (gloo)", "heads": HEADS,
                      "head_dim": HEAD_DIM, "torch": torch.__version__, "per_rank": ranks,
                      "longctx_vs_bare_rank0": {s: r["longctx_vs_bare"] for s, r in ranks[0].items()}}, indent=2))


if __name__ == "__main__":
    main()
