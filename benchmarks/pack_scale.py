"""How datasculpt packing's time grows with the number of documents (one group of clusters, as a
data build passes them): JSON on stdout, {"seq_len", "dim", "runs": [{"documents", "clusters",
"samples", "cpu_s"}]}. Inputs: log-normal lengths (about 5% longer than seq_len), unit embeddings
around topic centres, one cluster per ~8 samples of tokens. CPU seconds (process time), so a loaded
machine still gives comparable figures. --reference also times the algorithm before 2026-12-02's
speed-up (the frozen copy tests/unit/test_pack_datasculpt_exact.py compares against) and checks that
both pack identically.

    python benchmarks/pack_scale.py --documents 8192,32768,131072,262144 --reference
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from longctx.data.builder.pack import pack


def inputs(n: int, seq_len: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 8), 1.2, n)).astype(np.int64)
    k = max(1, int(lengths.sum() // (8 * seq_len)))
    centres = rng.standard_normal((k, dim))
    clusters = rng.integers(0, k, n)
    emb = centres[clusters] + 0.5 * rng.standard_normal((n, dim))
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)
    return lengths, emb, clusters, k


def _reference():
    path = Path(__file__).resolve().parents[1] / "tests" / "unit" / "test_pack_datasculpt_exact.py"
    spec = importlib.util.spec_from_file_location("pack_reference_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_datasculpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", default="8192,32768,131072")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reference", action="store_true", help="also time the algorithm before the speed-up")
    a = ap.parse_args()
    reference = _reference() if a.reference else None
    runs = []
    for n in (int(x) for x in a.documents.split(",")):
        lengths, emb, clusters, k = inputs(n, a.seq_len, a.dim)
        t = time.process_time()
        packing = pack("datasculpt", lengths, a.seq_len, emb, clusters)
        run = {"documents": n, "clusters": k, "samples": int(packing.num_samples),
               "cpu_s": round(time.process_time() - t, 3)}
        if reference is not None:
            t = time.process_time()
            before = reference(lengths, a.seq_len, emb, clusters, None, None)
            run["reference_cpu_s"] = round(time.process_time() - t, 3)
            run["identical"] = bool(np.array_equal(before.segments, packing.segments))
        runs.append(run)
    print(json.dumps({"seq_len": a.seq_len, "dim": a.dim, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
