"""One layer's decode step on a rank of the sharded InfLLM cache (generate/sharded_infllm.py _Layer.attend:
write the token, the local span, the far part of the initial tokens and chosen units, their merge), and its
local span alone (_Layer._span). Now: the span's slots in one kernel call (queries grouped per kv head, no
mask). Before (2026-12-03): one fp32 softmax over every slot of the span with a [b, n, L] mask, K and V
expanded per query head in fp32 (kept here as `_old_span`).

    python benchmarks/sharded_infllm_span.py --held 8192,32768,131072 > out.json

The rank holds `held` tokens of one row (ctx 1: every slot; on ctx c a rank holds 1 / c of them and does
1 / c of this work), random keys and values; each timed step is the same token (the lengths reset), after a
first untimed step that builds every unit's representatives. Two memory shapes per length: the flags'
defaults (generate/context_memory.py DEFAULTS; on 2026-12-03 window 2048, block 128, 128 initial tokens, top-8
units: a span of 2,048..2,175 slots whatever `held`; since 2026-12-05 window 4096, top 4),
and a window of held / 2 (a span of about half the tokens). Old and new interleaved in one run,
least of --repeat. Also the largest fp32 tensor any op but a view or the attention kernel makes (a
dispatch-mode probe), in MB, over the whole step and over the span alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

from largest_fp32 import LargestFp32
from longctx.generate.context_memory import DEFAULTS
from longctx.generate.sharded_infllm import ShardedInfLLMCache, _empty, _Layer
from longctx.models.cached_attention import masked_attention
from longctx.models.context_memory import InfLLMShape


def _old_span(self, q, lo: int, end: int):
    """The replaced _span, verbatim but for taking the queries' positions from the step."""
    c = self.cache
    held = c.slots(lo, end)
    keys, values = c.k[self.index][:, :, held], c.v[self.index][:, :, held]
    if keys.shape[2] == 0:
        return _empty(q)
    key_pos = torch.as_tensor(c.positions[held], device=q.device)
    visible = key_pos[None, None, :] <= c.step.positions[:, :, None]  # [b, n, L]
    c.keys_read = max(c.keys_read, keys.shape[2])
    return masked_attention(q, keys, values, visible)


def _cache(shape: InfLLMShape, held: int, heads: int, kv: int, d: int, dtype) -> ShardedInfLLMCache:
    """A one-rank (ctx 1) cache of one row holding `held` random tokens, its units not yet built."""
    g = torch.Generator().manual_seed(0)
    c = object.__new__(ShardedInfLLMCache)
    c.shape, c.mesh, c.c, c.rank, c.max_len = shape, None, 1, 0, held + 1
    c.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    c.positions = np.arange(held + 1)
    c.k = torch.randn(1, 1, kv, held + 1, d, generator=g).to(dtype)
    c.v = torch.randn(1, 1, kv, held + 1, d, generator=g).to(dtype)
    c.reps = torch.zeros(1, 1, (held - shape.init) // shape.block + 1, kv, d)
    c.built, c.lengths, c.step, c._keys_read = np.zeros(1, dtype=np.int64), np.full(1, held), None, [0]
    return c


def _step(c: ShardedInfLLMCache, q, k, v, span_only: bool):
    """One decode step of layer 0 on the rank (the lengths reset after: the same step each time)."""
    c.lengths[:] = c.max_len - 1
    c.begin(1)
    layer = _Layer(c, 0)
    if span_only:
        s = c.max_len - 1
        units = max(0, (s + 1 - c.shape.window - c.shape.init) // c.shape.block)
        layer._span(q, c.shape.init + units * c.shape.block if units else 0, s + 1)
    else:
        layer.attend(q, k, v)
    c.end(ok=False)


def _row(shape: InfLLMShape, held: int, a, dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    c = _cache(shape, held, a.heads, a.kv_heads, a.head_dim, dtype)
    q = torch.randn(1, 1, a.heads, a.head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, 1, a.kv_heads, a.head_dim, generator=g).to(dtype) for _ in range(2))
    new_span = _Layer._span
    out = {}
    for span_only in (False, True):
        _step(c, q, k, v, span_only)  # (builds every unit's representatives; warms the kernels)
        best = {"old": float("inf"), "new": float("inf")}
        for _ in range(a.repeat):  # interleaved
            for name, fn in (("old", _old_span), ("new", new_span)):
                _Layer._span = fn
                t = time.perf_counter()
                _step(c, q, k, v, span_only)
                best[name] = min(best[name], time.perf_counter() - t)
        _Layer._span = new_span
        part = "span" if span_only else "step"
        out.update({f"{part}_old_ms": best["old"] * 1e3, f"{part}_new_ms": best["new"] * 1e3,
                    f"{part}_speedup": best["old"] / best["new"]})
    outputs = {}
    for name, fn in (("old", _old_span), ("new", new_span)):
        _Layer._span = fn
        for part in ("step", "span"):
            c.lengths[:] = held
            c.begin(1)
            with LargestFp32() as probe:
                if part == "step":
                    outputs[name] = _Layer(c, 0).attend(q, k, v).float()
                else:
                    units = max(0, (held + 1 - shape.window - shape.init) // shape.block)
                    _Layer(c, 0)._span(q, shape.init + units * shape.block if units else 0, held + 1)
            c.end(ok=False)
            out[f"{part}_largest_fp32_mb_{name}"] = probe.largest / 1e6
    _Layer._span = new_span
    s = held
    units = max(0, (s + 1 - shape.window - shape.init) // shape.block)
    out.update({"span_slots": s + 1 - (shape.init + units * shape.block if units else 0), "units": units,
                "max_abs_out_diff": (outputs["new"] - outputs["old"]).abs().max().item()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--held", default="8192,32768,131072")
    p.add_argument("--windows", default="default,half",
                   help="comma list of: default (the flags' window), half (a window of held / 2)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    rows = []
    for held in (int(x) for x in a.held.split(",")):
        for window in a.windows.split(","):
            shape = InfLLMShape(**DEFAULTS)
            if window == "half":
                shape = InfLLMShape(**{**DEFAULTS, "window": held // 2 // shape.block * shape.block})
            for dtype in a.dtypes.split(","):
                row = {"held": held, "window": shape.window, "dtype": dtype,
                       **_row(shape.checked(), held, a, getattr(torch, dtype))}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"args": vars(a), "shape_defaults": DEFAULTS, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                      "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
