"""`longctx bench attention`: 2D sequence-parallel attention against one attention call.

Runs `world` local gloo processes (each with `threads` threads) over a head x ctx layout and
times forward and backward of distributed_attention on each rank's shard; then times one
single-process attention over the full sequence. Reports per-rank wall and CPU seconds (CPU
seconds summed over ranks are the fair comparison when ranks outnumber cores), the same-run ratio
against the single-process call, and bytes sent per mesh dim next to the closed-form volumes.

With --docs (N-token documents packed back to back, or store:DIR: the document ids of a store's
first samples) it measures document-sparse attention instead:
- one process, forward + backward, each in a fresh process: the packed call (document ids), the
  sum of per-document calls (each document alone: the ideal) and plain causal attention (no
  documents): best-of-repeats CPU seconds and peak memory growth (peak RSS minus RSS before the
  inputs are built, the peak reset first; and peak live tensor-storage bytes);
- the distributed run with the document ids and the sequence layout (--split docs|zigzag): CPU
  seconds summed over ranks against the per-document sum (alone and at the ranks' load), bytes
  against the closed form without documents (with a layout documents cost no bytes);
- the work imbalance (max / mean visible query-key pairs over context ranks) of both layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from ..cli_flags import renamed_flag

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SEQ_LEN = 8192


def _inputs(args, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    q = torch.randn(args.micro_batch, args.seq_len, args.heads, args.head_dim, generator=gen).to(dtype)
    k = torch.randn(args.micro_batch, args.seq_len, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    v = torch.randn(args.micro_batch, args.seq_len, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    return q, k, v


def _time(fn, repeats, sync=None):
    """Best-of-`repeats` (wall s, process CPU s) of fn()."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        if sync:
            sync()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu = time.process_time() - c0  # before the trailing barrier: waiting for slower ranks is not work
        if sync:
            sync()
        best = min(best, (time.perf_counter() - w0, cpu))
    return best


def _rank_worker(args):
    from ..parallel import comm
    from ..parallel.attention import distributed_attention
    from ..parallel.dims import ParallelDims
    from ..parallel.sequence import shard_sequence

    dims = ParallelDims(dp_shard=1, head=args.head, ctx=args.ctx, window=args.window, placement=args.placement,
                        world_size=args.world)
    mesh = dims.build_mesh("cpu")
    q, k, v = (shard_sequence(t, mesh).requires_grad_() for t in _inputs(args))
    state = {}

    def forward():
        state["out"] = distributed_attention(q, k, v, mesh, causal=args.causal, window=args.window)

    def backward():
        state["out"].backward(state["grad"], retain_graph=True)

    def sync():
        comm.barrier()

    # warm-up, and one measured call's bytes
    comm.reset_counters()
    forward()
    state["grad"] = torch.ones_like(state["out"])
    backward()
    sent = comm.counters()
    fwd = _time(forward, args.repeats, sync)
    forward()
    bwd = _time(backward, args.repeats, sync)
    return {"fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0], "bwd_cpu_s": bwd[1], "bytes": sent}


def _single_process(args, threads=None):
    from ..ops.attention import attention

    torch.set_num_threads(threads or args.threads)
    q, k, v = (t.requires_grad_() for t in _inputs(args))
    state = {}

    def forward():
        state["out"], _ = attention(q, k, v, causal=args.causal)

    def backward():
        state["out"].backward(torch.ones_like(state["out"]), retain_graph=True)

    forward()
    backward()
    fwd = _time(forward, args.repeats)
    forward()
    bwd = _time(backward, args.repeats)
    return {"fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0], "bwd_cpu_s": bwd[1],
            "threads": torch.get_num_threads()}


def _simulated(args) -> dict:
    """All context ranks' ring blocks computed in this one process, no communication: the compute
    overhead of the block schedule itself (head parallelism only reshapes the work, so ctx only)."""
    from ..ops.attention import attention_backward, attention_forward
    from ..parallel.ring import simulate_ring

    torch.set_num_threads(args.threads)
    q, k, v = _inputs(args)
    dout = torch.randn_like(q)
    out, lse = attention_forward(q, k, v, causal=args.causal)
    single = _time(lambda: attention_backward(dout, q, k, v, out, lse, causal=args.causal), args.repeats)[1] + \
        _time(lambda: attention_forward(q, k, v, causal=args.causal), args.repeats)[1]
    ring = _time(lambda: simulate_ring(q, k, v, args.ctx, args.window, args.causal, dout=dout), args.repeats)[1]
    return {"ctx": args.ctx, "ring_blocks_fwd_bwd_cpu_s": ring, "single_fwd_bwd_cpu_s": single,
            "ratio": ring / single}


def run(args) -> dict:
    if args.docs is not None:
        return run_docs(args)
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    from ..parallel.layouts import check_divisible
    from ..parallel.spawn import run_spawned
    from ..parallel.ulysses import check_heads
    from ..parallel.volumes import attention_bytes

    if args.head * args.ctx != args.world:
        raise SystemExit(f"--head {args.head} x --ctx {args.ctx} must equal --world {args.world}")
    check_divisible(args.seq_len, args.ctx, args.head)
    check_heads(args.heads, args.kv_heads, args.head)
    load_start = _load()
    ranks = run_spawned(args.world, _rank_worker, args, threads=args.threads)
    # The reference alone on the machine, and `world` copies of it at once: with more ranks than
    # cores, the second one carries the same oversubscription and memory contention as the ranks.
    single = _single_process(args)
    loaded = run_spawned(args.world, _single_process, args, threads=args.threads)
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
        "config": {k: getattr(args, k) for k in ("world", "head", "ctx", "window", "placement", "seq_len", "micro_batch",
                                                  "heads", "kv_heads", "head_dim", "causal", "dtype", "threads",
                                                  "repeats")},
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
        "machine": _machine(load_start),
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
    renamed_flag(p, "--seq", "--seq-len", "sequence length is seq_len everywhere")
    renamed_flag(p, "--batch", "--micro-batch")
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
    p.add_argument("--split", default="docs", choices=("docs", "zigzag"),
                   help="with --docs: the sequence layout of the distributed run (parallel.sequence.plan_layout)")
    p.add_argument("--first-sample", type=int, default=0, help="with --docs store:DIR: the first sample used")
    p.add_argument("--imbalance-samples", type=int, default=0,
                   help="with --docs store:DIR: also summarise the work imbalance over this many samples")
    p.add_argument("--causal-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="with --docs: also measure plain causal attention over the whole sequence (S^2 work)")
    p.add_argument("--storage-tracker", action=argparse.BooleanOptionalAction, default=True,
                   help="with --docs: also measure peak live tensor-storage bytes (in one more process)")


def main(args) -> int:
    print(json.dumps(run(args), indent=2))
    return 0


# ----------------------------------------------------------------------------------------------
# --docs: packed documents (document-sparse attention) against each document alone and against
# plain causal attention, in one process and distributed.

MIB = 2 ** 20


def _load() -> dict:
    """How busy the machine is: 1-minute load average and the pytest processes running."""
    import subprocess

    try:
        pids = subprocess.run(["pgrep", "-f", "pytest"], check=False, capture_output=True, text=True,
                              timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pids = None
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "pytest_processes": None if pids is None else len(pids)}


def _machine(load_start: dict) -> dict:
    end = _load()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "loadavg_1m_start": load_start["loadavg_1m"], "loadavg_1m_end": end["loadavg_1m"],
            "pytest_processes_start": load_start["pytest_processes"], "pytest_processes_end": end["pytest_processes"]}


def _doc_ids(args) -> tuple[torch.Tensor, dict]:
    """Document ids [micro_batch, seq_len] of --docs, and where they come from (sets args.seq_len)."""
    spec = str(args.docs)
    if spec.startswith("store:"):
        from ..data.loader import PackedSamples

        root = spec[len("store:"):]
        samples = PackedSamples(root, "train", True)
        idx = list(range(args.first_sample, args.first_sample + args.micro_batch))
        if idx[-1] >= len(samples):
            raise SystemExit(f"--docs {spec}: the store has {len(samples)} training samples, asked for {idx}")
        if args.seq_len is None:
            args.seq_len = samples.seq_len
        if args.seq_len > samples.seq_len:
            raise SystemExit(f"--seq-len {args.seq_len} is longer than the store's samples ({samples.seq_len})")
        ids = samples.batch(idx).doc_ids[:, :args.seq_len].contiguous()  # a prefix keeps documents contiguous
        return ids.long(), {"store": root, "split": "train", "samples": idx, "store_seq_len": samples.seq_len}
    try:
        n = int(spec)
    except ValueError:
        raise SystemExit(f"--docs takes a document length in tokens or store:DIR, got '{spec}'") from None
    if n <= 0:
        raise SystemExit(f"--docs {n}: a document length must be positive")
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    ids = (torch.arange(args.seq_len) // n).expand(args.micro_batch, -1).contiguous()
    return ids, {"doc_len": n}


def _documents(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(batch row, start, length) of every document (contiguous run of one id)."""
    from ..ops.segments import segments

    out = []
    for r, row in enumerate(ids.numpy()):
        starts, lengths, _ = segments(row)
        out += [(r, int(s), int(n)) for s, n in zip(starts, lengths)]
    return out


def _doc_summary(ids: torch.Tensor) -> dict:
    lengths = np.array([n for _, _, n in _documents(ids)])
    seq = ids.shape[1]
    visible = int((lengths * (lengths + 1) // 2).sum())
    return {"count": len(lengths), "length_min": int(lengths.min()), "length_median": float(np.median(lengths)),
            "length_max": int(lengths.max()), "visible_pairs": visible,
            "visible_fraction_of_causal": visible / (ids.shape[0] * seq * (seq + 1) // 2)}


def _doc_inputs(args, shapes, seed=0):
    """Leaf (q, k, v) per [batch, seq] shape, generated directly in the benchmark dtype (no fp32 temporaries)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    return [tuple(torch.randn(b, s, h, args.head_dim, generator=gen, dtype=dtype).requires_grad_()
                  for h in (args.heads, args.kv_heads, args.kv_heads)) for b, s in shapes]


def _proc_status() -> dict:
    """VmRSS and VmHWM (peak RSS) of this process, in KiB (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM and ru_maxrss) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_tracker():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class PeakTracker(TorchDispatchMode):
        """Peak bytes of live tensor storages created under it (as memory/accounting.py's tracker:
        a storage is live while someone besides the tracker refers to it), checked after every op.
        Storages no one else holds are dropped at the next op. Kernel-internal workspaces are not seen."""

        def __init__(self):
            super().__init__()
            self.held: dict[int, torch.UntypedStorage] = {}
            self.peak = 0

        def live(self) -> int:
            self.held = {p: s for p, s in self.held.items() if torch._C._storage_Use_Count(s._cdata) > 1}
            return sum(s.nbytes() for s in self.held.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in self.held:
                        self.held[st.data_ptr()] = st
            self.peak = max(self.peak, self.live())
            return out

    return PeakTracker()


def _warm_up(args):
    """One tiny packed and plain attention forward and backward: lazy initialisation (kernels, thread
    pools) happens before any measurement."""
    from ..ops.attention import attention

    ids = torch.arange(64)[None] // 32
    for doc in (ids, None):
        q, k, v = _doc_inputs(args, [(1, 64)], seed=1)[0]
        out, _ = attention(q, k, v, causal=args.causal, q_doc=doc, k_doc=doc)
        out.sum().backward()


def _one_process(args, ids, kind, mode="time"):
    """One forward and backward of `kind` in this (fresh) process, its peak memory growth, then
    best-of-repeats CPU seconds. kind: "packed" (one call with the document ids), "per_document"
    (one call per document, each alone) or "causal" (one plain causal call, no documents).
    mode "time": peak RSS growth (current RSS before the inputs are built -> peak RSS after forward
    and backward) and CPU seconds; "tracker": peak growth of live tensor storage bytes (slower, so
    in a process of its own)."""
    import gc
    import resource

    from ..ops.attention import attention
    from ..ops.segments import plan_pairs

    torch.set_num_threads(args.threads)
    _warm_up(args)
    gc.collect()
    docs = _documents(ids)
    shapes = [(1, n) for _, _, n in docs] if kind == "per_document" else [tuple(ids.shape)]
    q_doc = ids if kind == "packed" else None
    tracker = _peak_tracker() if mode == "tracker" else None
    reset = _reset_peak_rss()
    before, maxrss_before = _proc_status(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if tracker is not None:
        tracker.__enter__()
    inputs = _doc_inputs(args, shapes)
    state = {}

    def forward():
        state["out"] = [attention(q, k, v, causal=args.causal, q_doc=q_doc, k_doc=q_doc)[0] for q, k, v in inputs]

    def backward():
        for out, grad in zip(state["out"], state["grad"]):
            out.backward(grad, retain_graph=True)

    forward()
    state["grad"] = [torch.ones_like(o) for o in state["out"]]
    backward()
    if tracker is not None:
        tracker.__exit__(None, None, None)
        return {"kind": kind, "tracked_peak_mib": tracker.peak / MIB}
    after, maxrss_after = _proc_status(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    memory = {"rss_before_mib": before["VmRSS"] / 1024,
              "rss_peak_growth_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
              "ru_maxrss_growth_mib": (maxrss_after - maxrss_before) / 1024, "peak_reset": reset}
    fwd = _time(forward, args.repeats)
    forward()
    bwd = _time(backward, args.repeats)
    result = {"kind": kind, "calls": len(shapes), "fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0],
              "bwd_cpu_s": bwd[1], "fwd_bwd_cpu_s": fwd[1] + bwd[1], "threads": torch.get_num_threads(),
              "memory": memory}
    if kind == "packed":  # the plan is built once per batch (cached on the ids): timed apart
        result["plan_cpu_s"] = _time(lambda: plan_pairs(ids, ids, causal=args.causal), args.repeats)[1]
    return result


def _tracked_peaks(args, ids, kinds) -> dict:
    return {kind: _one_process(args, ids, kind, "tracker")["tracked_peak_mib"] for kind in kinds}


def _fresh(fn, *args):
    """fn(*args) in a fresh spawned process (no allocator caches or peaks carried over)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _rank_worker_docs(args, ids):
    """_rank_worker with documents: the layout is planned on the host from the full ids (as the
    training loop does) and passed with the local ids, so no ids are communicated."""
    from ..parallel import comm
    from ..parallel.attention import distributed_attention
    from ..parallel.dims import ParallelDims
    from ..parallel.sequence import plan_layout

    dims = ParallelDims(dp_shard=1, head=args.head, ctx=args.ctx, window=args.window, placement=args.placement,
                        world_size=args.world)
    mesh = dims.build_mesh("cpu")
    c0 = time.process_time()
    layout = plan_layout(ids, args.ctx, args.head, split=args.split)
    layout_s = time.process_time() - c0
    me = mesh["ctx"].get_local_rank()
    c0 = time.process_time()
    plans = [layout.block_plan(me, j, args.causal) for j in range(args.ctx)]  # cached for the step's calls
    plans_s = time.process_time() - c0
    q, k, v = (layout.shard(t, mesh).requires_grad_() for t in _inputs(args))
    doc = layout.shard(ids, mesh)
    state = {}

    def forward():
        state["out"] = distributed_attention(q, k, v, mesh, causal=args.causal, window=args.window, doc_ids=doc,
                                             layout=layout)

    def backward():
        state["out"].backward(state["grad"], retain_graph=True)

    def sync():
        comm.barrier()

    comm.reset_counters()
    forward()
    state["grad"] = torch.ones_like(state["out"])
    backward()
    sent = comm.counters()
    fwd = _time(forward, args.repeats, sync)
    forward()
    bwd = _time(backward, args.repeats, sync)
    return {"fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0], "bwd_cpu_s": bwd[1], "bytes": sent,
            "layout_plan_cpu_s": layout_s, "block_plans_cpu_s": plans_s,
            "visible_pairs": sum(p.visible() for p in plans), "pair_groups": sum(len(p.groups) for p in plans),
            "empty_blocks": sum(p.empty for p in plans)}


def _imbalance(work) -> float:
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean()) if work.mean() > 0 else 1.0


def _work(ids, args) -> dict:
    from ..parallel.sequence import plan_layout

    out = {}
    for split in ("docs", "zigzag"):
        work = plan_layout(ids, args.ctx, args.head, split=split).rank_work(args.causal)
        out[split] = {"rank_work": [int(w) for w in work], "max_over_mean": _imbalance(work)}
    return out


def _work_over_samples(args) -> dict | None:
    """Work imbalance (max / mean over context ranks) of each of --imbalance-samples store samples."""
    if not args.imbalance_samples or not str(args.docs).startswith("store:"):
        return None
    from ..data.loader import PackedSamples

    samples = PackedSamples(str(args.docs)[len("store:"):], "train", True)
    n = min(args.imbalance_samples, len(samples) - args.first_sample)
    per = {"docs": [], "zigzag": []}
    for i in range(args.first_sample, args.first_sample + n):
        ids = samples.batch([i]).doc_ids[:, :args.seq_len]
        for split, w in _work(ids, args).items():
            per[split].append(w["max_over_mean"])
    return {"samples": n, **{b: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                                 "max": float(np.max(v))} for b, v in per.items()}}


def run_docs(args) -> dict:
    """--docs: one process (packed vs per-document sum vs plain causal: CPU seconds and peak memory
    growth, each measured in a fresh process), the distributed run with the layout, the work
    imbalance of the layouts, and bytes against the closed form."""
    from ..parallel.layouts import check_divisible
    from ..parallel.spawn import run_spawned
    from ..parallel.ulysses import check_heads
    from ..parallel.volumes import attention_bytes

    if args.head * args.ctx != args.world:
        raise SystemExit(f"--head {args.head} x --ctx {args.ctx} must equal --world {args.world}")
    ids, source = _doc_ids(args)
    check_divisible(args.seq_len, args.ctx, args.head)
    check_heads(args.heads, args.kv_heads, args.head)
    load_start = _load()
    kinds = ("packed", "per_document", "causal") if args.causal_reference else ("packed", "per_document")
    single = {kind: _fresh(_one_process, args, ids, kind, "time") for kind in kinds}
    if args.storage_tracker:  # tensor bytes do not depend on the allocator: one process for all kinds
        for kind, peak in _fresh(_tracked_peaks, args, ids, kinds).items():
            single[kind]["memory"]["tracked_peak_mib"] = peak
    ranks = run_spawned(args.world, _rank_worker_docs, args, ids, threads=args.threads)
    # the per-document reference again, `world` copies at once: the ranks' load (more ranks than cores)
    loaded = run_spawned(args.world, _one_process, args, ids, "per_document", threads=args.threads)
    expected = attention_bytes(seq=args.seq_len, batch=args.micro_batch, heads=args.heads, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, head=args.head, ctx=args.ctx,
                               elem=torch.empty(0, dtype=DTYPES[args.dtype]).element_size(), docs=False)
    work = _work(ids, args)
    rank_cpu = [r["fwd_cpu_s"] + r["bwd_cpu_s"] for r in ranks]
    sum_cpu = sum(rank_cpu)
    packed, per_doc = single["packed"], single["per_document"]
    loaded_cpu = sum(r["fwd_bwd_cpu_s"] for r in loaded) / len(loaded)

    def mem_ratio(a, b, key):
        if a not in single or b not in single:
            return None
        x, y = single[a]["memory"].get(key), single[b]["memory"].get(key)
        return None if x is None or not y else x / y

    result = {
        "bench": "attention",
        "config": {k: getattr(args, k) for k in ("world", "head", "ctx", "window", "placement", "seq_len", "micro_batch",
                                                  "heads", "kv_heads", "head_dim", "causal", "dtype", "threads",
                                                  "repeats", "docs", "split")},
        "documents": {**source, **_doc_summary(ids)},
        "single_process": single,
        "packed_cpu_s_ratio_vs_per_document": packed["fwd_bwd_cpu_s"] / per_doc["fwd_bwd_cpu_s"],
        "packed_with_plan_cpu_s_ratio_vs_per_document": (packed["fwd_bwd_cpu_s"] + packed["plan_cpu_s"])
        / per_doc["fwd_bwd_cpu_s"],
        "memory_measure": "rss: peak RSS (VmHWM, reset before the inputs are built) minus RSS then, in a fresh "
                          "process per measurement, inputs + gradients + everything else included; tracked: peak "
                          "bytes of live tensor storages (TorchDispatchMode), kernel workspaces not seen",
        "packed_memory_ratio_vs_causal_rss": mem_ratio("packed", "causal", "rss_peak_growth_mib"),
        "packed_memory_ratio_vs_causal_tracked": mem_ratio("packed", "causal", "tracked_peak_mib"),
        "packed_memory_ratio_vs_per_document_rss": mem_ratio("packed", "per_document", "rss_peak_growth_mib"),
        "packed_memory_ratio_vs_per_document_tracked": mem_ratio("packed", "per_document", "tracked_peak_mib"),
        "per_rank": ranks,
        "fwd_bwd_cpu_s_sum_over_ranks": sum_cpu,
        "fwd_bwd_wall_s_max_over_ranks": max(r["fwd_wall_s"] + r["bwd_wall_s"] for r in ranks),
        "cpu_s_imbalance_over_ranks": _imbalance(rank_cpu),
        "single_per_document_fwd_bwd_cpu_s": per_doc["fwd_bwd_cpu_s"],
        "cpu_s_ratio_vs_per_document": sum_cpu / per_doc["fwd_bwd_cpu_s"],
        "single_per_document_fwd_bwd_cpu_s_same_load": loaded_cpu,
        "cpu_s_ratio_vs_per_document_same_load": sum_cpu / loaded_cpu,
        "cpu_s_ratio_vs_packed": sum_cpu / packed["fwd_bwd_cpu_s"],
        "work_imbalance": {"split": args.split, "max_over_mean": work[args.split]["max_over_mean"],
                           "docs": work["docs"], "zigzag": work["zigzag"]},
        "bytes_match_closed_form": all(r["bytes"] == expected for r in ranks),
        "bytes_closed_form": expected,
    }
    if "causal" in single:
        result["packed_cpu_s_ratio_vs_causal"] = packed["fwd_bwd_cpu_s"] / single["causal"]["fwd_bwd_cpu_s"]
    over = _work_over_samples(args)
    if over is not None:
        result["work_imbalance"]["over_samples"] = over
    result["machine"] = _machine(load_start)
    return result
