"""Training speed against a peer on the same card (issue 52 item 1): `longctx train` and transformers
(its LlamaForCausalLM with SDPA attention and gradient checkpointing, fused AdamW) on the same
model (random weights, one sequence of SEQ tokens per step), both with fp32 weights under bf16
autocast on a GPU (fp32 on CPU). Tokens/s from the steps after the first two, MFU from the same
FLOP count (models/flops.py train_flops_per_token) over the card's bf16 dense peak (costs/peaks.py).

    python benchmarks/peer_train.py --preset llama3-1b --seq-len 8192,32768 --steps 6 --out X.json

longctx runs as a user runs it (`python -m longctx train`, recompute full and a chunked loss: what
holds 32K on one card), in a fresh process per length; transformers in this process. `--planned`: a row
more with the memory settings `longctx plan` picks for the card (on an H200 no recompute at 8K and 32K:
the activations fit, and recompute full re-runs every block's forward). Glue check on CPU:
--preset debug --seq-len 512 --steps 4 --device cpu --planned 512 (planned for an h100).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # (Python 3.10)
    import tomli as tomllib


FULL = ["--memory.recompute", "full"]  # what holds 32K on an H100 beside its states, as the peer's checkpointing


def planned_memory(preset: str, seq: int, device: str) -> list[str]:
    """The [memory] settings `longctx plan` picks for this card at `seq` tokens (one GPU, this host's memory),
    as overrides: what a user who plans runs, e.g. no recompute where the activations fit (the peer's gradient
    checkpointing re-runs every forward). [] where the card has no hardware preset (a CPU's glue check plans
    for an h100)."""
    import torch

    name = torch.cuda.get_device_name().lower() if device == "cuda" else "h100"
    hardware = next((h for h in ("h200", "h100", "a100") if h in name), None)
    if hardware is None:
        return []
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out = Path(tempfile.mkdtemp(prefix="peer_plan_"), "plan.toml")
    done = subprocess.run([sys.executable, "-m", "longctx", "plan", "--model", preset, "--gpus", "1", "--seq-len",
                           str(seq), "--hardware", hardware, "--hw", f"host_memory_gib={int(host_gib)}",
                           "--out", str(out)], capture_output=True, text=True)
    if done.returncode or not out.exists():
        return []
    memory = tomllib.loads(out.read_text()).get("memory", {})
    return [x for key, value in memory.items()
            for x in (f"--memory.{key}", str(value).lower() if isinstance(value, bool) else str(value))]


def ours(preset: str, seq: int, steps: int, device: str, profile: bool = False, compiled: bool = False,
         memory: list[str] = FULL) -> dict:
    run = tempfile.mkdtemp(prefix="peer_ours_")
    cmd = [sys.executable, "-m", "longctx", "train", "--nproc", "1", "--model.preset", preset,
           "--train.seq_len", str(seq), "--train.global_batch", "1", "--train.steps", str(steps),
           "--train.warmup_steps", "1", "--train.device", device, "--train.eval_interval", "0",
           "--checkpoint.final", "false", "--metrics.plots", "false", "--metrics.progress", "false",
           "--metrics.log_interval", "1", *memory, "--data.max_docs", "3000", "--train.run_dir", run]
    if compiled:  # (each block's token-wise parts compiled: the first step compiles, left out of the figures)
        cmd += ["--train.compile", "true"]
    if profile:  # one more step, profiled, left out of the figures (its profiler's overhead)
        cmd[cmd.index("--train.steps") + 1] = str(steps + 1)
        cmd += ["--metrics.profile_step", str(steps + 1)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines()] \
        if Path(run, "metrics.jsonl").exists() else []
    steps_seen = [x for x in lines if x.get("kind") == "train"][2:steps]
    if done.returncode or not steps_seen:
        return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
    out = {"rc": 0, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in steps_seen),
           "mfu": statistics.median(x["mfu"] for x in steps_seen),
           "memory_gib": max(x["memory_gib"] for x in steps_seen)}
    table = Path(run, "profile", f"step{steps + 1}_top.json")  # (--profile: the extra step's kernels, by kind)
    if table.exists():
        out["profile"] = short_profile(json.loads(table.read_text()))
    if memory is not FULL:
        out["memory_settings"] = " ".join(memory)
    if compiled:  # (the recompile watch on a card: each line's count after the first step's warm-up, 0 if all is well)
        train = [x for x in lines if x.get("kind") == "train"]
        out["compile_recompiles"] = sum(x.get("compile_recompiles", 0) for x in train)
        out["compile_limit_hits"] = max((x.get("compile_limit_hits", 0) for x in train), default=0)
    return out


def short_profile(table: dict) -> dict:
    """A profile table (train/profile_step.py top_table) cut to what a lent device's JSON should carry."""
    return {"time": table["time"], "total_self_s": table["total_self_s"], "by_kind": table["by_kind"],
            "top": table["top"][:15]}


def peer(preset: str, seq: int, steps: int, device: str, profile: bool = False) -> dict:
    import torch
    import transformers

    from longctx.config import load_config
    from longctx.config.hf_export import hf_config_from_model
    from longctx.costs.peaks import device_peak
    from longctx.models.flops import train_flops_per_token

    m = load_config(None, {"model": {"preset": preset, "max_seq_len": max(seq, 8192)}}).model
    dev = torch.device(device)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config_from_model(m).items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dev)
    # (transformers 5 renamed gradient_checkpointing_enable)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    tokens = torch.randint(0, m.vocab_size, (1, seq), device=dev)
    times = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    def one_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (as ours: train.grad_clip 1.0, HF Trainer's too)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(steps):
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:] or times)
    peak, _ = device_peak(dev)
    tps = seq / step_s
    out = {"tokens_per_s": tps, "mfu": tps * train_flops_per_token(m, seq) / peak if peak else None,
           "transformers": transformers.__version__}
    if dev.type == "cuda":
        out["memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if profile:  # one more step, profiled as ours is (train/profile_step.py's table)
        from longctx.train.profile_step import profile_call

        out["profile"] = short_profile(profile_call(one_step, dev.type == "cuda"))
    # (model and opt are freed on return: one_step, which holds them, goes with it)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--seq-len", default="8192,32768")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    ap.add_argument("--compiled", default="",
                    help="lengths (comma-separated) at which longctx also runs with --train.compile true, in the same "
                         "row (longctx_compiled, speedup_compiled); '' = none")
    ap.add_argument("--planned", default="",
                    help="lengths (comma-separated) at which longctx also runs with the memory settings `longctx plan` "
                         "picks for this card (longctx_planned, speedup_planned); '' = none")
    ap.add_argument("--profile", action="store_true",
                    help="one more step of each, under torch.profiler: its kernels by kind, and the top 15 (not timed)")
    args = ap.parse_args()
    rows = []
    compiled = {int(s) for s in args.compiled.split(",") if s}
    planned = {int(s) for s in args.planned.split(",") if s}
    for seq in (int(s) for s in args.seq_len.split(",")):
        row = {"seq_len": seq, "longctx": ours(args.preset, seq, args.steps, args.device, args.profile)}
        if seq in compiled:  # (not profiled: the eager run's profile says where the time goes)
            row["longctx_compiled"] = ours(args.preset, seq, args.steps, args.device, compiled=True)
        if seq in planned:  # (recompute full is the peer's policy; a plan may need none of it on this card)
            memory = planned_memory(args.preset, seq, args.device)
            row["longctx_planned"] = (ours(args.preset, seq, args.steps, args.device, memory=memory) if memory else
                                      {"error": "no plan: the card has no hardware preset, or the planner failed"})
        try:
            row["transformers"] = peer(args.preset, seq, args.steps, args.device, args.profile)
        except Exception as e:  # an out-of-memory peer is a result, not a crash
            row["transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        a, b = row["longctx"].get("tokens_per_s"), row["transformers"].get("tokens_per_s")
        if a and b:
            row["speedup"] = a / b
        c = row.get("longctx_compiled", {}).get("tokens_per_s")
        if c and b:
            row["speedup_compiled"] = c / b
        d = row.get("longctx_planned", {}).get("tokens_per_s")
        if d and b:
            row["speedup_planned"] = d / b
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:  # after each length: a device call's time limit that ends the script keeps the rows done
            write(args, rows)


def write(args, rows: list[dict]) -> None:
    import torch

    card = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    Path(args.out).write_text(json.dumps({"preset": args.preset, "device": args.device, "card": card,
                                          "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
