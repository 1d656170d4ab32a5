"""Layout matrix audit: does every layout `longctx train` accepts before launch run?

Samples layouts on worlds 2, 3, 4, 6 (and a few on 8) over the parallel degrees, ZeRO++, CO2, the memory
policies, grad_accum, document masks and model shapes that do not divide evenly; runs the launcher's
preflight(cfg, nproc) in-process on each (cheap), then 2 training steps of a diverse subset of the accepted ones
in spawned gloo jobs, one job per layout. A finding is an accepted layout that crashes.

    PYTHONPATH=src python benchmarks/layout_matrix.py --checks 400 --runs 30 [--seed 0] [--out matrix.json]

Prints JSON: counts (checked / accepted / ran / crashed), the refusals' first words by count, and each crash's
command line and error.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections import Counter

BASE = ["--train.steps=2", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=200", "--checkpoint.final=false", "--metrics.peak_tflops=1.0", "--train.warmup_steps=1"]
SEQ = 96  # divisible by 2 x ctx x head for every ctx x head up to 8 except 5 / 7

MODELS = {  # name: flags
    "debug": ["--model.preset=debug"],
    "heads6": ["--model.preset=debug", "--model.dim=120", "--model.heads=6", "--model.kv_heads=2"],
    "heads6kv1": ["--model.preset=debug", "--model.dim=120", "--model.heads=6", "--model.kv_heads=1"],
    "heads6kv3": ["--model.preset=debug", "--model.dim=72", "--model.heads=6", "--model.kv_heads=3"],
    "heads3": ["--model.preset=debug", "--model.dim=96", "--model.heads=3", "--model.kv_heads=1"],
    "vocab321": ["--model.preset=debug", "--model.vocab_size=321"],
    "hd_odd_dim": ["--model.preset=debug", "--model.dim=130", "--model.head_dim=32"],
    "qwen3": ["--model.preset=debug", "--model.family=qwen3", "--model.qk_norm=true"],
    "moe": ["--model.preset=debug-moe"],
    "moe3": ["--model.preset=debug-moe", "--model.moe.experts=3"],
    "moe6": ["--model.preset=debug-moe", "--model.moe.experts=6"],
    "moe_ed65": ["--model.preset=debug-moe", "--model.moe.expert_dim=65"],
    "moe6_ed63": ["--model.preset=debug-moe", "--model.moe.experts=6", "--model.moe.expert_dim=63",
                  "--model.dim=120", "--model.heads=6"],
    "moe_vocab321": ["--model.preset=debug-moe", "--model.vocab_size=321", "--model.dim=120", "--model.heads=6",
                     "--model.kv_heads=1"],
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sample_case(rng: random.Random) -> tuple[int, list[str], dict]:
    """One layout: (world, flags, features)."""
    world = rng.choice([2, 3, 4, 4, 6, 6] + ([8] if rng.random() < 0.15 else []))
    model = rng.choice(list(MODELS))
    moe = model.startswith("moe")
    rest = world
    rep = rng.choice(divisors(rest))
    rest //= rep
    head = rng.choice(divisors(rest))
    rest //= head
    ctx = rng.choice(divisors(rest))
    shard = rest // ctx
    f = {"world": world, "model": model, "dp_replicate": rep, "dp_shard": shard, "head": head, "ctx": ctx}
    flags = [*MODELS[model], f"--parallel.dp_replicate={rep}", f"--parallel.dp_shard={shard}",
             f"--parallel.head={head}", f"--parallel.ctx={ctx}"]
    if ctx > 2 and rng.random() < 0.5:
        f["window"] = rng.choice([d for d in divisors(ctx) if 1 < d < ctx] or [0])
        flags.append(f"--parallel.window={f['window']}")
    if head > 1 and ctx > 1 and rng.random() < 0.5:
        f["placement"] = "ctx-first"
        flags.append("--parallel.placement=ctx-first")
    if moe and rng.random() < 0.7:
        f["expert"] = rng.choice([d for d in divisors(world) if d > 1])
        flags.append(f"--parallel.expert={f['expert']}")
        if rng.random() < 0.3:
            flags.append("--parallel.expert_replicas=1")
            f["expert_replicas"] = 1
        if rng.random() < 0.3:
            f["expert_ranks_per_node"] = rng.choice(divisors(world))
            flags.append(f"--parallel.expert_ranks_per_node={f['expert_ranks_per_node']}")
        if rng.random() < 0.2:
            flags.append("--parallel.expert_pipeline_chunks=2")
            f["expert_pipeline_chunks"] = 2
    if rng.random() < 0.25:
        f["zero_pp"] = rng.choice(["hpz", "qwz", "qgz", "hpz,qwz,qgz", "qwz,qgz"])
        flags.append(f"--parallel.zero_pp={f['zero_pp']}")
        group = world // rep
        f["ranks_per_node"] = rng.choice(divisors(group))
        flags.append(f"--parallel.ranks_per_node={f['ranks_per_node']}")
        if "hpz" in f["zero_pp"] and rng.random() < 0.4:
            f["hpz_ranks"] = rng.choice(divisors(f["ranks_per_node"]))
            flags.append(f"--parallel.hpz_ranks={f['hpz_ranks']}")
    if rep > 1 and rng.random() < 0.4:
        f["co2"] = True
        flags += ["--train.data_parallel=co2", "--train.co2_local_steps=1", "--train.co2_sync_steps=0"]
    tier = rng.choice(["device"] * 4 + ["host_optimizer", "host"])
    if tier != "device":
        f["model_states"] = tier
        flags.append(f"--memory.model_states={tier}")
    recompute = rng.choice(["none", "none", "selective", "full"])
    if recompute != "none":
        f["recompute"] = recompute
        flags.append(f"--memory.recompute={recompute}")
        if rng.random() < 0.4:
            f["offload_fraction"] = rng.choice([0.5, 1.0])
            flags.append(f"--memory.offload_fraction={f['offload_fraction']}")
        if rng.random() < 0.4:
            f["block_chunk"] = rng.choice([5, 8, 16])
            flags.append(f"--memory.block_chunk={f['block_chunk']}")
    if rng.random() < 0.3:
        f["attention_chunk"] = rng.choice([4, 5, 8, 12])
        flags.append(f"--memory.attention_chunk={f['attention_chunk']}")
    if f.get("attention_chunk") and rng.random() < 0.4:
        f["attention_offload"] = True
        flags.append("--memory.attention_offload=true")
    if moe and rng.random() < 0.3:
        f["expert_chunk"] = rng.choice([7, 16])
        flags.append(f"--memory.expert_chunk={f['expert_chunk']}")
    if rng.random() < 0.2:
        f["loss_chunk"] = rng.choice([7, 32])
        flags.append(f"--memory.loss_chunk={f['loss_chunk']}")
    if rng.random() < 0.2:
        f["tie_embeddings"] = True
        flags.append("--model.tie_embeddings=true")
    if rng.random() < 0.2:
        f["seq_balance"] = "zigzag"
        flags.append("--parallel.seq_balance=zigzag")
    accum = rng.choice([1, 1, 2])
    f["grad_accum"] = accum
    f["per_micro"] = rng.choice([1, 1, 2])  # sequences per data rank and micro-batch
    flags += [f"--train.grad_accum={accum}", f"--train.global_batch={rep * shard * accum * f['per_micro']}"]
    if rng.random() < 0.3:
        f["doc_mask"] = False
        flags.append("--data.doc_mask=false")
    return world, [*BASE, f"--train.seq_len={SEQ}", *flags], f


def check(world: int, flags: list[str], run_dir: str) -> str | None:
    """None when preflight accepts the layout, else the refusal's text."""
    from longctx.config import load_config
    from longctx.errors import UserError
    from longctx.train.preflight import preflight

    try:
        cfg = load_config("configs/debug.toml", [*flags, f"--train.run_dir={run_dir}"])
        preflight(cfg, world, log=lambda *a, **k: None)
    except UserError as e:
        return str(e)
    return None


def train_case(flags: list[str], run_dir: str) -> list[float]:
    from longctx.config import load_config
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", [*flags, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def run_case(world: int, flags: list[str], run_dir: str) -> str | None:
    """None when the 2 steps ran, else the error's last lines."""
    from longctx.job.spawn import run_spawned

    try:
        run_spawned(world, train_case, flags, run_dir, timeout=240.0)
    except Exception as e:  # a crash in any rank: the finding
        text = str(e).strip().splitlines()
        return "\n".join(text[-6:])
    return None


def pick_runs(accepted: list, n: int, rng: random.Random) -> list:
    """A diverse subset: greedily the case that adds the most unseen (feature, value) pairs."""
    seen, chosen, pool = set(), [], list(accepted)
    rng.shuffle(pool)
    while pool and len(chosen) < n:
        best = max(pool, key=lambda c: len(set(c[2].items()) - seen))
        pool.remove(best)
        chosen.append(best)
        seen |= set(best[2].items())
    return chosen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", type=int, default=300)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix="layout_matrix_")
    cases, keys = [], set()
    while len(cases) < a.checks:
        world, flags, feats = sample_case(rng)
        key = (world, tuple(flags))
        if key not in keys:
            keys.add(key)
            cases.append((world, flags, feats))
    accepted, refusals = [], Counter()
    for i, (world, flags, feats) in enumerate(cases):
        refused = check(world, flags, f"{tmp}/check{i}")
        if refused is None:
            accepted.append((world, flags, feats))
        else:
            refusals[refused[:90]] += 1
    print(f"checked {len(cases)}, accepted {len(accepted)}", file=sys.stderr, flush=True)
    crashes, ran = [], 0
    for i, (world, flags, _) in enumerate(pick_runs(accepted, a.runs, rng)):
        err = run_case(world, flags, f"{tmp}/run{i}")
        ran += 1
        line = f"--nproc {world} " + " ".join(x for x in flags if x not in BASE)
        print(f"run {i}: {'CRASH' if err else 'ok'} {line}", file=sys.stderr, flush=True)
        if err:
            print(err, file=sys.stderr, flush=True)
            crashes.append({"world": world, "command": line, "error": err})
    report({"checked": len(cases), "accepted": len(accepted), "ran": ran, "crashed": len(crashes),
            "refusals": refusals.most_common(30), "crashes": crashes}, a.out)


def report(out: dict, path: str | None) -> None:
    """The counts as JSON on stdout, and in `path` when given."""
    text = json.dumps(out, indent=1)
    if path:
        with open(path, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
