"""Chunked attention core (memory.attention_chunk) on CPU: peak memory and time of one training step
with and without attention chunks, beside the planner's predicted peak.

Each case runs in a fresh process (one model, one batch); peak = ru_maxrss over the first step
minus the RSS before it (large tensors are mmap'd by glibc, so RSS follows live memory), which
includes the parameter gradients allocated in that step, as the planner counts them. Step time is
the median of the following steps. The cases alternate so machine load hits them alike.

    python benchmarks/attention_chunk.py [--preset small-100m --layers 2 --seq-len 65536
        --recompute full --block-chunk 8192 --attention-chunk 8192 --docs 0]

--docs N packs documents of N tokens (document masks); 0 = plain causal attention.
Prints one JSON document (docs/attention_chunk_<date>.json holds a run).
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(a) -> dict:
    import torch

    from longctx.config import MODEL_PRESETS, MemoryConfig, ModelConfig
    from longctx.memory.accounting import estimate_activations
    from longctx.memory.policy import MemoryPolicy
    from longctx.memory.transients import transient_bytes
    from longctx.models.llama import build_model
    from longctx.parallel.parallelize import apply_memory

    torch.set_num_threads(a.threads)
    cfg = ModelConfig(preset=a.preset, **{**MODEL_PRESETS[a.preset], "layers": a.layers})
    model = build_model(cfg, seed=0)
    apply_memory(model, MemoryConfig(recompute=a.recompute, offload_fraction=a.offload_fraction,
                                     block_chunk=a.block_chunk, loss_chunk=a.loss_chunk,
                                     attention_chunk=a.attention_chunk), "cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, a.seq_len), generator=g)
    doc = pos = None
    if a.docs:
        doc = (torch.arange(a.seq_len) // a.docs)[None]
        pos = (torch.arange(a.seq_len) % a.docs)[None]
    times = []
    for step in range(a.steps + 1):
        before = _rss_bytes()
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter()
        model(tokens, pos, doc, labels=tokens).backward()
        times.append(time.perf_counter() - t0)
        if step == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            first = peak - before if peak > peak_before else None
        model.zero_grad(set_to_none=False)
        print(f"  step {step}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    pol = MemoryPolicy(a.recompute, a.offload_fraction, 1, a.loss_chunk, a.block_chunk, a.attention_chunk)
    acts = estimate_activations(cfg, a.seq_len, 1, policy=pol, dtype_bytes=4, docs=bool(a.docs))
    transient = transient_bytes(cfg, a.seq_len, 1, head=1, ctx=1, policy=pol, dtype_bytes=4, docs=bool(a.docs),
                                acts=acts)
    grads = sum(p.numel() for p in model.parameters()) * 4
    predicted = acts.total_device + transient + grads
    return {"attention_chunk": a.attention_chunk, "peak_delta_bytes": first,
            "step_s": sorted(times[1:])[len(times[1:]) // 2] if a.steps else times[0], "step_times_s": times,
            "predicted_peak_bytes": predicted,
            "prediction_error": None if not first else predicted / first - 1,
            "predicted": {"saved_device": acts.total_device, "transient": transient, "param_grads": grads}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-100m")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--recompute", default="full")
    p.add_argument("--offload-fraction", type=float, default=0.0)
    p.add_argument("--block-chunk", type=int, default=8192)
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--attention-chunk", type=int, default=8192, help="the chunked case (the other is 0)")
    p.add_argument("--docs", type=int, default=0, help="document length in tokens (0 = one document)")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case is not None:
        a.attention_chunk = a.case
        print(json.dumps(run_case(a)))
        return
    rows = []
    for chunk in (0, a.attention_chunk):
        cmd = [sys.executable, __file__, "--case", str(chunk)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("case", "attention_chunk")]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"attention_chunk {chunk}: peak +{(r['peak_delta_bytes'] or 0) / 2**20:.0f} MiB (predicted "
              f"{r['predicted_peak_bytes'] / 2**20:.0f}), {r['step_s']:.1f} s", file=sys.stderr)
    base, chunked = rows
    print(json.dumps({
        "bench": "attention_chunk", "date": str(date.today()), "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0], "config": {k: v for k, v in vars(a).items() if k != "case"},
        "rows": rows,
        "peak_ratio": (chunked["peak_delta_bytes"] / base["peak_delta_bytes"]
                       if chunked["peak_delta_bytes"] and base["peak_delta_bytes"] else None),
        "step_time_ratio": chunked["step_s"] / base["step_s"],
    }, indent=2))


if __name__ == "__main__":
    main()
