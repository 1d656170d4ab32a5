"""What GliDe / Clover draft training's cross-attention keeps for backward, and its time, as the length
doubles: each query chunk checkpointed (models/glide.py cross_attention, since 2026-12-01) against the
chunks run plainly (the kernel then keeps each chunk's fp32 mask, ~group x n x S / 2 floats in all).

    python benchmarks/draft_cross_attention_memory.py --lengths 2048,4096,8192,16384 > out.json

"Kept" is the bytes autograd holds for backward beyond the inputs (saved_tensors_hooks, a structure
count, not the allocator); time is one forward + backward on this machine, the least of --repeat.
Shapes: SmolLM2-135M's draft (9 query heads over 3 kv heads of 64), one document, GliDe's block 4.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

import longctx.models.glide as glide


def _inputs(n: int, heads: int, kv: int, d: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, heads, d, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv, n, d, generator=g) for _ in range(2))  # (the frozen target's K/V)
    pos = torch.arange(n)[None]
    return q, k, v, pos


@contextmanager
def _plain_chunks():
    """The chunks run without a checkpoint: what cross_attention did before 2026-12-01."""
    held = glide.checkpoint
    glide.checkpoint = lambda fn, *args, **kwargs: fn(*args)
    try:
        yield
    finally:
        glide.checkpoint = held


def _kept_bytes(q, k, v, visible, pos) -> int:
    own = {t.untyped_storage().data_ptr() for t in (q, k, v, visible, pos)}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = max(kept.get(ptr, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        glide.cross_attention(q, k, v, visible, key_pos=pos).sum()
    return sum(kept.values())


def _seconds(q, k, v, visible, pos, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        q.grad = None
        t0 = time.perf_counter()
        glide.cross_attention(q, k, v, visible, key_pos=pos).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        q, k, v, pos = _inputs(n, args.heads, args.kv_heads, args.head_dim)
        visible = glide.block_stale_limit(pos, 4)
        row = {"tokens": n}
        for name, variant in (("checkpointed", nullcontext), ("plain_chunks", _plain_chunks)):
            with variant():
                row[name] = {"kept_mb": _kept_bytes(q, k, v, visible, pos) / 2**20,
                             "fwd_bwd_s": _seconds(q, k, v, visible, pos, args.repeat)}
        rows.append(row)
        print(json.dumps(row), flush=True, file=sys.stderr)  # (progress)
    print(json.dumps({"shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
                      "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
