"""Chunked blocks (memory.block_chunk) on CPU: peak memory of one training step and its time, with
and without chunks, beside the planner's predicted peak (saved activations + transient working
set + parameter gradients). Each case runs in a fresh process; peak = ru_maxrss during the step
minus the RSS before it (large tensors are mmap'd by glibc, so RSS follows live memory).

    python benchmarks/block_chunk.py [--preset small-100m --layers 2 --seq-len 16384 --chunk 2048]

Prints one JSON document (docs/block_chunk_<date>.json holds a run).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date

CASES = [("full", 0.0), ("selective", 0.0), ("full", 1.0)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(a) -> dict:
    import torch

    from longctx.config import MODEL_PRESETS, ModelConfig
    from longctx.memory.accounting import estimate_activations
    from longctx.memory.apply_policy import apply_memory_policy
    from longctx.memory.policy import MemoryPolicy
    from longctx.memory.transients import transient_bytes
    from longctx.models.llama import build_model

    torch.set_num_threads(2)
    cfg = ModelConfig(preset=a.preset, **{**MODEL_PRESETS[a.preset], "layers": a.layers})
    model = build_model(cfg, seed=0)
    apply_memory_policy(model.layers, a.policy, a.fraction, offload_skip_last=1, block_chunk=a.chunk)
    model.loss_chunk = 4096
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, a.seq_len), generator=g)
    times = []
    for step in range(a.steps + 1):
        before = _rss_bytes()
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter()
        model(tokens, labels=tokens).backward()
        times.append(time.perf_counter() - t0)
        if step == 0:  # the first step: gradients are allocated in it, as the planner counts them
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            first = peak - before if peak > peak_before else None
        model.zero_grad(set_to_none=False)
    pol = MemoryPolicy(a.policy, a.fraction, 1, 4096, a.chunk)
    acts = estimate_activations(cfg, a.seq_len, 1, policy=pol, dtype_bytes=4, docs=False)
    transient = transient_bytes(cfg, a.seq_len, 1, head=1, ctx=1, policy=pol, dtype_bytes=4, docs=False)
    grads = sum(p.numel() for p in model.parameters()) * 4
    return {"policy": a.policy, "offload_fraction": a.fraction, "block_chunk": a.chunk,
            "peak_delta_bytes": first, "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "predicted_peak_bytes": acts.total_device + transient + grads,
            "predicted": {"saved_device": acts.total_device, "transient": transient, "param_grads": grads}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-100m")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    p.add_argument("--case", nargs=3, metavar=("POLICY", "FRACTION", "CHUNK"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        a.policy, a.fraction, a.chunk = a.case[0], float(a.case[1]), int(a.case[2])
        print(json.dumps(run_case(a)))
        return
    rows = []
    for policy, fraction in CASES:
        for chunk in (0, a.chunk):
            cmd = [sys.executable, __file__, "--preset", a.preset, "--layers", str(a.layers),
                   "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--case", policy, str(fraction), str(chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{policy} off{fraction} chunk {chunk}: peak +{rows[-1]['peak_delta_bytes'] / 2**20:.0f} MiB "
                  f"(predicted {rows[-1]['predicted_peak_bytes'] / 2**20:.0f}), {rows[-1]['step_s']:.1f} s",
                  file=sys.stderr)
    for r in rows:
        base = next(b for b in rows if (b["policy"], b["offload_fraction"], b["block_chunk"])
                    == (r["policy"], r["offload_fraction"], 0))
        if r["peak_delta_bytes"] and base["peak_delta_bytes"]:  # None: the step did not raise the peak
            r["peak_ratio_to_unchunked"] = r["peak_delta_bytes"] / base["peak_delta_bytes"]
        r["step_time_ratio_to_unchunked"] = r["step_s"] / base["step_s"]
    print(json.dumps({"bench": "block_chunk", "date": str(date.today()), "machine": platform.machine(),
                      "cpus": os.cpu_count(), "preset": a.preset, "layers": a.layers, "seq_len": a.seq_len,
                      "chunk": a.chunk, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
