"""`longctx bench attention --docs`: packed documents (document-sparse attention) against each
document alone and against plain causal attention, in one process and distributed.

--docs N packs N-token documents back to back; --docs store:DIR takes the document ids of a store's
first samples. It measures:
- one process, forward + backward, each in a fresh process: the packed call (document ids), the
  sum of per-document calls (each document alone: the ideal) and plain causal attention (no
  documents): best-of-repeats CPU seconds and peak memory growth (peak RSS minus RSS before the
  inputs are built, the peak reset first; and peak live tensor-storage bytes);
- the distributed run with the document ids and the sequence layout (--seq-balance docs|zigzag): CPU
  seconds summed over ranks against the per-document sum (alone and at the ranks' load), bytes
  against the closed form without documents (with a layout documents cost no bytes; documents that each
  stay on one context rank skip the ring: no ring bytes);
- the work imbalance (max / mean visible query-key pairs over context ranks) of both layouts.
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import resource
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..data.loader import PackedSamples
from ..errors import ConfigError
from ..job import comm
from ..job.checks import check_divisible, check_heads
from ..job.dims import ParallelDims
from ..job.spawn import run_spawned
from ..memory.rss import proc_status_kib, reset_peak_rss
from ..ops.attention import attention
from ..ops.segments import plan_pairs, segments
from ..parallel.context.attention import distributed_attention
from ..parallel.context.sequence import plan_layout
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
from .max_seq import is_host_oom

MIB = 2 ** 20


def _doc_ids(args) -> tuple[torch.Tensor, dict]:
    """Document ids [micro_batch, seq_len] of --docs, and where they come from (sets args.seq_len)."""
    spec = str(args.docs)
    if spec.startswith("store:"):
        root = spec[len("store:"):]
        samples = PackedSamples(root, "train", True)
        idx = list(range(args.first_sample, args.first_sample + args.micro_batch))
        if idx[-1] >= len(samples):
            raise ConfigError(f"--docs {spec}: the store has {len(samples)} training samples, asked for {idx}.")
        if args.seq_len is None:
            args.seq_len = samples.seq_len
        if args.seq_len > samples.seq_len:
            raise ConfigError(f"--seq-len {args.seq_len} is longer than the store's samples ({samples.seq_len}).")
        ids = samples.batch(idx).doc_ids[:, :args.seq_len].contiguous()  # a prefix keeps documents contiguous
        return ids.long(), {"store": root, "split": "train", "samples": idx, "store_seq_len": samples.seq_len}
    try:
        n = int(spec)
    except ValueError:
        raise ConfigError(f"--docs takes a document length in tokens or store:DIR, got '{spec}'.") from None
    if n <= 0:
        raise ConfigError(f"--docs {n}: a document length must be positive.")
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    ids = (torch.arange(args.seq_len) // n).expand(args.micro_batch, -1).contiguous()
    return ids, {"doc_len": n}


def _documents(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(batch row, start, length) of every document (contiguous run of one id)."""
    out = []
    for r, row in enumerate(ids.numpy()):
        starts, lengths, _ = segments(row)
        out += [(r, int(s), int(n)) for s, n in zip(starts, lengths)]
    return out


def _doc_summary(ids: torch.Tensor, causal: bool = True) -> dict:
    """The documents' lengths and the query-key pairs they leave visible: a document's triangle under
    causal attention (a fraction of plain causal attention's), its square under --no-causal (of full)."""
    lengths = np.array([n for _, _, n in _documents(ids)])
    seq = ids.shape[1]
    if causal:
        visible, whole, name = int((lengths * (lengths + 1) // 2).sum()), seq * (seq + 1) // 2, "causal"
    else:
        visible, whole, name = int((lengths * lengths).sum()), seq * seq, "full"
    return {"count": len(lengths), "length_min": int(lengths.min()), "length_median": float(np.median(lengths)),
            "length_max": int(lengths.max()), "visible_pairs": visible,
            f"visible_fraction_of_{name}": visible / (ids.shape[0] * whole)}


def _doc_inputs(args, shapes, seed=0):
    """Leaf (q, k, v) per [batch, seq] shape, generated directly in the benchmark dtype (no fp32 temporaries)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    return [tuple(torch.randn(b, s, h, args.head_dim, generator=gen, dtype=dtype).requires_grad_()
                  for h in (args.heads, args.kv_heads, args.kv_heads)) for b, s in shapes]


def _peak_tracker():
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
    torch.set_num_threads(args.threads)
    _warm_up(args)
    gc.collect()
    docs = _documents(ids)
    shapes = [(1, n) for _, _, n in docs] if kind == "per_document" else [tuple(ids.shape)]
    q_doc = ids if kind == "packed" else None
    tracker = _peak_tracker() if mode == "tracker" else None
    reset = reset_peak_rss()
    before, maxrss_before = proc_status_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
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
    after, maxrss_after = proc_status_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    memory = {"rss_before_mib": before["VmRSS"] / 1024,
              "rss_peak_growth_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
              "ru_maxrss_growth_mib": (maxrss_after - maxrss_before) / 1024, "peak_reset": reset}
    fwd = best_time(forward, args.repeats)
    forward()
    bwd = best_time(backward, args.repeats)
    result = {"kind": kind, "calls": len(shapes), "fwd_wall_s": fwd[0], "fwd_cpu_s": fwd[1], "bwd_wall_s": bwd[0],
              "bwd_cpu_s": bwd[1], "fwd_bwd_cpu_s": fwd[1] + bwd[1], "threads": torch.get_num_threads(),
              "memory": memory}
    if kind == "packed":  # the plan is built once per batch (cached on the ids): timed apart
        result["plan_cpu_s"] = best_time(lambda: plan_pairs(ids, ids, causal=args.causal), args.repeats)[1]
    return result


def _tracked_peaks(args, ids, kinds) -> dict:
    return {kind: _one_process(args, ids, kind, "tracker")["tracked_peak_mib"] for kind in kinds}


def _fresh(fn, *args):
    """fn(*args) in a fresh spawned process (no allocator caches or peaks carried over)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _rank_worker_docs(args, ids):
    """_rank_worker with documents: the layout is planned on the host from the full ids (as the
    training loop does) and passed with the local ids, so no ids are communicated."""
    dims = ParallelDims(dp_shard=1, head=args.head, ctx=args.ctx, window=args.window, placement=args.placement,
                        world_size=args.world)
    mesh = dims.build_mesh("cpu")
    c0 = time.process_time()
    layout = plan_layout(ids, args.ctx, args.head, balance=args.seq_balance)
    layout_s = time.process_time() - c0
    me = mesh["ctx"].get_local_rank()
    c0 = time.process_time()
    plans = [layout.block_plan(me, j, args.causal) for j in range(args.ctx)]  # cached for the step's calls
    plans_s = time.process_time() - c0
    q, k, v = (layout.shard(t, mesh).requires_grad_() for t in random_qkv(args))
    doc = layout.shard(ids, mesh)
    timed = time_distributed(lambda: distributed_attention(q, k, v, mesh, causal=args.causal, window=args.window,
                                                           doc_ids=doc, layout=layout), args.repeats, comm.barrier)
    return {**timed,
            "layout_plan_cpu_s": layout_s, "block_plans_cpu_s": plans_s,
            "visible_pairs": sum(p.visible() for p in plans), "pair_groups": sum(len(p.groups) for p in plans),
            "empty_blocks": sum(p.empty for p in plans)}


def _imbalance(work) -> float:
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean()) if work.mean() > 0 else 1.0


def _work(ids, args) -> dict:
    out = {}
    for balance in ("docs", "zigzag"):
        work = plan_layout(ids, args.ctx, args.head, balance=balance).rank_work(args.causal)
        out[balance] = {"rank_work": [int(w) for w in work], "max_over_mean": _imbalance(work)}
    return out


def _work_over_samples(args) -> dict | None:
    """Work imbalance (max / mean over context ranks) of each of --imbalance-samples store samples."""
    if not args.imbalance_samples or not str(args.docs).startswith("store:"):
        return None

    samples = PackedSamples(str(args.docs)[len("store:"):], "train", True)
    n = min(args.imbalance_samples, len(samples) - args.first_sample)
    per = {"docs": [], "zigzag": []}
    for i in range(args.first_sample, args.first_sample + n):
        ids = samples.batch([i]).doc_ids[:, :args.seq_len]
        for balance, w in _work(ids, args).items():
            per[balance].append(w["max_over_mean"])
    return {"samples": n, **{b: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                                 "max": float(np.max(v))} for b, v in per.items()}}


def _memory_ratios(single: dict) -> dict:
    """Packed peak-memory growth over the references' (None where one was not measured)."""
    def ratio(a, b, key):
        if "memory" not in single.get(a, {}) or "memory" not in single.get(b, {}):  # (not measured, or failed)
            return None
        x, y = single[a]["memory"].get(key), single[b]["memory"].get(key)
        return None if x is None or not y else x / y

    return {f"packed_memory_ratio_vs_{ref}_{kind}": ratio("packed", ref, key)
            for ref in ("causal", "per_document")
            for kind, key in (("rss", "rss_peak_growth_mib"), ("tracked", "tracked_peak_mib"))}


def _single_process_kinds(args, ids) -> dict:
    """{kind: one process's measurements} for packed, per-document (and with --causal-reference plain
    causal) attention: CPU seconds and peak memory growth, each measured in a fresh process, and with
    --storage-tracker each kind's tensor-storage peak."""
    kinds = ("packed", "per_document", "causal") if args.causal_reference else ("packed", "per_document")
    single = {}
    for kind in kinds:
        with phase(f"one process, {kind.replace('_', '-')} attention"):
            try:
                single[kind] = _fresh(_one_process, args, ids, kind, "time")
            except (BrokenProcessPool, MemoryError, RuntimeError) as e:  # (killed; or refused memory)
                if kind != "causal" or not (isinstance(e, BrokenProcessPool) or is_host_oom(e)):
                    raise
                # (the optional S^2 reference, the one a long length kills: the other figures are kept)
                single[kind] = {"error": f"its process failed ({type(e).__name__}: {e}); the host's memory, at "
                                         f"this length, most likely (--no-causal-reference skips it)"}
    measured = tuple(k for k in kinds if "error" not in single[k])
    if args.storage_tracker:  # tensor bytes do not depend on the allocator: one process for all kinds
        with phase("one process, tensor-storage peaks"):
            for kind, peak in _fresh(_tracked_peaks, args, ids, measured).items():
                single[kind]["memory"]["tracked_peak_mib"] = peak
    return single


def _closed_form_bytes(args, ids) -> dict[str, dict[str, int]]:
    """The bytes each rank's attention sends by the closed form (parallel/context/volumes.py attention_bytes) for
    the layout the documents `ids` get (whether they stay on their rank), which run_docs checks the ranks' against."""
    return attention_bytes(seq=args.seq_len, batch=args.micro_batch, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, head=args.head, ctx=args.ctx,
                           elem=torch.empty(0, dtype=DTYPES[args.dtype]).element_size(), docs=False,
                           docs_stay=plan_layout(ids, args.ctx, args.head,
                                                 balance=args.seq_balance).documents_stay_on_their_rank)


def run_docs(args) -> dict:
    """--docs: one process (packed vs per-document sum vs plain causal: CPU seconds and peak memory
    growth, each measured in a fresh process), the distributed run with the layout, the work
    imbalance of the layouts, and bytes against the closed form."""
    if args.head * args.ctx != args.world:
        raise ConfigError(f"--head {args.head} x --ctx {args.ctx} must equal --world {args.world}.")
    ids, source = _doc_ids(args)
    check_divisible(args.seq_len, args.ctx, args.head)
    check_heads(args.heads, args.kv_heads, args.head)
    load_start = machine_load()
    single = _single_process_kinds(args, ids)
    with phase(f"distributed attention on {args.world} ranks (head {args.head} x ctx {args.ctx}, {args.seq_balance})"):
        ranks = run_spawned(args.world, _rank_worker_docs, args, ids, threads=args.threads)
    # the per-document reference again, `world` copies at once: the ranks' load (more ranks than cores)
    with phase(f"per-document attention, {args.world} copies at once"):
        loaded = run_spawned(args.world, _one_process, args, ids, "per_document", threads=args.threads)
    expected = _closed_form_bytes(args, ids)
    work = _work(ids, args)
    rank_cpu = [r["fwd_cpu_s"] + r["bwd_cpu_s"] for r in ranks]
    sum_cpu = sum(rank_cpu)
    packed, per_doc = single["packed"], single["per_document"]
    loaded_cpu = sum(r["fwd_bwd_cpu_s"] for r in loaded) / len(loaded)

    result = {
        "bench": "attention",
        "config": {k: getattr(args, k) for k in (*CONFIG_KEYS, "docs", "seq_balance")},
        "documents": {**source, **_doc_summary(ids, args.causal)},
        "single_process": single,
        "packed_cpu_s_ratio_vs_per_document": packed["fwd_bwd_cpu_s"] / per_doc["fwd_bwd_cpu_s"],
        "packed_with_plan_cpu_s_ratio_vs_per_document": (packed["fwd_bwd_cpu_s"] + packed["plan_cpu_s"])
        / per_doc["fwd_bwd_cpu_s"],
        "memory_measure": "rss: peak RSS (VmHWM, reset before the inputs are built) minus RSS then, in a fresh "
                          "process per measurement, inputs + gradients + everything else included; tracked: peak "
                          "bytes of live tensor storages (TorchDispatchMode), kernel workspaces not seen",
        **_memory_ratios(single),
        "per_rank": ranks,
        "fwd_bwd_cpu_s_sum_over_ranks": sum_cpu,
        "fwd_bwd_wall_s_max_over_ranks": max(r["fwd_wall_s"] + r["bwd_wall_s"] for r in ranks),
        "cpu_s_imbalance_over_ranks": _imbalance(rank_cpu),
        "single_per_document_fwd_bwd_cpu_s": per_doc["fwd_bwd_cpu_s"],
        "cpu_s_ratio_vs_per_document": sum_cpu / per_doc["fwd_bwd_cpu_s"],
        "single_per_document_fwd_bwd_cpu_s_same_load": loaded_cpu,
        "cpu_s_ratio_vs_per_document_same_load": sum_cpu / loaded_cpu,
        "cpu_s_ratio_vs_packed": sum_cpu / packed["fwd_bwd_cpu_s"],
        "work_imbalance": {"seq_balance": args.seq_balance, "max_over_mean": work[args.seq_balance]["max_over_mean"],
                           "docs": work["docs"], "zigzag": work["zigzag"]},
        "bytes_match_closed_form": all(r["bytes"] == expected for r in ranks),
        "bytes_closed_form": expected,
    }
    if "fwd_bwd_cpu_s" in single.get("causal", {}):
        result["packed_cpu_s_ratio_vs_causal"] = packed["fwd_bwd_cpu_s"] / single["causal"]["fwd_bwd_cpu_s"]
    with phase("work imbalance over samples"):
        over = _work_over_samples(args)
    if over is not None:
        result["work_imbalance"]["over_samples"] = over
    result["machine"] = machine_summary(load_start)
    return result
