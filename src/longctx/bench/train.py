"""`longctx bench train`: training throughput and MFU of layouts, as one same-run comparison.

Each (model, sequence length, layout) runs `longctx train --nproc N` for a few steps in a fresh
job, each process on its share of the cores (`threads_per_rank`; the single process all of them);
the first step (warm-up) is dropped and tokens/s, MFU and bytes per step are averaged over the rest.
Output: one JSON document; a run that failed is its row's "error" (the other rows kept), and the command
then exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from .. import strict_json, threads
from ..errors import ConfigError
from ..job.devices import machine_record
from ..progress import phase, say

LAYOUTS = {
    "single": (1, []),
    "ctx4": (4, ["--parallel.ctx=4"]),
    "head4": (4, ["--parallel.head=4"]),
    "head2-ctx2": (4, ["--parallel.head=2", "--parallel.ctx=2"]),
    "dp2-ctx2": (4, ["--parallel.dp_shard=2", "--parallel.ctx=2"]),
}


def threads_per_rank(nproc: int) -> int:
    """Each run's CPU threads per process: the user's OMP_NUM_THREADS, else its share of the cores (the
    single process all of them). Not left to the run: one process alone takes the cores idle as it starts
    (threads.fit_to_idle_cores), so beside another load its rate, and every ratio to it, moved unsaid."""
    given = os.environ.get(threads.THREADS_ENV, "").strip()
    if not given:
        return max(1, threads.usable_cores() // nproc)
    # ('abc', '0' or '-1' ran each case on its share without a word; '²', a digit to isdigit, was int()'s ValueError)
    if not re.fullmatch(r"[1-9][0-9]*", given):
        raise ConfigError(f"{threads.THREADS_ENV}={os.environ[threads.THREADS_ENV]!r}: bench train runs each case's "
                          f"processes with that many CPU threads each, a positive integer; set one, or unset it for "
                          f"each process's share of the cores.")
    return int(given)


def run_one(preset: str, seq: int, layout: str, steps: int, global_batch: int) -> dict:
    nproc, args = LAYOUTS[layout]
    per_rank = threads_per_rank(nproc)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx", "train", f"--nproc={nproc}", f"--threads={per_rank}",
               f"--model.preset={preset}",
               f"--train.seq_len={seq}", f"--train.global_batch={global_batch}", f"--train.steps={steps}",
               "--train.eval_interval=0", "--train.warmup_steps=1", "--metrics.log_interval=1",
               "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=400", f"--train.run_dir={tmp}",
               # no final checkpoint: its blocking save would land in the last timed step's tokens/s and MFU
               "--checkpoint.final=false",
               *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:  # (a run killed without a word, by the OOM killer say, left an empty error)
            how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
            return {"preset": preset, "seq_len": seq, "layout": layout,
                    "error": r.stderr[-1500:].strip() or f"longctx train ended with {how} and printed nothing"}
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = [x for x in records if x["kind"] == "train" and x["step"] > 1]
    if not timed:
        return {"preset": preset, "seq_len": seq, "layout": layout,
                "error": f"no train record after the warm-up step (--steps {steps}): nothing timed"}
    # every step trains the same tokens (and FLOPs), so the rate over the timed steps is the harmonic
    # mean of the per-step rates (total tokens / total seconds), not their arithmetic mean, which a
    # slow step pulls up instead of down
    mean = lambda k: len(timed) / sum(1 / x[k] for x in timed)  # noqa: E731
    return {"preset": preset, "seq_len": seq, "layout": layout, "world": nproc, "threads_per_rank": per_rank,
            "steps_timed": len(timed),
            "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu") if timed[0].get("mfu") else None,
            "memory_gib_max": max(x["memory_gib"] for x in timed), "memory_kind": timed[-1].get("memory_kind"),
            "loss_last": timed[-1]["loss"],
            "comm_bytes_per_step": timed[-1].get("comm_bytes_per_step", {})}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="debug", help="comma-separated model presets")
    p.add_argument("--seq-len", default="4096,8192", help="comma-separated sequence lengths (tokens)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    p.add_argument("--global-batch", type=int, default=2, help="sequences per optimizer step over the whole job")


def main(args) -> int:
    if args.steps < 2:  # the first step is the warm-up: with one, the figures would be the warm-up's
        raise ConfigError(f"--steps {args.steps} leaves no timed step after the warm-up; "
                          f"give --steps 2 or more (3 or more for a mean).")
    threads_per_rank(1)  # (OMP_NUM_THREADS checked before the first case)
    rows = []
    with phase("bench train"):  # each case a progress phase: one that takes long is said while it runs
        for preset in args.presets.split(","):
            for seq in map(int, args.seq_len.split(",")):
                for layout in args.layouts.split(","):
                    with phase(f"{preset} at {seq:,} tokens, layout {layout}", done_line=False):
                        row = run_one(preset, seq, layout, args.steps, args.global_batch)
                    say(strict_json.dumps(row))  # progress
                    rows.append(row)
    # the settings every row ran (the rates are of --global-batch sequences per step): two files compare
    config = {"presets": args.presets, "seq_len": args.seq_len, "layouts": args.layouts, "steps": args.steps,
              "global_batch": args.global_batch}
    print(strict_json.dumps({"bench": "train", "date": date.today().isoformat(), "config": config, "rows": rows,
                             "machine": machine_record()}, indent=2))
    failed = [f"{r['preset']} at {r['seq_len']:,} tokens, layout {r['layout']}" for r in rows if "error" in r]
    if failed:  # (the other rows' figures are printed above; a script reading rc 0 took every row for measured)
        say(f"{len(failed)} of {len(rows)} runs failed (their rows' \"error\" says why): {'; '.join(failed)}")
        return 1
    return 0
