"""Layout matrix audit, extras: the features layout_matrix.py leaves out, under sampled layouts.

Each case is a layout from layout_matrix.sample_case with one or more extras:
  stages       train.stages with two lengths (48 and 96) and another batch in the second stage
  eval         held-out evaluation during training (eval_interval 1, at every step and the stage ends)
  bf16         --train.dtype=bf16 on CPU
  resume       2 steps saved under one layout, then resumed to step 3 under another of the same world or not
  eval_cli     `longctx eval` (ppl / passkey, score / generate) of a checkpoint under --nproc, head x ctx
  generate_cli `longctx generate` of a checkpoint under --nproc, head x ctx
preflight(cfg, nproc) runs in-process on training cases; the CLI cases are subprocesses (their own checks
run before launch: exit 2 is a refusal). A finding is an accepted case that crashes or hangs.

    PYTHONPATH=src python benchmarks/layout_matrix_extras.py --extras stages,eval,bf16,resume --checks 200 --runs 10
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter

from layout_matrix import BASE, MODELS, check, pick_runs, report, run_case, sample_case

TRAIN_EXTRAS = ("stages", "eval", "bf16", "resume")
CLI_EXTRAS = ("eval_cli", "generate_cli")


def _without(flags: list[str], *keys: str) -> list[str]:
    return [f for f in flags if not any(f.startswith(f"--{k}=") for k in keys)]


def _set(flags: list[str], key: str, value) -> list[str]:
    return [*_without(flags, key), f"--{key}={value}"]


def add_extras(rng: random.Random, flags: list[str], f: dict, extras: list[str]) -> list[str]:
    batch = int(next(x for x in flags if x.startswith("--train.global_batch=")).split("=")[1])
    if "stages" in extras and rng.random() < 0.6:
        per = batch // f["per_micro"]  # sequences per step for one per micro
        second = per * rng.choice([1, 2, 3])
        first = rng.choice([1, 2])
        f["stages"] = f"48:{first}:{batch},96:2:{second}"
        # (configs/debug.toml sets train.steps: given again as the stages' sum, the stages decide it)
        flags = [*_without(flags, "train.steps", "train.seq_len"), f"--train.stages={f['stages']}",
                 f"--train.steps={first + 2}", "--train.seq_len=96"]
    if "eval" in extras and rng.random() < 0.5:
        f["eval"] = True
        flags = [*_set(flags, "train.eval_interval", 1), "--train.eval_batches=1"]
    if "bf16" in extras and rng.random() < 0.4:
        f["bf16"] = True
        flags.append("--train.dtype=bf16")
    return flags


def second_layout(rng: random.Random, flags: list[str], f: dict) -> tuple[int, list[str]]:
    """The layout a resume continues under: another sample of the same model, its batch kept."""
    batch = int(next(x for x in flags if x.startswith("--train.global_batch=")).split("=")[1])
    for _ in range(200):  # (a layout whose data ranks split the saved run's batch, else the last drawn)
        w2, flags2, f2 = sample_case(rng)
        if f2["model"] == f["model"] and batch % (f2["dp_replicate"] * f2["dp_shard"]) == 0:
            break
    # the saved run's model flags (tie_embeddings included): a resume needs the same model
    flags2 = [*(x for x in flags2 if not x.startswith("--model.")), *(x for x in flags if x.startswith("--model."))]
    keep = [x for x in flags if x.startswith(("--train.global_batch=", "--train.stages=", "--train.seq_len=",
                                              "--train.dtype=", "--train.steps="))]
    keys = [x.split("=")[0][2:] for x in keep]
    flags2 = [*_without(flags2, "train.steps", *keys), *keep]
    flags2 = [x for x in flags2 if not x.startswith("--train.grad_accum=")] + ["--train.grad_accum=1"]
    if "--train.stages=" not in " ".join(keep):
        flags2 = [*_without(flags2, "train.steps"), "--train.steps=3"]
    return w2, [*flags2, "--checkpoint.resume=auto"]


def train_cases(rng, n, extras):
    cases, keys = [], set()
    while len(cases) < n:
        world, flags, f = sample_case(rng)
        flags = add_extras(rng, flags, f, extras)
        if "resume" in extras and rng.random() < 0.5:
            f["resume"] = True
            flags = [*_set(flags, "checkpoint.interval", 1)]
        key = (world, tuple(flags))
        if key not in keys:
            keys.add(key)
            cases.append((world, flags, f))
    return cases


def cli(args: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timeout"
    return r.returncode, r.stderr[-1500:]


def cli_cases(rng, n, extras):
    out = []
    while len(out) < n:
        kind = rng.choice([e for e in extras if e in CLI_EXTRAS])
        model = rng.choice(["debug", "heads6", "heads6kv1", "heads3", "qwen3", "moe", "vocab321"])
        world = rng.choice([1, 2, 3, 4, 6])
        head = rng.choice([d for d in range(1, world + 1) if world % d == 0])
        args = ["--nproc", str(world), f"--parallel.head={head}", f"--parallel.ctx={world // head}"]
        if kind == "eval_cli":
            task, mode = rng.choice([("ppl", "score"), ("passkey", "score"), ("passkey", "generate"),
                                     ("needle", "score")])
            length = rng.choice([256, 240, 288])
            args += ["--task", task, "--mode", mode, "--lengths", str(length), "--samples", "2"]
            if task != "ppl":
                args += ["--depths", "0.5"]
            if rng.random() < 0.3:
                args += ["--memory.attention_chunk=8"]
        else:
            args += ["--prompt", rng.choice(["x", "def f(x):\n    return x\n" * 3]), "--max-new-tokens",
                     str(rng.choice([5, 17]))]
            if rng.random() < 0.3:
                args += ["--temperature", "0.8"]
        out.append((kind, model, args))
    return out


def make_checkpoint(model: str, tmp: str) -> str:
    run = f"{tmp}/ckpt_{model}"
    if not os.path.isdir(f"{run}/checkpoints"):
        rc, err = cli(["train", "--nproc", "1", *BASE[:1], *[b for b in BASE[1:] if "checkpoint.final" not in b],
                       "--train.seq_len=96", "--train.global_batch=1", *MODELS[model], f"--train.run_dir={run}"],
                      300)
        assert rc == 0, err
    return f"{run}/checkpoints"


class Tally:
    """The counts, the refusals' first words and the crashes, as layout_matrix.py reports them."""

    def __init__(self):
        self.counts, self.refusals, self.crashes = Counter(), Counter(), []

    def ran(self, what: str, line: str, err: str | None) -> None:
        self.counts["ran"] += 1
        print(f"{what}: {'CRASH' if err else 'ok'} {line}", file=sys.stderr, flush=True)
        if err:
            print(err, file=sys.stderr, flush=True)
            self.crashes.append({"command": line, "error": err})

    def refused(self, what: str, line: str, text: str) -> None:
        self.refusals[f"{what}: {text[:90]}"] += 1
        print(f"{what}: refused {line}\n  {text[:300]}", file=sys.stderr, flush=True)


def _line(world: int, flags: list[str]) -> str:
    return f"--nproc {world} " + " ".join(x for x in flags if x not in BASE)


def train_extras(rng, a, extras, tmp, tally: Tally) -> None:
    """Preflight every sampled case, run a diverse subset; a resume case goes on under another layout."""
    accepted = []
    for i, (world, flags, f) in enumerate(train_cases(rng, a.checks, extras)):
        tally.counts["checked"] += 1
        refused = check(world, flags, f"{tmp}/check{i}")
        if refused is None:
            accepted.append((world, flags, f))
        else:
            tally.refusals[refused[:90]] += 1
    tally.counts["accepted"] += len(accepted)
    for i, (world, flags, f) in enumerate(pick_runs(accepted, a.runs, rng)):
        run_dir = f"{tmp}/run{i}"
        err = run_case(world, flags, run_dir)
        tally.ran(f"run {i}", _line(world, flags), err)
        if err or not f.get("resume"):
            continue
        w2, flags2 = second_layout(rng, flags, f)
        tally.counts["checked"] += 1
        refused = check(w2, flags2, run_dir)
        if refused:
            tally.refused(f"resume {i}", _line(w2, flags2), refused)
            continue
        tally.counts["accepted"] += 1
        tally.ran(f"resume {i}", _line(w2, flags2), run_case(w2, flags2, run_dir))


def cli_extras(rng, a, extras, tmp, tally: Tally) -> None:
    """`longctx eval` / `generate` of a checkpoint of each model under sampled --nproc x head x ctx."""
    for i, (kind, model, args) in enumerate(cli_cases(rng, a.runs, extras)):
        ckpt = make_checkpoint(model, tmp)
        tally.counts["checked"] += 1
        cmd = [kind.split("_")[0], "--checkpoint", ckpt, *args, "--output", f"{tmp}/cli{i}.json"]
        rc, err = cli(cmd, 240)
        line = f"[{model}] " + " ".join(cmd)
        if rc == 2:  # (refused before launch)
            tally.refused(f"cli {i} {kind}", line, err.strip().splitlines()[-1])
            continue
        tally.counts["accepted"] += 1
        tally.ran(f"cli {i}", line, None if rc == 0 else f"rc {rc}: " + "\n".join(err.strip().splitlines()[-6:]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extras", default="stages,eval,bf16,resume")
    ap.add_argument("--checks", type=int, default=200)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    extras = a.extras.split(",")
    rng = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix="layout_matrix_extras_")
    tally = Tally()
    if set(extras) & set(TRAIN_EXTRAS):
        train_extras(rng, a, extras, tmp, tally)
    if set(extras) & set(CLI_EXTRAS):
        cli_extras(rng, a, extras, tmp, tally)
    counts = {k: tally.counts[k] for k in ("checked", "accepted", "ran")}
    report({**counts, "crashed": len(tally.crashes), "refusals": tally.refusals.most_common(30),
            "crashes": tally.crashes}, a.out)


if __name__ == "__main__":
    main()
