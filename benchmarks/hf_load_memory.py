"""Per-rank memory of starting from a Hugging Face checkpoint (issue 15).

Saves a random ~0.47B Llama with transformers as sharded safetensors (once; reused), then measures
each rank's peak RSS while the model is built, sharded and filled:

- `longctx train --model.init_from hf:DIR` with --nproc 1 and --nproc 4 (the "setup:" log line: every
  rank's peak RSS before the first step allocates gradients and optimizer state);
- the two loading routes side by side, in a bare harness (meta build, FSDP2 over 4 ranks, fill):
  `slices` (each rank reads only its rows with safe_open(...).get_slice, what longctx does) and
  `broadcast` (rank 0 reads the whole checkpoint, DCP's set_model_state_dict(...,
  broadcast_from_rank0=True) scatters it), plus the one-process load for reference and
  `full_then_shard` (every rank loads the whole model, then FSDP shards it: longctx before issue 15).

Prints one JSON document. Usage: python benchmarks/hf_load_memory.py [--dir /tmp/longctx-hf-0.5b]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


def make_checkpoint(path: Path) -> None:
    if (path / "model.safetensors.index.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, torch_dtype="float32"))
    model.save_pretrained(path, max_shard_size="500MB", safe_serialization=True)


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def train_setup_peak(path: Path, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx", "train", f"--nproc={nproc}", f"--model.init_from=hf:{path}",
               "--train.steps=1", "--train.seq_len=64", f"--train.global_batch={max(nproc, 1)}",
               "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
               "--checkpoint.interval=0", "--data.max_docs=200", "--data.tokenizer=byte",  # (random weights)
               f"--train.run_dir={tmp}/run"]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(r.stdout[-3000:] + r.stderr[-3000:])
    m = re.search(r"setup: peak RSS per rank ([\d.]+)-([\d.]+) GiB", r.stdout + r.stderr)
    if not m:
        raise SystemExit("no 'setup:' line in the output:\n" + (r.stdout + r.stderr)[-3000:])
    return {"nproc": nproc, "setup_peak_rss_gib_min": float(m[1]), "setup_peak_rss_gib_max": float(m[2]),
            "wall_s_including_one_step": round(wall, 1)}


def worker(route: str, path: Path) -> None:
    """One rank of the bare loading harness (launched by torchrun)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from longctx.config.hf import read_hf_config
    from longctx.models.hf import config_from_hf, hf_name, load_hf_weights
    from longctx.models.llama import build_model

    dist.init_process_group("gloo")
    start = time.perf_counter()
    if route == "full_then_shard":  # what longctx did before issue 15: every rank loads it all
        from longctx.models.hf import load_hf

        model = load_hf(path)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return _report(route, start)
    cfg = config_from_hf(read_hf_config(path))
    model = build_model(cfg, device="meta")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    if route == "slices":
        load_hf_weights(model, path)
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {}
        if dist.get_rank() == 0:
            theirs = {}
            for f in sorted(path.glob("model-*.safetensors")):
                theirs.update(load_file(f))
            full = {ours: theirs[hf_name(ours)] for ours in model.state_dict()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        model.init_rope()
    _report(route, start)


def _report(route: str, start: float) -> None:
    import torch.distributed as dist

    seconds = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_gib())
    if dist.get_rank() == 0:
        print(json.dumps({"route": route, "ranks": len(peaks), "peak_rss_gib_per_rank": [round(p, 3) for p in peaks],
                          "load_s": round(seconds, 1)}))
    dist.barrier()
    dist.destroy_process_group()


def route_peak(route: str, path: Path, nproc: int = 4) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", __file__,
           "--worker", route, "--dir", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if not lines:  # (a gloo abort at teardown, after the figures are printed, is not a failure of the load)
        raise SystemExit(r.stdout[-3000:] + r.stderr[-3000:])
    return {**json.loads(lines[-1]), "exit_code": r.returncode}


def one_process_load(path: Path) -> dict:
    code = ("import json,time;from pathlib import Path;from longctx.models.hf import load_hf;"
            f"import benchmarks.hf_load_memory as b;s=time.perf_counter();m=load_hf('{path}');"
            "print(json.dumps({'route': 'one process', 'peak_rss_gib': round(b.peak_rss_gib(), 3), "
            "'load_s': round(time.perf_counter()-s, 1), 'parameters': sum(p.numel() for p in m.parameters())}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "longctx-hf-0.5b")
    p.add_argument("--worker", choices=["slices", "broadcast", "full_then_shard"])
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.dir)
    make_checkpoint(a.dir)
    single = train_setup_peak(a.dir, 1)
    four = train_setup_peak(a.dir, 4)
    result = {
        "bench": "hf_load_memory", "checkpoint": str(a.dir), "shape": SHAPE,
        "checkpoint_bytes": sum(f.stat().st_size for f in a.dir.glob("model-*.safetensors")),
        "train_setup": [single, four],
        "ratio_max_rank_4_vs_1": round(four["setup_peak_rss_gib_max"] / single["setup_peak_rss_gib_max"], 3),
        "routes": [one_process_load(a.dir), route_peak("slices", a.dir), route_peak("broadcast", a.dir),
                   route_peak("full_then_shard", a.dir)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
