"""Behaviour unchanged? The per-step losses and generated tokens of a fixed set of jobs, recorded at
one commit and compared at another (issue 48: a refactor must log the same losses at every step).

    python benchmarks/behaviour_check.py record base.json     # at the commit before the change
    python benchmarks/behaviour_check.py compare base.json    # after it: max differences, exit 1 if any

Jobs: the default run in one process (300 steps), the default 4-rank run (head 2 x ctx 2), debug-moe
under expert 2 x ctx 2 on 2 ranks (100 steps), each logging every step; then, from the one-process
run's last checkpoint, `longctx generate` greedy, sampled (seed 3) and speculative (the checkpoint as
its own draft, K = 4). Runs `python -m longctx` from the current directory's source (set PYTHONPATH
to another tree's src to check that one). Progress goes to stderr, the JSON to the file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["--metrics.log_interval", "1", "--metrics.plots", "false", "--metrics.progress", "false"]
TRAIN_JOBS = {
    "train --nproc 1": ["--nproc", "1"],
    "train (4 ranks, head 2 x ctx 2)": ["--nproc", "4"],
    "debug-moe expert 2 x ctx 2": ["--nproc", "2", "--model.preset", "debug-moe", "--parallel.expert", "2",
                                   "--parallel.ctx", "2", "--train.steps", "100"],
}
PROMPTS = ["def main():", "import os\nimport sys\n\n", "class Tree:\n    def __init__(self, left, right):\n"]
GENERATE_JOBS = {
    "generate greedy": [],
    "generate sampled": ["--temperature", "1", "--seed", "3"],
    "generate speculative": ["--draft", "{ckpt}", "--speculate", "4"],
}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "longctx", *args], cwd=cwd, capture_output=True, text=True)
    print(f"{'ok ' if r.returncode == 0 else 'FAIL'} {time.perf_counter() - t0:6.1f}s  longctx {' '.join(args)[:100]}",
          file=sys.stderr, flush=True)
    if r.returncode:
        raise SystemExit(f"failed:\n{r.stderr[-3000:]}")
    return r


def measure(work: Path) -> dict:
    out: dict = {}
    for name, extra in TRAIN_JOBS.items():
        run_dir = work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        _run(["train", *extra, *COMMON, "--train.run_dir", str(run_dir)], work)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[name] = {str(r["step"]): [r["loss"], r["grad_norm"]] for r in records if r.get("kind") == "train"}
    ckpt = next(work.glob("train_--nproc_1*")) / "checkpoints"
    prompts = work / "prompts.jsonl"  # a batch of different lengths
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for name, extra in GENERATE_JOBS.items():
        r = _run(["generate", "--checkpoint", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "48",
                  *[a.format(ckpt=ckpt) for a in extra]], work)
        out[name] = [json.loads(line)["tokens"] for line in r.stdout.splitlines() if line.startswith("{")]
    return out


def compare(base: dict, now: dict) -> list[str]:
    problems = []
    for name, value in base.items():
        if name not in now:
            problems.append(f"{name}: missing")
        elif name.startswith("generate"):
            if now[name] != value:
                problems.append(f"{name}: tokens differ")
            else:
                print(f"{name}: identical tokens", file=sys.stderr)
        else:
            steps = sorted(value, key=int)
            if sorted(now[name], key=int) != steps:
                problems.append(f"{name}: steps differ")
                continue
            loss = max(abs(value[s][0] - now[name][s][0]) for s in steps)
            gnorm = max(abs(value[s][1] - now[name][s][1]) for s in steps)
            print(f"{name}: {len(steps)} steps, max |loss diff| {loss:.3g}, max |grad-norm diff| {gnorm:.3g}",
                  file=sys.stderr)
            if loss or gnorm:
                problems.append(f"{name}: loss differs by {loss:.3g}, grad norm by {gnorm:.3g}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("record", "compare"))
    p.add_argument("file")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="behaviour-") as tmp:
        now = measure(Path(tmp))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if a.mode == "record":
        Path(a.file).write_text(json.dumps({"commit": commit, "src": os.environ.get("PYTHONPATH", ""),
                                            "jobs": now}) + "\n")
        return 0
    base = json.loads(Path(a.file).read_text())
    problems = compare(base["jobs"], now)
    print(json.dumps({"base_commit": base["commit"], "commit": commit, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
