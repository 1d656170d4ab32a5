"""`longctx bench moe`: the cost of a Mixture-of-Experts feed-forward against the dense SwiGLU with
the same ACTIVE parameters, forward + backward, on one process.

The MoE layer is models/moe.py's MoEFeedForward (softmax top-k router, dropless, grouped experts
through ops/grouped.py); the dense one is models/llama.py's FeedForward with
ffn_dim = top_k x expert_dim, so every token goes through as many weights in both (the router's
dim x experts aside). Two routings:
- uniform: the router's gate as initialised (random), inputs N(0, 1): every expert gets about
  T x k / E choices (the measured max/mean load is reported);
- skewed: the router's selection bias (moe.py `expert_bias`, which moves choices, not weights) of
  expert 0 raised until it takes --skew-share of all choices (0.5 with top-2: every token).

Timing is CPU time of this process (user + system, every thread's: getrusage), the run with the
least of it over --repeats runs with the MoE and the dense layer alternating, so other load on the
machine inflates both alike and rarely the minimum; its user / system split and minor page faults
are reported too. System time is the kernel handing out fresh zeroed pages: glibc serves each
allocation of 32 MiB or more (a [2 x 16K tokens, 256] fp32 tensor) by a new mmap, so at long
lengths every such temporary faults its pages in again. By default (--malloc training) the process
runs as `longctx train` runs on CPU, with freed blocks kept for reuse (job/host_malloc.py);
--malloc glibc keeps glibc's defaults. The setting is recorded.

Memory is what the layer keeps for its backward: the bytes of the distinct storages that autograd
saves (torch.autograd.graph.saved_tensors_hooks; the layer's own parameters excluded), at several
lengths, so that bytes per token show the growth is linear.
Output: one JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
from datetime import date

import torch
from torch import nn

from .. import strict_json
from ..errors import ConfigError
from ..job.devices import machine_record
from ..job.host_malloc import keep_freed_blocks
from ..ops.grouped import grouped_path, use_loop
from ..progress import phase
from . import moe_cluster, moe_gpu
from .moe_common import aten_ops, build_layers, choice_share, fwd_bwd, measured_active_params, ratio, say, skew


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--experts", type=int, default=8, help="routed experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--expert-dim", type=int, default=0,
                   help="each expert's SwiGLU hidden size (0 = dim); the dense layer's is top-k x this")
    p.add_argument("--seq-len", default="4096,16384", help="comma-separated token counts to time")
    p.add_argument("--memory-seq-len", default="4096,8192,16384",
                   help="comma-separated token counts whose saved-for-backward bytes are measured")
    p.add_argument("--routing", default="uniform,skewed", help="comma-separated, of uniform, skewed")
    p.add_argument("--skew-share", type=float, default=0.5,
                   help="skewed routing: the share of all choices that expert 0 takes (at most 1 / top-k)")
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs per layer (after a warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU seconds are summed over them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: wall time of the layer on one GPU in bf16, grouped kernel vs loop vs dense "
                        "(bench/moe_gpu.py)")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU, one more forward+backward of the MoE layer and of the dense one at each length "
                        "under torch.profiler: their kernels by kind and the 15 slowest in the JSON (not timed)")
    p.add_argument("--compile", action="store_true",
                   help="cuda: also time the torch.compile'd MoE layer (bf16: one graph, the permutation and the "
                        "weighted combine fused; `moe_compiled_s`)")
    moe_cluster.add_arguments(p)
    p.add_argument("--grouped", default="auto", choices=("auto", "loop"),
                   help="the experts' grouped GEMMs: auto (torch._grouped_mm where it runs, ops/grouped.py), "
                        "loop (the reference loop over experts, one GEMM per expert)")
    p.add_argument("--malloc", default="training", choices=("training", "glibc"),
                   help="training: glibc set as `longctx train` sets it on CPU (job/host_malloc.py: freed blocks "
                        "kept for reuse); glibc: its defaults (every temporary of 32 MiB or more faulted in anew)")


def time_pair(moe: nn.Module, dense: nn.Module, x: torch.Tensor, repeats: int) -> dict:
    """CPU seconds (user + system) of forward+backward for each layer over `repeats` alternating runs:
    the least, its user / system split and minor page faults, and the median."""
    grad = torch.randn_like(x)
    runs: dict[str, list[tuple[float, float, int]]] = {"moe": [], "dense": []}
    for layer in (moe, dense):  # warm-up
        fwd_bwd(layer, x, grad)
    for _ in range(repeats):
        for name, layer in (("moe", moe), ("dense", dense)):
            before = resource.getrusage(resource.RUSAGE_SELF)
            fwd_bwd(layer, x, grad)
            after = resource.getrusage(resource.RUSAGE_SELF)
            runs[name].append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                               after.ru_minflt - before.ru_minflt))
    out = {}
    for name, r in runs.items():
        user, system, faults = min(r, key=lambda v: v[0] + v[1])
        out[name] = {"min": user + system, "user": user, "system": system, "minor_faults": faults,
                     "median": statistics.median(u + s for u, s, _ in r), "all": [round(u + s, 5) for u, s, _ in r]}
    return out


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> dict:
    """Bytes of the distinct storages autograd keeps for the backward of one forward of `layer`
    (the layer's parameters excluded), and how many tensors were saved."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor):
        nonlocal count
        count += 1
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    total = sum(storages.values())
    del y
    return {"bytes": total, "tensors": count}


def main(args) -> int:
    if args.repeats < 1:  # (0 timed runs: no figure, only an empty minimum or an infinite time)
        raise ConfigError(f"--repeats {args.repeats}: time at least one run (e.g. --repeats 3).")
    if args.cluster:  # the expert-parallel schedule on an emulated cluster (bench/moe_cluster.py)
        return moe_cluster.main(args)
    if args.device == "cuda":  # one GPU, no emulation (bench/moe_gpu.py)
        return moe_gpu.main(args)
    # each case a progress phase: one that takes long is said while it runs
    with phase("bench moe"):
        doc = _measure_cpu(args)
    print(strict_json.dumps(doc, indent=2))
    return 0


def _grouped_path(args, moe: nn.Module) -> str:
    """Which path the experts' GEMMs took (the kernel needs 16-byte-aligned widths)."""
    if args.grouped == "loop":
        return "loop (forced)"
    w = moe.experts.w1
    return grouped_path(torch.empty(0, w.shape[-1]), w.transpose(1, 2))


def _measure_cpu(args) -> dict:
    """The document `longctx bench moe` prints on the CPU: timing per routing and length, saved bytes."""
    torch.set_num_threads(args.threads)
    malloc = keep_freed_blocks() if args.malloc == "training" else "glibc defaults"
    moe, dense, cfg = build_layers(args)
    routings = [r for r in args.routing.split(",") if r]
    for r in routings:
        if r not in ("uniform", "skewed"):
            raise ConfigError(f"--routing {r}: one of uniform, skewed.")
    params = measured_active_params(moe, dense, args.top_k)
    gen = torch.Generator().manual_seed(args.seed + 1)
    timing = []
    for routing in routings:
        for seq in (int(s) for s in args.seq_len.split(",") if s):
            x = torch.randn(1, seq, args.dim, generator=gen, requires_grad=True)
            moe.router.expert_bias.zero_()
            bias = skew(moe, x, args.skew_share) if routing == "skewed" else 0.0
            share = choice_share(moe, x)
            say(f"{routing} routing, {seq:,} tokens: timing {args.repeats} x (moe, dense)")
            with (phase(f"{routing} routing, {seq:,} tokens", done_line=False),
                  use_loop() if args.grouped == "loop" else contextlib.nullcontext()):
                t = time_pair(moe, dense, x, args.repeats)
                ops = aten_ops(moe, x, torch.randn_like(x))
            row = {"routing": routing, "tokens": seq, "expert0_bias": bias,
                   "expert_share": [round(float(v), 5) for v in share],
                   "load_max_over_mean": float(share.max() * args.experts),
                   "moe_cpu_s": t["moe"]["min"], "dense_cpu_s": t["dense"]["min"],
                   "moe_cpu_s_per_token": t["moe"]["min"] / seq, "dense_cpu_s_per_token": t["dense"]["min"] / seq,
                   "ratio": ratio(t["moe"]["min"], t["dense"]["min"]),
                   "moe_user_s": t["moe"]["user"], "moe_system_s": t["moe"]["system"],
                   "dense_user_s": t["dense"]["user"], "dense_system_s": t["dense"]["system"],
                   "ratio_user": ratio(t["moe"]["user"], t["dense"]["user"]),
                   "ratio_median": ratio(t["moe"]["median"], t["dense"]["median"]), "moe_aten_ops": ops, "runs": t}
            say(f"  moe {row['moe_cpu_s']:.3f} s (system {row['moe_system_s']:.3f}), dense "
                      f"{row['dense_cpu_s']:.3f} s (system {row['dense_system_s']:.3f}): ratio {row['ratio']:.3f}, "
                      f"user time only {row['ratio_user']:.3f}")
            timing.append(row)
    moe.router.expert_bias.zero_()
    memory = []
    for seq in (int(s) for s in args.memory_seq_len.split(",") if s):
        x = torch.randn(1, seq, args.dim, generator=gen, requires_grad=True)
        with phase(f"saved bytes at {seq:,} tokens", done_line=False):
            m, d = saved_bytes(moe, x), saved_bytes(dense, x)
        memory.append({"tokens": seq, "moe_saved_bytes": m["bytes"], "dense_saved_bytes": d["bytes"],
                       "moe_saved_tensors": m["tensors"], "dense_saved_tensors": d["tensors"],
                       "moe_bytes_per_token": m["bytes"] / seq, "dense_bytes_per_token": d["bytes"] / seq})
    return {
        "bench": "moe", "date": date.today().isoformat(),
        "config": {"dim": args.dim, "experts": args.experts, "top_k": args.top_k, "expert_dim": cfg.resolved_expert_dim,
                   "dense_ffn_dim": cfg.ffn_dim, "router": "softmax", "capacity_factor": 0.0,
                   "skew_share": args.skew_share, "grouped": _grouped_path(args, moe),
                   "repeats": args.repeats, "threads": args.threads,
                   "timing": "the run of least user + system CPU time (getrusage) over the repeats",
                   "malloc": malloc,
                   "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")},
        "active_params": params, "timing": timing, "memory": memory,
        "machine": machine_record(),
    }
