"""Bytes each training rank reads from the store per step, against the global batch's token bytes.

Trains the debug model (configs/debug.toml) for a few steps on 1 process and on 4 gloo ranks
(dp 2 x ctx 2, the docs-balanced sequence layout), each rank counting the token elements it gathers
from the memory-mapped store (`PackedSamples.bytes_read`). Per rank and step: the bytes read, the
bytes of the tokens it holds (its share), the label look-ahead (read - held: the next token of each
run of held tokens), the bytes already read for the step when it starts (the background read ahead;
at most that step's read), and the seconds the loop waited for its batches. The 4-rank job runs
with the read ahead and without it, and must give the same losses. Prints one JSON document.

    python benchmarks/data_reads.py --steps 8 --seq-lens 512 2048 --out docs/results/data_reads_2026-11-25.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch


def _train(overrides, run_dir, read_ahead):
    """This rank's losses and per-step read figures."""
    from longctx.config import load_config
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*overrides, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None, read_ahead=read_ahead)
    rt, sampler = trainer.rt, trainer.sampler
    samples = sampler.train_samples
    itemsize = samples.parts[0].tokens.dtype.itemsize
    accum = cfg.train.grad_accum
    reads, held, at_start, waits = [], [], [], []
    read_local, step_batches = sampler.read_local, sampler.step_batches

    def counting_read(samples, indices):  # one read at a time: the counter's change is this read's
        before = samples.bytes_read
        share = read_local(samples, indices)
        reads.append(samples.bytes_read - before)
        held.append(share[0].tokens.numel() * itemsize)
        return share

    def timed_step(step):
        at_start.append(samples.bytes_read - sum(reads[:accum * (step - 1)]))
        t0 = time.perf_counter()
        out = step_batches(step)
        waits.append(time.perf_counter() - t0)
        return out

    sampler.read_local, sampler.step_batches = counting_read, timed_step
    losses = trainer.run().losses
    per_step = lambda xs: [sum(xs[i:i + accum]) for i in range(0, len(xs), accum)]  # noqa: E731
    steps = len(losses)
    read, share = per_step(reads), per_step(held)
    global_bytes = cfg.train.global_batch * cfg.train.seq_len * itemsize
    return {
        "rank": rt.rank, "dp_rank": rt.dp_rank, "losses": losses,
        "global_batch_token_bytes_per_step": global_bytes,
        "held_bytes_per_step": share[0] if len(set(share)) == 1 else share,
        "read_bytes_per_step": read,
        "label_lookahead_bytes_per_step": [r - s for r, s in zip(read, share)],
        "read_over_global": round(sum(read) / (steps * global_bytes), 4),
        "read_over_held": round(sum(read) / sum(share), 4),
        "read_ahead_bytes_at_step_start": at_start,
        "max_read_ahead_over_step_read": round(max(a / r for a, r in zip(at_start, read)), 4),
        "total_bytes_read": samples.bytes_read,
        "wait_for_batches_ms_mean": round(1e3 * sum(waits[1:]) / max(len(waits) - 1, 1), 3),  # after step 1
    }


def run(world, overrides, read_ahead):
    from longctx.job.spawn import run_spawned

    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            return [_train(overrides, tmp, read_ahead)]
        return run_spawned(world, _train, overrides, tmp, read_ahead)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048],
                   help="512: the debug store (concat, about one document per sample); 2048: datasculpt, several")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--out", default="", help="also write the JSON here")
    a = p.parse_args()
    result = {"bench": "data_reads", "config": "configs/debug.toml",
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "by_seq_len": {}}
    for seq_len in a.seq_lens:
        base = [f"--train.steps={a.steps}", f"--train.seq_len={seq_len}", f"--train.global_batch={a.global_batch}",
                f"--train.grad_accum={a.grad_accum}", "--train.eval_interval=0", "--metrics.plots=false",
                "--metrics.progress=false"]
        four = [*base, "--parallel.ctx=2"]  # 4 ranks: dp_shard inferred as 2
        runs = {
            "1 process": run(1, base, True),
            "dp2 x ctx2, read ahead": run(4, four, True),
            "dp2 x ctx2, no read ahead": run(4, four, False),
        }
        ahead, sync = runs["dp2 x ctx2, read ahead"], runs["dp2 x ctx2, no read ahead"]
        result["by_seq_len"][str(seq_len)] = {
            "overrides": base, "runs": runs,
            "losses_identical_with_and_without_read_ahead": all(x["losses"] == y["losses"]
                                                                for x, y in zip(ahead, sync)),
            "max_abs_loss_diff_1_process_vs_4_ranks": max(
                abs(x - y) for x, y in zip(runs["1 process"][0]["losses"], ahead[0]["losses"])),
        }
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
