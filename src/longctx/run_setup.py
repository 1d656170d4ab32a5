"""What a training run sets up before its first step: run directory, data, model, checkpoints.

Each function does one thing and is called once by the Trainer (train.py); they are apart from
the loop so that the loop reads as the steps of training.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

import torch

from .config import Config, to_dict
from .data.loader import PackedSamples
from .data.store import read_manifest
from .errors import ConfigError, DataError
from .models.llama import Llama, build_model
from .parallel.parallelize import parallelize
from .parallel.runtime import Runtime
from .step import resolve_dtype


def make_run_dir(cfg: Config) -> Path:
    if cfg.train.run_dir:
        path = Path(cfg.train.run_dir)
    else:
        name = cfg.model.family if cfg.model.preset == "hf" else cfg.model.preset
        path = Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"
        n = 1
        while path.exists():
            path = path.with_name(f"{path.name}-{n}")
            n += 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def store_path(cfg: Config, log, rt: Runtime | None) -> str:
    """data.path, or the store built (once, then cached) from data.corpus. With several ranks,
    rank 0 builds and the others wait for it; any failure there reaches every rank."""
    if cfg.data.path:
        return cfg.data.path
    from .data.cache import default_store

    failure = None
    if rt is None or rt.is_main:
        try:
            outcome = ("ok", str(default_store(cfg.data, cfg.train.seq_len, cfg.metrics.progress, log)))
        except Exception as e:  # every failure reaches the waiting ranks, not only DataError
            failure = e
            outcome = ("error", str(e) if isinstance(e, DataError) else
                       f"building the data store failed on rank 0: {type(e).__name__}: {e}")
    if rt is not None:
        outcome = rt.broadcast(outcome if rt.is_main else None)
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        raise DataError(outcome[1])
    return outcome[1]


def _check_store(cfg: Config, path: str, manifest: dict) -> None:
    tok, seq = manifest["tokenizer"], cfg.train.seq_len
    if manifest["seq_len"] != seq:
        raise ConfigError(
            f"the data store {path} holds samples of {manifest['seq_len']} tokens but train.seq_len is {seq}; "
            f"set train.seq_len={manifest['seq_len']} or build a store with --seq-len {seq}."
        )
    if tok["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer of {path} ({tok['spec']}) has {tok['vocab_size']} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok['vocab_size']}."
        )
    if cfg.data.path and cfg.data.tokenizer not in ("byte", tok["spec"]):
        raise ConfigError(f"data.tokenizer is {cfg.data.tokenizer} but the store {path} was tokenized with "
                          f"{tok['spec']}; drop data.tokenizer (the store's tokenizer is used).")


def build_data(cfg: Config, log=print, rt: Runtime | None = None):
    """Train and eval samples of the run's store (eval is None when evaluation is off or empty)."""
    t0 = time.perf_counter()
    path = store_path(cfg, log, rt)
    manifest = read_manifest(path)
    _check_store(cfg, path, manifest)
    train = PackedSamples(path, "train", cfg.data.doc_mask)
    if len(train) == 0:
        raise DataError(f"the data store {path} has no training samples; build it from more documents.")
    evals = None
    micro = cfg.train.global_batch // cfg.train.grad_accum
    if cfg.train.eval_interval and manifest["totals"]["eval_samples"]:
        evals = PackedSamples(path, "eval", cfg.data.doc_mask)
        if len(evals) < micro:
            raise DataError(
                f"the eval split has {len(evals)} samples, fewer than one micro-batch of {micro} (train.global_batch"
                f" / train.grad_accum); " + ("build the store with a larger --eval-fraction" if cfg.data.path
                                             else "raise data.eval_fraction") + " or set train.eval_interval=0."
            )
    t, tok = manifest["totals"], manifest["tokenizer"]
    fill = manifest["packing"]["train"]["fill_rate"]
    log(f"data: {path} -> {t['documents']:,} documents ({t['duplicates_removed']:,} duplicates removed), "
        f"{train.num_tokens:,} train tokens in {len(train):,} samples of {cfg.train.seq_len} ({manifest['strategy']}, "
        f"fill {fill:.3f}), {0 if evals is None else len(evals):,} eval samples ({tok['name']} tokenizer, "
        f"{time.perf_counter() - t0:.1f}s)")
    return train, evals


def build_training_model(cfg: Config, device: torch.device, rt: Runtime, log=print) -> Llama:
    """The model, built on the meta device, parallelised, and only then materialised: each rank
    allocates and fills just its own shards, from the seed (the same values one process draws, so
    every layout starts identical) or from the Hugging Face safetensors (each rank reading only its
    rows). No rank ever holds the whole model."""
    model = build_model(cfg.model, device="meta")
    model = parallelize(model, rt.dims, cfg, rt.mesh, device.type,
                        resolve_auto_offload=lambda m: auto_offload_fraction(m, cfg, device, rt, log))
    model.to_empty(device=device)
    if cfg.model.init_from:
        from .config_hf import hf_dir, resolve_init_from
        from .models.hf import load_hf_weights

        path = hf_dir(cfg.model.init_from)
        load_hf_weights(model, path)
        _, changed = resolve_init_from({k: v for k, v in to_dict(cfg)["model"].items() if k != "preset"})
        log(f"model: {cfg.model.family} weights from {path}" +
            (f"; changed for this run: {', '.join(changed)}" if changed else ""))
    else:
        model.init_weights(cfg.train.seed)
    return model


def _timing_block(model: Llama, cfg: Config, device: torch.device):
    """A materialised copy of one block with random weights and the model's attention core: what
    offload_fraction=auto times (the model itself is still on the meta device at that point)."""
    from .models.llama import Block

    with torch.device("meta"):
        block = Block(cfg.model)
    block.to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, cfg.model.init_std) if p.dim() > 1 else p.fill_(1.0)
    block.attention.core = model.layers[0].attention.core
    return block


def auto_offload_fraction(model: Llama, cfg: Config, device: torch.device, rt: Runtime, log) -> float:
    """memory.offload_fraction = auto: measure (every rank, the slowest counts) and decide."""
    from .memory.auto import (
        block_forward_seconds,
        choose_offload_fraction,
        host_link_bandwidth,
        host_memory_available,
    )
    from .models.llama import rope_cos_sin, rope_inv_freq

    d, t = rt.dims, cfg.train
    local_batch, local_seq = t.global_batch // (t.grad_accum * rt.dp), t.seq_len // (d.head * d.ctx)
    x = torch.randn(local_batch, local_seq, cfg.model.dim, device=device)
    positions = torch.arange(local_seq, device=device).expand(local_batch, local_seq)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.model, device=device))
    bf16 = resolve_dtype(t.dtype, device) == torch.bfloat16
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        block_s = block_forward_seconds(_timing_block(model, cfg, device), x, cos, sin, None)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # the slowest block, the slowest link and the least memory over all ranks decide
    worst = rt.max([-block_s, -host_link_bandwidth(device), -host_memory_available() / ranks_per_node])
    fraction, reason = choose_offload_fraction(
        cfg.model, t.seq_len, local_batch, head=d.head, ctx=d.ctx, skip_last=cfg.memory.offload_skip_last,
        dtype_bytes=2 if bf16 else 4, block_seconds=-worst[0], link_bytes_per_s=-worst[1],
        host_bytes_per_rank=-worst[2])
    log(reason)
    return fraction


def open_checkpointing(cfg: Config, run_dir: Path, rt: Runtime, model, optimizer, sampler, log):
    """The checkpoint manager (None when neither saving nor resuming) and the step to continue after."""
    ck = cfg.checkpoint
    if not ck.interval and ck.resume == "none":
        return None, 0
    from .checkpoint.manager import CheckpointManager

    root = Path(ck.dir) if ck.dir else run_dir / "checkpoints"
    layout = {"world": rt.world, **{k: getattr(rt.dims, k) for k in
                                    ("dp_replicate", "dp_shard", "head", "ctx", "window", "placement")}}
    manager = CheckpointManager(root, keep=ck.keep, async_save=ck.async_save, rank=rt.rank, world=rt.world,
                                layout=layout, model_cfg=to_dict(cfg)["model"], log=log)
    # verified on every rank before anything is loaded: `auto` skips damaged checkpoints (and says so)
    found = manager.resume_point(ck.resume)
    if found is None:
        if ck.resume != "none":
            log(f"checkpoint: nothing to resume in {root}; starting at step 1")
        return manager, 0
    path, manifest = found
    state = manager.load(path, model, optimizer, manifest)
    sampler.load_state_dict(state["sampler"])
    saved = state["manifest"]["layout"]
    log(f"checkpoint: resumed step {state['step']} from {path} (written by {saved['world']} ranks: "
        f"head {saved['head']} x ctx {saved['ctx']} x dp {saved['dp_replicate']}x{saved['dp_shard']}; "
        f"now {rt.world} ranks)")
    if state["step"] >= cfg.train.steps:
        log(f"checkpoint: step {state['step']} is already >= train.steps={cfg.train.steps}; nothing to train")
    return manager, int(state["step"])
