"""`longctx bench attention`: 2D sequence-parallel attention against one attention call.

Runs `world` local gloo processes (each with `threads` threads) over a head x ctx layout and
times forward and backward of distributed_attention on each rank's shard; then times one
single-process attention over the full sequence. Reports per-rank wall and CPU seconds (CPU
seconds summed over ranks are the fair comparison when ranks outnumber cores), the same-run ratio
against the single-process call, and bytes sent per mesh dim next to the closed-form volumes.

With --docs it measures document-sparse attention instead (attention_docs.py).
"""

from __future__ import annotations

import argparse

import torch

from .. import strict_json
from ..errors import ConfigError
from ..job import comm
from ..job.checks import check_divisible, check_heads
from ..job.dims import ParallelDims
from ..job.spawn import run_spawned
from ..ops.attention import attention, attention_backward, attention_forward
from ..parallel.context.attention import distributed_attention
from ..parallel.context.ring import simulate_ring
from ..parallel.context.sequence import shard_sequence
from ..parallel.context.volumes import attention_bytes
from ..progress import phase
from .attention_common import (
    CONFIG_KEYS,
    DEFAULT_SEQ_LEN,
    DTYPES,
    best_time,
    machine_load,
    machine_summary,
    random_qkv,
    time_distributed,
)
from .attention_docs import run_docs


def _rank_worker(args):
    dims = ParallelDims(dp_shard=1, head=args.head, ctx=args.ctx, window=args.window, placement=args.placement,
                        world_size=args.world)
    mesh = dims.build_mesh("cpu")
    q, k, v = (shard_sequence(t, mesh).requires_grad_() for t in random_qkv(args))
    return time_distributed(lambda: distributed_attention(q, k, v, mesh, causal=args.causal, window=args.window),
                            args.repeats, comm.barrier)


def _single_process(args, threads=None):
    torch.set_num_threads(threads or args.threads)
    q, k, v = (t.requires_grad_() for t in random_qkv(args))
    state = {}

    def forward():
        state["out"], _ = attention(q, k, v, causal=args.causal)

    def backward():
        state["out"].backward(torch.ones_like(state["out"]), retain_graph=True)

    forward()
    backward()
    fwd = best_time(forward, args.repeats)
    forward()
    bwd = best_time(backward, args.repeats)
    return {"fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0], "bwd_cpu_s": bwd[1],
            "threads": torch.get_num_threads()}


def _simulated(args) -> dict:
    """All context ranks' ring blocks computed in this one process, no communication: the compute
    overhead of the block schedule itself (head parallelism only reshapes the work, so ctx only)."""
    torch.set_num_threads(args.threads)
    q, k, v = random_qkv(args)
    dout = torch.randn_like(q)
    out, lse = attention_forward(q, k, v, causal=args.causal)
    single = best_time(lambda: attention_backward(dout, q, k, v, out, lse, causal=args.causal), args.repeats)[1] + \
        best_time(lambda: attention_forward(q, k, v, causal=args.causal), args.repeats)[1]
    ring = best_time(lambda: simulate_ring(q, k, v, args.ctx, args.window, args.causal, dout=dout), args.repeats)[1]
    return {"ctx": args.ctx, "ring_blocks_fwd_bwd_cpu_s": ring, "single_fwd_bwd_cpu_s": single,
            "ratio": ring / single}


def run(args) -> dict:
    if args.repeats < 1:  # (0 timed runs: no figure, only an empty minimum or an infinite time)
        raise ConfigError(f"--repeats {args.repeats}: time at least one run (e.g. --repeats 3).")
    if args.docs is not None:
        return run_docs(args)
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN

    if args.head * args.ctx != args.world:
        raise ConfigError(f"--head {args.head} x --ctx {args.ctx} must equal --world {args.world}.")
    check_divisible(args.seq_len, args.ctx, args.head)
    check_heads(args.heads, args.kv_heads, args.head)
    load_start = machine_load()
    layout = f"head {args.head} x ctx {args.ctx}"
    with phase(f"distributed attention on {args.world} ranks ({layout}, {args.seq_len:,} tokens)"):
        ranks = run_spawned(args.world, _rank_worker, args, threads=args.threads)
    # The reference alone on the machine, and `world` copies of it at once: with more ranks than
    # cores, the second one carries the same oversubscription and memory contention as the ranks.
    with phase("single-process attention"):
        single = _single_process(args)
    with phase(f"single-process attention, {args.world} copies at once"):
        loaded = run_spawned(args.world, _single_process, args, threads=args.threads)
    with phase(f"ring schedule of ctx {args.ctx} in one process"):
        simulated = _simulated(args)
    expected = attention_bytes(seq=args.seq_len, batch=args.micro_batch, heads=args.heads, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, head=args.head, ctx=args.ctx,
                               elem=torch.empty(0, dtype=DTYPES[args.dtype]).element_size())

    def total(key_prefix, unit):
        return sum(r[f"fwd_{unit}_s"] + r[f"bwd_{unit}_s"] for r in ranks) if key_prefix == "sum" else \
            max(r[f"fwd_{unit}_s"] + r[f"bwd_{unit}_s"] for r in ranks)

    single_cpu = single["fwd_cpu_s"] + single["bwd_cpu_s"]
    single_wall = single["fwd_wall_s"] + single["bwd_wall_s"]
    loaded_cpu = sum(r["fwd_cpu_s"] + r["bwd_cpu_s"] for r in loaded) / len(loaded)
    return {
        "bench": "attention",
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "per_rank": ranks,
        "single_process": single,
        "fwd_bwd_cpu_s_sum_over_ranks": total("sum", "cpu"),
        "fwd_bwd_wall_s_max_over_ranks": total("max", "wall"),
        "single_fwd_bwd_cpu_s": single_cpu,
        "single_fwd_bwd_wall_s": single_wall,
        "cpu_s_ratio_vs_single": total("sum", "cpu") / single_cpu,
        "single_fwd_bwd_cpu_s_same_load": loaded_cpu,
        "cpu_s_ratio_vs_single_same_load": total("sum", "cpu") / loaded_cpu,
        "schedule_only": simulated,
        "bytes_match_closed_form": all(r["bytes"] == expected for r in ranks),
        "bytes_closed_form": expected,
        "machine": machine_summary(load_start),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--head", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--placement", default="head-first", choices=("head-first", "ctx-first"))
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}; with --docs store:DIR the store's)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per attention call")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--docs", default=None, metavar="N|store:DIR",
                   help="packed documents: N-token documents back to back (the last one shorter if needed), or "
                        "the document ids of the first --micro-batch samples of a `longctx data build` store")
    p.add_argument("--seq-balance", default="docs", choices=("docs", "zigzag"),
                   help="with --docs: how the distributed run cuts the sequence (as parallel.seq_balance)")
    p.add_argument("--first-sample", type=int, default=0, help="with --docs store:DIR: the first sample used")
    p.add_argument("--imbalance-samples", type=int, default=0,
                   help="with --docs store:DIR: also summarise the work imbalance over this many samples")
    p.add_argument("--causal-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="with --docs: also measure plain causal attention over the whole sequence (S^2 work)")
    p.add_argument("--storage-tracker", action=argparse.BooleanOptionalAction, default=True,
                   help="with --docs: also measure peak live tensor-storage bytes (in one more process)")


def main(args) -> int:
    # each case is a progress phase: a case that takes long is said while it runs (stderr; JSON on stdout)
    with phase("bench attention" + (" --docs" if args.docs is not None else "")):
        result = run(args)
    print(strict_json.dumps(result, indent=2))
    return 0


