"""Decode time per token with InfLLM's context memory (--context-memory infllm) at several cache lengths,
against plain cached attention: one process, the model's real weights, the cache filled with random keys
and values (a decode step's cost does not depend on what they hold; the prefill that would fill them is
skipped: on a 2-core CPU it is minutes per 8K tokens). The first steps (which build every unit's
representatives) are excluded. Prints JSON.

    python benchmarks/infllm_decode.py --checkpoint /tmp/smollm2_hf --lengths 8192,32768 --steps 16 \
        [--infllm-window 4096 --infllm-topk 4 --infllm-positions ordered ...]   (generate's --infllm-* flags)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch

from longctx.generate.context_memory import add_flags
from longctx.models.context_memory import InfLLMMemory, InfLLMShape
from longctx.models.hf import load_hf
from longctx.models.kv_cache import KVCache


def per_token(model, length: int, steps: int, shape: InfLLMShape | None) -> dict:
    """Seconds per decode step after `length` cached tokens (median of `steps`), and keys read per query."""
    memory = InfLLMMemory(shape, model, 1, length + steps + 4) if shape else None
    cache = KVCache.for_model(model, 1, length + steps + 4, core=memory.core if memory else None)
    gen = torch.Generator().manual_seed(0)
    cache.k[:, :, :, :length] = torch.randn(cache.k[:, :, :, :length].shape, generator=gen)
    cache.v[:, :, :, :length] = torch.randn(cache.v[:, :, :, :length].shape, generator=gen)
    cache.lengths[:] = length
    token = torch.tensor([[42]])
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):  # (the first two: units built, kernels warmed)
            t0 = time.perf_counter()
            model(token, cache=cache)
            times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    keys = memory.keys_read if memory else length + steps + 2
    return {"length": length, "memory": "infllm" if shape else "plain", "s_per_token": times[len(times) // 2],
            "min_s": times[0], "max_s": times[-1], "keys_per_query_max": keys}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plain", action="store_true", help="also plain cached attention at each length")
    add_flags(p)  # the memory's shape: generate's --infllm-* flags and defaults (--context-memory is ignored)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_hf(args.checkpoint).eval()
    sizes = {name: getattr(args, f"infllm_{name}") for name in ("block", "repr", "topk", "window", "init",
                                                                 "positions")}
    shape = InfLLMShape(**sizes).checked()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for s in ((shape, None) if args.plain else (shape,)):
            rows.append(per_token(model, length, args.steps, s))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "machine": platform.node(),
                      "threads": args.threads, "shape": sizes, "rows": rows}))


if __name__ == "__main__":
    main()
