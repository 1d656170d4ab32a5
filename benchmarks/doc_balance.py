"""Balance of the context layout under document masks (parallel.seq_balance): zigzag vs docs_balanced_indices.

Work of a ctx rank = visible (query, key) pairs of its tokens (causal, same document). For each
sample of a packed store and each (ctx, head): max / mean rank work, contiguous same-document runs
per ctx rank, and the time of one docs_balanced_indices call; then the same at 128K, on 4
consecutive samples joined and on a synthetic sequence of ~4000 short documents.

    longctx data build --input stdlib --strategy concat --seq-len 32768 --out /tmp/stdlib_concat_32k --no-progress
    python benchmarks/doc_balance.py [--store /tmp/stdlib_concat_32k] [--out docs/doc_balance_<date>.json]

The store is built with the command above when missing. Prints one JSON document.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from longctx.data.loader import PackedSamples
from longctx.parallel.context.doc_balance import docs_balanced_indices
from longctx.parallel.context.layouts import rank_runs, rank_work, zigzag_positions


def _dist(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    return {"median": round(float(np.median(x)), 4), "p90": round(float(np.percentile(x, 90)), 4),
            "max": round(float(x.max()), 4)}


def _timed(doc_ids, ctx, head, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        idx = docs_balanced_indices(doc_ids, ctx, head)
        best = min(best, time.perf_counter() - t0)
    return idx, best


def evaluate(samples, ctx, head, repeat=1) -> dict:
    seq = samples[0].size
    zz = zigzag_positions(seq, ctx, head)
    r_zz, r_docs, runs_zz, runs_docs, times = [], [], [], [], []
    for doc_ids in samples:
        idx, t = _timed(doc_ids, ctx, head, repeat)
        times.append(t)
        for ind, ratios, runs in ((zz, r_zz, runs_zz), (idx, r_docs, runs_docs)):
            w = rank_work(doc_ids, ind)
            ratios.append(w.max() / w.mean())
            runs.append(rank_runs(doc_ids, ind).mean())
    return {"ctx": ctx, "head": head, "seq_len": seq, "samples": len(samples),
            "max_over_mean_work": {"zigzag": _dist(r_zz), "docs": _dist(r_docs)},
            "runs_per_rank_mean": {"zigzag": round(float(np.mean(runs_zz)), 2),
                                   "docs": round(float(np.mean(runs_docs)), 2)},
            "ms_per_call": {"median": round(1e3 * float(np.median(times)), 3),
                            "p90": round(1e3 * float(np.percentile(times, 90)), 3),
                            "max": round(1e3 * float(np.max(times)), 3)}}


def synthetic_short_docs(seq, median, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    lengths[-1] -= sum(lengths) - seq
    lengths = [n for n in lengths if n > 0]
    return np.repeat(np.arange(len(lengths)), lengths)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="/tmp/stdlib_concat_32k")
    ap.add_argument("--out", default=f"docs/doc_balance_{date.today().isoformat()}.json")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--head", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args(argv)

    store = Path(a.store)
    if not store.exists():
        subprocess.run(["longctx", "data", "build", "--input", "stdlib", "--strategy", "concat",
                        "--seq-len", "32768", "--out", str(store), "--no-progress"], check=True)
    ps = PackedSamples(store, "train", True)
    samples = [ps.batch([i]).doc_ids[0].numpy() for i in range(len(ps))]
    docs_per_sample = [int((np.diff(d) != 0).sum()) + 1 for d in samples]

    results = [evaluate(samples, c, h) for c in a.ctx for h in a.head]
    # 128K: 4 consecutive samples joined (each sample's documents stay separate), and a synthetic
    # sequence of ~4000 short documents (the most whole-document placements per call)
    joined = []
    for k in range(len(samples) // 4):
        parts = [samples[4 * k + j] + (10 ** 6) * j for j in range(4)]
        joined.append(np.concatenate(parts))
    short = [synthetic_short_docs(131072, 20, seed=s) for s in range(8)]
    long_seq = []
    for c in a.ctx:
        r = evaluate(joined, c, 1)
        r["case"] = "4 store samples joined"
        long_seq.append(r)
        r = evaluate(short, c, 1, repeat=5)
        r["case"] = f"synthetic, ~{int(np.mean([d.max() + 1 for d in short]))} documents (lognormal, median 20)"
        long_seq.append(r)

    out = {"bench": "doc_balance", "date": date.today().isoformat(), "store": str(store),
           "split": "train", "samples": len(samples), "seq_len": int(samples[0].size),
           "documents_per_sample": _dist(docs_per_sample),
           "work": "visible (query, key) pairs of a ctx rank's tokens: causal, same document",
           "seq_32k": results, "seq_128k": long_seq,
           "timing_note": "wall time of one call (best of 5 for the synthetic case) on a shared 2-core host; "
                          "max includes scheduler / GC stalls",
           "host": {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
