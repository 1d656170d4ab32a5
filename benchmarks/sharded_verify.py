"""One rank's verification call on a sharded cache (generate/sharded.py _partial_masked): a speculative
chain's k + 1 queries against the slots the rank holds. Now: the held slots by one kernel call (queries
grouped per kv head), the call's own slots by a masked softmax, merged by the log-sum-exp. Before
(2026-12-03): one fp32 softmax over every held slot, K and V expanded per query head in fp32.

    python benchmarks/sharded_verify.py --slots 8192,32768,131072 > out.json

Same run, interleaved, least of --repeat; the shapes of the audit that found it (one row, 8 query heads
over 2 kv heads of 64, 5 queries of which the rank keeps 3, a bf16 cache). Also the largest fp32 tensor
any op but a view or the attention kernel makes (a dispatch-mode probe), in MB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from largest_fp32 import LargestFp32
from longctx.generate.sharded import _partial_masked
from longctx.models.cached_attention import CacheStep, masked_attention


def _old(q, keys, values, before, mine, held, step):
    """The replaced path, verbatim: the full [b, n, slots] mask and one fp32 softmax over every slot."""
    b, n = q.shape[:2]
    length = int(held.max())
    among = np.tril(np.ones((n, n), dtype=bool))
    visible = np.zeros((b, n, length), dtype=bool)
    for r in range(b):
        visible[r, :, :before[r]] = True
        for m, j in enumerate(np.nonzero(mine[r])[0]):
            visible[r, :, before[r] + m] = among[:, j]
    return masked_attention(q, keys[:, :, :length], values[:, :, :length], torch.as_tensor(visible))


def _inputs(slots: int, heads: int, kv: int, d: int, n: int, dtype):
    g = torch.Generator().manual_seed(0)
    mine = np.array([[j % 2 == 0 for j in range(n)]])
    before, held = np.array([slots]), np.array([slots + int(mine.sum())])
    q = torch.randn(1, n, heads, d, generator=g).to(dtype)
    keys, values = (torch.randn(1, kv, slots + n + 3, d, generator=g).to(dtype) for _ in range(2))
    return q, keys, values, before, mine, held


def _time(fn, args, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        step = CacheStep(args[3].copy(), args[0].shape[1], None)
        t = time.perf_counter()
        fn(*args, step)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="8192,32768,131072")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    rows = []
    for slots in (int(s) for s in a.slots.split(",")):
        args = _inputs(slots, a.heads, a.kv_heads, a.head_dim, a.queries, getattr(torch, a.dtype))
        new_out, new_lse = _partial_masked(*args, CacheStep(args[3].copy(), a.queries, None))
        old_out, old_lse = _old(*args, None)
        old_s = new_s = float("inf")
        for _ in range(a.repeat):  # interleaved
            old_s, new_s = min(old_s, _time(_old, args, 1)), min(new_s, _time(_partial_masked, args, 1))
        probes = {}
        for name, fn in (("old", _old), ("new", _partial_masked)):
            with LargestFp32() as probe:
                fn(*args, CacheStep(args[3].copy(), a.queries, None))
            probes[name] = probe.largest / 1e6
        rows.append({"slots": slots, "old_ms": old_s * 1e3, "new_ms": new_s * 1e3, "speedup": old_s / new_s,
                     "largest_fp32_mb_old": probes["old"], "largest_fp32_mb_new": probes["new"],
                     "max_abs_out_diff": (new_out - old_out).abs().max().item(),
                     "max_abs_lse_diff": (new_lse - old_lse).abs().max().item()})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"shape": vars(a), "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
