"""Predicted host bytes against measured RSS growth, per memory.model_states tier (issue 49 item 3).

    python benchmarks/host_bytes.py --preset small-100m --seq-len 1024 --steps 3 \
        --out docs/results/host_bytes_<date>.json

Each tier trains in a fresh process through the real training loop (`Trainer(cfg).run()`: data
loader with its read-ahead, optimizer, the host_optimizer worker, FSDP's one-rank group under
host). The default data store is built (or found in the cache) by the preflight first. Just
before the model is built, the process's peak RSS is reset (/proc/self/clear_refs 5) and its RSS
read as the baseline; after the steps the peak (VmHWM) minus the baseline is the measured growth.
On a CPU the device is host memory, so the prediction compared is the rank's device bytes plus
its host bytes as one memory holds them (costs/host_bytes.py predicted_rank_bytes and
one_memory_bytes: the figures the preflight checks on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import date

TIERS = ("device", "host_optimizer", "host")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _overrides(args, tier: str) -> list[str]:
    return [f"--model.preset={args.preset}", f"--train.seq_len={args.seq_len}", f"--train.steps={args.steps}",
            f"--train.global_batch={args.global_batch}", "--train.device=cpu", "--train.dtype=fp32",
            f"--memory.model_states={tier}", "--checkpoint.final=false",
            f"--train.run_dir={args.run_dir}/{tier}", "--train.eval_interval=0"]


def child(args) -> dict:
    """One tier in this process: the prediction, then the run's RSS growth from the model's build."""
    from longctx.config import load_config
    from longctx.costs.host_bytes import one_memory_bytes, predicted_rank_bytes
    from longctx.costs.shape import MeshShape
    from longctx.memory.policy import MemoryPolicy
    from longctx.train import trainer
    from longctx.train.preflight import preflight

    cfg = load_config(None, _overrides(args, args.child))
    preflight(cfg, 1, log=lambda *a: None)  # the data store built or found here, before the baseline
    device, host = predicted_rank_bytes(cfg.model, MeshShape(), MemoryPolicy.from_config(cfg.memory), args.child,
                                        seq_len=cfg.train.seq_len, micro_batch=cfg.train.global_batch,
                                        grad_accum=cfg.train.grad_accum, dtype_bytes=4, doc_mask=cfg.data.doc_mask,
                                        device_type="cpu")  # (a CPU run: nothing pinned, exact bytes)
    seen = {}
    build = trainer.build_training_model

    def measured_build(*a, **k):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        seen["baseline"] = _status("VmRSS")
        return build(*a, **k)

    trainer.build_training_model = measured_build
    trainer.Trainer(cfg, log=lambda *a: None).run()
    peak = _status("VmHWM")
    predicted = one_memory_bytes(cfg.model, MeshShape(), args.child, device, host, cfg.train.grad_accum)
    growth = peak - seen["baseline"]
    return {"tier": args.child, "baseline_rss_bytes": seen["baseline"], "peak_rss_bytes": peak,
            "measured_growth_bytes": growth, "predicted_bytes": predicted,
            "predicted_device": device, "predicted_host": host,
            "one_memory_less_sum": predicted - device["total"] - host["total"],
            "predicted_over_measured": predicted / growth}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small-100m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiers", default=",".join(TIERS))
    p.add_argument("--run-dir", default="/tmp/longctx_host_bytes",
                   help="scratch: each tier's run directory DIR/<tier> is deleted and made afresh")
    p.add_argument("--out", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = []
    for tier in args.tiers.split(","):
        shutil.rmtree(f"{args.run_dir}/{tier}", ignore_errors=True)  # this script's scratch: a fresh run each time
        cmd = [sys.executable, __file__, "--child", tier, "--preset", args.preset, "--seq-len", str(args.seq_len),
               "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--run-dir", args.run_dir]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            rows.append({"tier": tier, "error": run.stderr.strip().splitlines()[-3:]})
        else:
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{tier}: " + (f"predicted {r['predicted_bytes'] / 2**20:,.1f} MiB, measured growth "
                             f"{r['measured_growth_bytes'] / 2**20:,.1f} MiB, ratio {r['predicted_over_measured']:.3f}"
                             if "error" not in r else f"failed: {r['error']}"), file=sys.stderr)
    import torch

    doc = {"benchmark": "host_bytes", "date": date.today().isoformat(), "machine": platform.machine(),
           "cores": os.cpu_count(), "torch": torch.__version__, "preset": args.preset, "seq_len": args.seq_len,
           "global_batch": args.global_batch, "steps": args.steps, "rows": rows}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
