"""Training speed against a peer on the same card (issue 52 item 1): `longctx train` and transformers
(its LlamaForCausalLM with SDPA attention and gradient checkpointing, fused AdamW) on the same
model (random weights, one sequence of SEQ tokens per step), both with fp32 weights under bf16
autocast on a GPU (fp32 on CPU). Tokens/s from the steps after the first two, MFU from the same
FLOP count (models/flops.py train_flops_per_token) over the card's bf16 dense peak (costs/peaks.py).

    python benchmarks/peer_train.py --preset llama3-1b --seq-len 8192,32768 --steps 6 --out X.json

longctx runs as a user runs it (`python -m longctx train`, recompute full and a chunked loss: what
holds 32K on one card), in a fresh process per length; transformers in this process. Glue check on
CPU: --preset debug --seq-len 512 --steps 4 --device cpu.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ours(preset: str, seq: int, steps: int, device: str, profile: bool = False, compiled: bool = False) -> dict:
    run = tempfile.mkdtemp(prefix="peer_ours_")
    cmd = [sys.executable, "-m", "longctx", "train", "--nproc", "1", "--model.preset", preset,
           "--train.seq_len", str(seq), "--train.global_batch", "1", "--train.steps", str(steps),
           "--train.warmup_steps", "1", "--train.device", device, "--train.eval_interval", "0",
           "--checkpoint.final", "false", "--metrics.plots", "false", "--metrics.progress", "false",
           "--metrics.log_interval", "1", "--memory.recompute", "full", "--data.max_docs", "3000",
           "--train.run_dir", run]
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
    ap.add_argument("--profile", action="store_true",
                    help="one more step of each, under torch.profiler: its kernels by kind, and the top 15 (not timed)")
    args = ap.parse_args()
    rows = []
    compiled = {int(s) for s in args.compiled.split(",") if s}
    for seq in (int(s) for s in args.seq_len.split(",")):
        row = {"seq_len": seq, "longctx": ours(args.preset, seq, args.steps, args.device, args.profile)}
        if seq in compiled:  # (not profiled: the eager run's profile says where the time goes)
            row["longctx_compiled"] = ours(args.preset, seq, args.steps, args.device, compiled=True)
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
        print(json.dumps(row), flush=True)
        rows.append(row)
    import torch

    card = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    text = json.dumps({"preset": args.preset, "device": args.device, "card": card, "steps": args.steps, "rows": rows},
                      indent=1)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
