"""Data pipeline benchmarks (JSON lines on stdout).

1. `--quality`: packing quality of concat / bfd / datasculpt on the standard-library corpus at the
   given sequence lengths (byte tokenizer, minhash dedup): fill rate, split fraction, homogeneity (mean
   within-sample cosine of the TF-IDF/SVD document embeddings), documents per sample.
2. `--throughput`: a full `longctx data build` of the stdlib corpus, MB/s of raw text per stage
   with the given workers (from the manifest).
3. `--balance`: max/mean data-parallel cost imbalance of global batches drawn from a store, with
   and without the Karmarkar-Karp permutation.

    nice python benchmarks/data_pipeline.py --quality --seq-lens 8192 32768   # needs pip install -e '.[bench]'
    nice python benchmarks/data_pipeline.py --throughput --seq-len 8192 --workers 2
    nice python benchmarks/data_pipeline.py --balance --seq-len 8192 --dp 4 --batch 16
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time

from longctx.config import load_config
from longctx.data.balance import balanced_order, imbalance
from longctx.data.builder.dedup import deduplicate
from longctx.data.builder.inputs import read_inputs
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pack import pack, packing_stats
from longctx.data.builder.pipeline import build_store
from longctx.data.builder.tokenize import tokenize
from longctx.data.loader import PackedSamples, cost_coefficients
from longctx.data.samples import SampleOrder
from longctx.data.tokenizer import ByteTokenizer
from packing_reference import cluster, embed_tfidf


def quality(seq_lens, strategies, seed=0):
    docs = read_inputs(["stdlib"]).docs
    texts = [d.text for d in docs]
    keep = deduplicate(texts, "minhash").keep
    texts = [t for t, k in zip(texts, keep) if k]
    tk = tokenize(texts, ByteTokenizer())
    emb = embed_tfidf(texts, seed=seed)
    lengths = tk.lengths
    for seq_len in seq_lens:
        t0 = time.perf_counter()
        clusters = cluster(emb, lengths, seq_len, seed=seed)
        t_cluster = time.perf_counter() - t0
        for s in strategies:
            t0 = time.perf_counter()
            p = pack(s, lengths, seq_len, emb, clusters, tk.breaks, tk.strong)
            dt = time.perf_counter() - t0
            st = packing_stats(p, len(lengths), emb)
            print(json.dumps({"bench": "pack_quality", "seq_len": seq_len, "strategy": s, "documents": len(lengths),
                              "tokens": int(lengths.sum()), "clusters": int(clusters.max()) + 1,
                              "pack_s": round(dt, 3), "cluster_s": round(t_cluster, 3) if s == "datasculpt" else None,
                              **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in st.items()}}),
                  flush=True)


def throughput(seq_len, workers, strategy, dedup):
    out = tempfile.mkdtemp(prefix="longctx-bench-")
    try:
        t0 = time.perf_counter()
        m = build_store(BuildOptions(["stdlib"], out + "/s", seq_len, strategy=strategy, dedup=dedup, workers=workers,
                                     progress=False, eval_fraction=0.02), log=lambda *a: None)
        total = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    part = m["parts"][0]
    print(json.dumps({"bench": "build_throughput", "seq_len": seq_len, "workers": workers, "strategy": strategy,
                      "dedup": dedup, "raw_mb": round(part["counts"]["raw_bytes"] / 1e6, 2), "total_s": round(total, 2),
                      "total_mb_per_s": round(part["counts"]["raw_bytes"] / 1e6 / total, 2),
                      "stages": {k: {"seconds": v["seconds"], "mb_per_s": v["mb_per_s"]}
                                 for k, v in part["stages"].items()},
                      "fill_rate": round(m["packing"]["train"]["fill_rate"], 4), "machine": platform.machine()}),
          flush=True)


def balance(seq_len, dp, batch, batches, strategy):
    out = tempfile.mkdtemp(prefix="longctx-bench-")
    try:
        build_store(BuildOptions(["stdlib"], out + "/s", seq_len, strategy=strategy, dedup="exact", workers=2,
                                 progress=False, stats=False), log=lambda *a: None)
        w = PackedSamples(out + "/s")
        for preset in ("debug", "llama3-8b"):
            cost = cost_coefficients(load_config(overrides=[f"--model.preset={preset}"]).model)
            order, c = SampleOrder(len(w), seed=0), w.costs(*cost)
            drawn = [order.next_indices(batch) for _ in range(min(batches, len(w) // batch))]
            # the same permutation the training loader applies (BatchLoader.next_indices)
            unbal = sum(imbalance(i, c, dp) for i in drawn) / max(len(drawn), 1) or 1.0
            bal = sum(imbalance(balanced_order(i, c, dp), c, dp) for i in drawn) / max(len(drawn), 1) or 1.0
            print(json.dumps({"bench": "dp_balance", "seq_len": seq_len, "strategy": strategy, "model": preset,
                              "dp": dp, "batch": batch, "batches": len(drawn),
                              "sample_cost_cv": round(float(c.std() / c.mean()), 4),
                              "imbalance_max_over_mean_unbalanced": round(unbal, 4),
                              "imbalance_max_over_mean_balanced": round(bal, 4)}), flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--balance", action="store_true")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--strategies", nargs="+", default=["concat", "bfd", "datasculpt"])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--strategy", default="datasculpt")
    ap.add_argument("--dedup", default="minhash")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=200)
    a = ap.parse_args()
    if a.quality:
        quality(a.seq_lens, a.strategies)
    if a.throughput:
        throughput(a.seq_len, a.workers, a.strategy, a.dedup)
    if a.balance:
        balance(a.seq_len, a.dp, a.batch, a.batches, a.strategy)


if __name__ == "__main__":
    main()
