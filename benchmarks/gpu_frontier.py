"""Issue 49's GPU measurements, for the device we are lent (benchmarks/gpu_frontier.sh runs it; run
from the repository root). Every probe is a fresh `longctx train` process with its own time limit,
all within one budget (BUDGET_S, default 450 s), in order of what matters most:

0. cuda_process (~10 s): the host memory a CUDA rank holds besides its run's bytes, the figure the host preflight
   and the planner count per GPU rank (costs/cuda_runtime.py CUDA_RUNTIME_BYTES, "cuda_runtime"): a fresh process
   imports torch and longctx (imports_gib, its RSS then: a rank's "process" part, beside the planner's
   costs/rank_process.py figure, process_constant_gib), makes the CUDA context, runs one cuBLAS matmul and one SDPA
   call; cuda_process_gib is its peak RSS, cuda_runtime_gib the difference, beside the constant (constant_gib);
   the check is cuda_process_gib against counted_gib (both constants: what a GPU rank is counted besides its run).
   A training rank loads more (NCCL's communicators, the optimizer's kernels): the probe is a floor for it;
1. smoke: the debug model 30 steps under each memory.model_states tier; the losses against device's
   (the host paths' first run on a GPU);
2. blocks: full-width llama3-8b blocks (2 and 4 layers) at SEQ_8B tokens (by default the issue's length for
   the card: 524,288 on an H100, 1,048,576 on an H200) under host_optimizer, checkpoint offload (recompute
   full + offload 1.0) and chunked blocks / attention / loss: device peak, host peak, tokens/s, MFU. Depth must not
   change the device peak (4 layers within 5% of 2) and it must stay under 90% of the device;
3. overlap: llama3-1b at 32K under host_optimizer, 4 steps: how much of the host AdamW update the
   next forward waited for (host_exposed_s / host_step_s; the issue asks at most 30%);
4. longest: llama3-1b at full depth, the longest of 512K / 256K / 128K one step trains at (tried
   longest first, stopping at the first that fits);
5. with what budget is left, the same blocks under `host` (FSDP2's CPU offload).

JSON goes to $OUT/gpu_frontier.json and, on a GPU, to docs/results/gpu_frontier_<card>_<date>.json,
rewritten after each probe (a call stopped from outside keeps what was measured).
Glue check on CPU (small figures, no results file):
  DEVICE=cpu SMOKE_STEPS=3 SEQ_8B=2048 SEQ_OVERLAP=1024 LONGEST="2048 1024" PRESET_8B=debug PRESET_1B=debug \
      python benchmarks/gpu_frontier.py
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = os.environ
DEVICE = ENV.get("DEVICE", "cuda")
BUDGET_S = float(ENV.get("BUDGET_S", "450"))
CHUNK = ENV.get("CHUNK", "8192")
COMMON = ["--nproc", "1", "--train.device", DEVICE, "--train.eval_interval", "0", "--checkpoint.final", "false",
          "--metrics.plots", "false", "--metrics.progress", "false", "--metrics.log_interval", "1"]
FRONTIER = ["--memory.recompute", "full", "--memory.offload_fraction", "1.0", "--memory.block_chunk", CHUNK,
            "--memory.attention_chunk", CHUNK, "--memory.loss_chunk", CHUNK, "--train.global_batch", "1",
            "--train.warmup_steps", "1", "--data.max_docs", "3000"]
START = time.monotonic()


def left() -> float:
    return BUDGET_S - (time.monotonic() - START)


def train(name: str, args: list[str], limit: float) -> dict:
    """One `longctx train` process: its return code, wall time, host peak (max RSS of the process
    tree it waited for) and the last metrics line's figures."""
    run = tempfile.mkdtemp(prefix=f"frontier_{name}_")
    limit = min(limit, left())
    if limit < 20:
        return {"name": name, "skipped": "out of budget"}
    cmd = [sys.executable, "-m", "longctx", "train", *COMMON, *args, "--train.run_dir", run]
    t0 = time.monotonic()
    with open(f"{run}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while True:  # reaped by wait4 for its rusage: the tree's max RSS
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > limit:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines()] \
        if Path(run, "metrics.jsonl").exists() else []
    steps = [x for x in lines if x.get("kind") == "train"]
    out = {"name": name, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "steps": len(steps),
           "losses": [x["loss"] for x in steps]}
    out["host_peak_gib"] = round(usage.ru_maxrss / 2**20, 2)
    if steps:
        last = steps[-1]
        out.update({k: last[k] for k in ("tokens_per_s", "mfu", "memory_gib", "memory_kind", "host_step_s",
                                         "host_exposed_s") if k in last})
    if rc != 0:
        out["tail"] = Path(f"{run}.log").read_text()[-1500:]
    print(json.dumps({k: v for k, v in out.items() if k not in ("losses", "tail")}), flush=True)
    return out


# (the peak: memory/rss.py's VmHWM, this process image's own; ru_maxrss is kept across exec on Linux, so a probe
# forked from a larger process, a test worker's 2.9 GiB, read its parent's size as its own)
CUDA_PROCESS = """
import json, sys
import torch
import torch.nn.functional as F
import longctx.cli  # (a rank's imports: the "process" part, costs/rank_process.py)
from longctx.memory.rss import peak_rss_bytes

def peak_gib():
    return peak_rss_bytes() / 2**30

imported = peak_gib()
a = torch.randn(1024, 1024, device=sys.argv[1], dtype=torch.bfloat16)  # (the CUDA context)
(a @ a).sum().item()  # cuBLAS
q = torch.randn(1, 8, 512, 64, device=sys.argv[1], dtype=torch.bfloat16)
F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
print(json.dumps({"imports_gib": round(imported, 3), "cuda_process_gib": round(peak_gib(), 3)}))
"""


def cuda_process() -> dict:
    """Probe 0 (the module's docstring): CUDA's own host memory in a process of its own, against the constant; and
    the process's RSS with torch and longctx imported (a CUDA build's), against the planner's "process" figure."""
    from longctx.costs.cuda_runtime import CUDA_RUNTIME_BYTES
    from longctx.costs.rank_process import PROCESS_BYTES

    done = subprocess.run([sys.executable, "-c", CUDA_PROCESS, DEVICE], capture_output=True, text=True,
                          timeout=max(1.0, min(120.0, left())))
    if done.returncode:
        return {"device": DEVICE, "rc": done.returncode, "tail": done.stderr[-1500:]}
    got = json.loads(done.stdout.splitlines()[-1])
    got["cuda_runtime_gib"] = round(got["cuda_process_gib"] - got["imports_gib"], 3)
    out = {"device": DEVICE, **got, "constant_gib": round(CUDA_RUNTIME_BYTES / 2**30, 3),
           "process_constant_gib": round(PROCESS_BYTES / 2**30, 3),
           # what the planner and the preflight count per GPU rank besides its run's bytes: the process's peak
           # (cuda_process_gib) is to stay within it (cuda_runtime_gib alone leaves out the CUDA build's larger
           # imports, which the constant holds: costs/rank_process.py)
           "counted_gib": round((PROCESS_BYTES + CUDA_RUNTIME_BYTES) / 2**30, 3)}
    print(json.dumps(out), flush=True)
    return out


def smoke(steps: str) -> dict:
    tiers = ENV.get("SMOKE_TIERS", "device,host_optimizer,host").split(",")  # (device: the reference)
    runs = {tier: train(f"smoke_{tier}", ["--train.steps", steps, "--memory.model_states", tier], 90)
            for tier in tiers}
    ref = runs.get("device", {}).get("losses", [])  # (a run skipped for want of budget, or not asked, has none)
    for tier in [t for t in tiers if t != "device"]:
        got = runs[tier].get("losses", [])
        # over the steps both ran; a tier that stopped early (its rc) has no diff for the rest, said apart
        runs[tier]["max_abs_loss_diff"] = max((abs(a - b) for a, b in zip(ref, got)), default=None)
        runs[tier]["loss_steps_compared"] = min(len(ref), len(got))
    return runs


def length(seq: str) -> list[str]:
    """train.seq_len, and model.max_seq_len raised to it: the presets' 131,072 is shorter than the frontier's
    lengths, and the length guard refuses a sequence past the model's (the llama3 RoPE scaling reads
    model.rope_original_max_len, not max_seq_len, so raising it changes no position's rotation)."""
    return ["--train.seq_len", seq, "--model.max_seq_len", seq]


def blocks(preset: str, seq: str, tier: str) -> dict:
    runs = {layers: train(f"blocks{layers}_{tier}", ["--model.preset", preset, "--model.layers", layers,
                                                     *length(seq), "--train.steps", "1",
                                                     "--memory.model_states", tier, *FRONTIER], 240)
            for layers in ("2", "4")}
    peaks = [runs[n].get("memory_gib") for n in ("2", "4")]
    summary = {"seq_len": int(seq), "tier": tier, "runs": runs}
    if all(peaks):
        summary["device_peak_ratio_4_over_2"] = round(peaks[1] / peaks[0], 4)
    return summary


def longest(preset: str, lengths: list[str]) -> dict:
    tried = []
    for seq in lengths:  # longest first: the first that trains is the answer
        run = train(f"longest_{seq}", ["--model.preset", preset, *length(seq), "--train.steps", "1",
                                       "--memory.model_states", "host_optimizer", *FRONTIER], 300)
        tried.append(run)
        if run.get("rc") == 0:
            return {"longest_seq_len": int(seq), "runs": tried}
    return {"longest_seq_len": None, "runs": tried}


def overlap(preset: str, seq: str) -> dict:
    run = train("overlap", ["--model.preset", preset, "--train.seq_len", seq, "--train.steps", "4",
                            "--memory.model_states", "host_optimizer", *FRONTIER], 120)
    if run.get("host_step_s"):
        run["hidden_fraction"] = round(1 - run["host_exposed_s"] / run["host_step_s"], 3)
    return run


def card() -> dict:
    if DEVICE != "cuda":
        return {"name": "cpu"}
    import torch
    props = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0), "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__}


def save(out: dict) -> str:
    """The figures so far, to $OUT/gpu_frontier.json (and docs/results on a GPU): written after each
    probe, so a call stopped from outside (its time limit) still returns what was measured."""
    out["elapsed_s"] = round(time.monotonic() - START, 1)
    text = json.dumps(out, indent=1)
    Path(ENV.get("OUT", "/tmp/gpu_out")).mkdir(parents=True, exist_ok=True)
    Path(ENV.get("OUT", "/tmp/gpu_out"), "gpu_frontier.json").write_text(text)
    if DEVICE == "cuda":
        slug = out["card"]["name"].lower().replace(" ", "-")
        Path("docs/results", f"gpu_frontier_{slug}_{out['date']}{ENV.get('TAG', '')}.json").write_text(text)
    return text


def probe(out: dict, key: str, fn, *args, append: bool = False) -> None:
    """One probe's figures into `out` (a list's next entry with `append`), saved at once; a probe that
    fails records its error instead, so the probes after it still run within the call."""
    try:
        got = fn(*args)
    except Exception as e:  # (a failing probe must not lose the rest of a lent device's minutes)
        got = {"error": f"{type(e).__name__}: {e}"}
    if append:
        out.setdefault(key, []).append(got)
    else:
        out[key] = got
    save(out)


def main() -> None:
    out = {"card": card(), "date": datetime.date.today().isoformat(), "budget_s": BUDGET_S}
    print(json.dumps(out), flush=True)
    # PROBES: which to run (a rerun of some within a device's last minutes), in this order
    wanted = ENV.get("PROBES", "cuda_process,smoke,blocks,overlap,longest,blocks_host").split(",")
    # the length for the 8B blocks: 512K on an H100, 1M on an H200 (over 120 GiB of device memory)
    big = out["card"].get("memory_gib", 0) > 120
    seq_8b, preset_8b = ENV.get("SEQ_8B", "1048576" if big else "524288"), ENV.get("PRESET_8B", "llama3-8b")
    preset_1b = ENV.get("PRESET_1B", "llama3-1b")
    if "cuda_process" in wanted:
        probe(out, "cuda_process", cuda_process)
    if "smoke" in wanted:
        probe(out, "smoke", smoke, ENV.get("SMOKE_STEPS", "30"))
    if "blocks" in wanted:
        probe(out, "blocks", blocks, preset_8b, seq_8b, "host_optimizer", append=True)
    if "overlap" in wanted:
        probe(out, "overlap", overlap, preset_1b, ENV.get("SEQ_OVERLAP", "32768"))
    if "longest" in wanted:
        probe(out, "longest", longest, preset_1b, ENV.get("LONGEST", "524288 262144 131072").split())
    if "blocks_host" in wanted:
        probe(out, "blocks", blocks, preset_8b, seq_8b, "host", append=True)
    print(save(out)[:3000])


if __name__ == "__main__":
    main()
