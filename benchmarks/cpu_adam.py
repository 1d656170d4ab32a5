"""The AdamW step on the host, per parameter (issue 49: memory.model_states = host runs it there):
torch's foreach AdamW, torch's fused CPU AdamW, and DeepSpeed's DeepSpeedCPUAdam (the peer, when it
imports and its C++ op builds here), on the same fp32 parameters and gradients, the same threads.

    python benchmarks/cpu_adam.py --params 100M --steps 10 --out docs/results/cpu_adam_<date>.json

Each kind runs `--warmup` steps, then `--steps` timed ones, the kinds taking turns step by step; the
figure is the median step time over the parameter count (ns per parameter). The parameters are a
few large tensors, as FSDP's flat shards of a unit are. DeepSpeed is looked up on the path as given
(PYTHONPATH to a directory where `pip install --target DIR --no-deps deepspeed hjson py-cpuinfo
msgpack einops ninja psutil pydantic pydantic-core annotated-types typing-inspection` put it): the
registry's sdist builds its CPU Adam op with the machine's compiler on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date

import torch


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def _tensors(total: int, pieces: int, seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [total // pieces] * pieces
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    return params, grads


def _optimizer(kind: str, params):
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "torch foreach":
        return torch.optim.AdamW(params, foreach=True, **hp)
    if kind == "torch fused":
        return torch.optim.AdamW(params, fused=True, **hp)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **hp)


def measure(kinds: list[str], total: int, pieces: int, warmup: int, steps: int) -> dict:
    """Every kind on its own copy of the same parameters and gradients, their steps taken in turns
    (one step of each, then the next round), so that what else the machine does hits all alike."""
    rows, runs = {}, {}
    for kind in kinds:
        params, grads = _tensors(total, pieces, seed=0)
        for p, g in zip(params, grads):
            p.grad = g
        try:
            runs[kind] = (_optimizer(kind, params), params, [])
        except Exception as e:  # (DeepSpeed absent, or its op not built here): said in the JSON
            rows[kind] = {"error": f"{type(e).__name__}: {e}"[:400]}
    for i in range(warmup + steps):
        for opt, _, times in runs.values():
            start = time.perf_counter()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    for kind, (_, params, times) in runs.items():
        median = statistics.median(times)
        rows[kind] = {"step_s": median, "ns_per_param": median / total * 1e9, "steps": steps,
                      "step_s_each": [round(x, 5) for x in times], "first_values": params[0].detach()[:4].tolist()}
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="100M", help="parameters in all (default 100M)")
    p.add_argument("--pieces", type=int, default=8, help="tensors they are split into (default 8)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--kinds", default="torch foreach,torch fused,deepspeed cpu adam")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    total = _count(args.params)
    kinds = args.kinds.split(",")
    print(f"[cpu adam] {', '.join(kinds)}: {total:,} parameters, {args.steps} steps each, in turns", file=sys.stderr,
          flush=True)
    rows = measure(kinds, total, args.pieces, args.warmup, args.steps)
    base = rows.get("deepspeed cpu adam", {}).get("ns_per_param")
    for row in rows.values():
        if base and "ns_per_param" in row:
            row["vs_deepspeed"] = row["ns_per_param"] / base
    out = {"benchmark": "cpu_adam", "date": date.today().isoformat(), "machine": platform.machine(),
           "cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__, "params": total,
           "pieces": args.pieces, "kinds": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
