"""The training loop: data -> model -> parallelize -> optimizer -> steps with metrics and eval -> plots.

One optimizer step = `train.grad_accum` micro-batches of `train.batch_size` windows; batch_size is
GLOBAL (summed over data-parallel ranks), so a config means the same training under any layout.
The loss of a step is the mean over every valid (non-ignored) label token of the global step:
every rank divides its summed local loss by that count (known to all ranks, since all of them
draw the same global batch) and FSDP sums the gradients, so micro-batches and ranks with different
numbers of valid tokens are weighted exactly as one large batch on one device would be.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from .config import Config, to_toml
from .data.loader import BatchLoader, PackedWindows, cost_coefficients
from .data.store import read_manifest
from .data.windows import Batch
from .errors import ConfigError, DataError, TrainingError
from .parallel.launch import init_distributed
from .parallel.parallelize import grad_scale, parallelize
from .parallel.runtime import TRACKED_DIMS, Runtime
from .parallel.sequence import check_divisible
from .parallel.ulysses import check_heads
from .metrics import (
    MetricsWriter,
    device_peak,
    format_line,
    peak_memory_bytes,
    train_flops_per_token,
)
from .models.llama import Llama, build_model, count_params


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per optimizer step run by this job
    first_step: int = 1  # the step losses[0] belongs to (> 1 after a resume)
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=auto or cpu.")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step (step is 0-based)."""
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    t = cfg.train
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def make_run_dir(cfg: Config) -> Path:
    if cfg.train.run_dir:
        path = Path(cfg.train.run_dir)
    else:
        path = Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.model.preset}"
        n = 1
        while path.exists():
            path = path.with_name(f"{path.name}-{n}")
            n += 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_data(cfg: Config, log=print, rt: Runtime | None = None):
    """Train and eval windows from the packed store at data.path, or from the store built (once,
    then cached) from data.corpus. With several ranks, rank 0 builds and the others wait for it."""
    t0 = time.perf_counter()
    path = cfg.data.path
    if not path:
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
        path = outcome[1]
    manifest = read_manifest(path)
    tok = manifest["tokenizer"]
    seq = cfg.train.seq_len
    if manifest["context"] != seq:
        raise ConfigError(
            f"the data store {path} holds windows of {manifest['context']} tokens but train.seq_len is {seq}; "
            f"set train.seq_len={manifest['context']} or build a store with --context {seq}."
        )
    if tok["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer of {path} ({tok['spec']}) has {tok['vocab_size']} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok['vocab_size']}."
        )
    if cfg.data.path and cfg.data.tokenizer not in ("byte", tok["spec"]):
        raise ConfigError(f"data.tokenizer is {cfg.data.tokenizer} but the store {path} was tokenized with "
                          f"{tok['spec']}; drop data.tokenizer (the store's tokenizer is used).")
    train = PackedWindows(path, "train", cfg.data.doc_mask)
    if len(train) == 0:
        raise DataError(f"the data store {path} has no training windows; build it from more documents.")
    evals = None
    if cfg.train.eval_interval and manifest["totals"]["eval_windows"]:
        evals = PackedWindows(path, "eval", cfg.data.doc_mask)
        if len(evals) < cfg.train.batch_size:
            raise DataError(
                f"the eval split has {len(evals)} windows, fewer than one batch of train.batch_size="
                f"{cfg.train.batch_size}; " + ("build the store with a larger --eval-fraction" if cfg.data.path
                                               else "raise data.eval_fraction") + " or set train.eval_interval=0."
            )
    t = manifest["totals"]
    fill = manifest["packing"]["train"]["fill_rate"]
    log(f"data: {path} -> {t['documents']:,} documents ({t['duplicates_removed']:,} duplicates removed), "
        f"{train.num_tokens:,} train tokens in {len(train):,} windows of {seq} ({manifest['strategy']}, fill "
        f"{fill:.3f}), {0 if evals is None else len(evals):,} eval windows ({tok['name']} tokenizer, "
        f"{time.perf_counter() - t0:.1f}s)")
    return train, evals


def build_training_model(cfg: Config, device: torch.device, rt: Runtime, log=print) -> Llama:
    """The full model, initialised identically on every rank from the seed, then parallelised.

    Initialising the whole model before sharding keeps every layout bit-identical to the single
    device run (the price: each rank briefly holds the full fp32 model)."""
    if cfg.model.init_from:
        from .models.hf import load_hf

        model = load_hf(cfg.model.init_from.removeprefix("hf:"), dtype=torch.float32, device=device)
    else:
        model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    return parallelize(model, rt.dims, cfg, rt.mesh, device.type,
                       resolve_auto_offload=lambda m: _auto_offload_fraction(m, cfg, device, rt, log))


def _auto_offload_fraction(model: Llama, cfg: Config, device: torch.device, rt: Runtime, log) -> float:
    """memory.offload_fraction = auto: measure (every rank, the slowest counts) and decide."""
    from .memory.auto import block_forward_seconds, choose_offload_fraction, host_link_bandwidth, host_memory_available
    from .models.llama import rope_cos_sin

    d, t = rt.dims, cfg.train
    local_batch, local_seq = t.batch_size // rt.dp, t.seq_len // (d.head * d.ctx)
    x = torch.randn(local_batch, local_seq, cfg.model.dim, device=device)
    positions = torch.arange(local_seq, device=device).expand(local_batch, local_seq)
    cos, sin = rope_cos_sin(positions, model.inv_freq)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=resolve_dtype(t.dtype, device) == torch.bfloat16):
        block_s = block_forward_seconds(model.layers[0], x, cos, sin, None)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # the slowest block, the slowest link and the least memory over all ranks decide
    worst = rt.max([-block_s, -host_link_bandwidth(device), -host_memory_available() / ranks_per_node])
    fraction, reason = choose_offload_fraction(
        cfg.model, t.seq_len, local_batch, head=d.head, ctx=d.ctx, skip_last=cfg.memory.offload_skip_last,
        dtype_bytes=2 if resolve_dtype(t.dtype, device) == torch.bfloat16 else 4,
        block_seconds=-worst[0], link_bytes_per_s=-worst[1], host_bytes_per_rank=-worst[2])
    log(reason)
    return fraction


def check_layout(cfg: Config, world: int) -> None:
    """Every layout problem of this config on `world` ranks, before any process starts work."""
    from .parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size=world)
    check_heads(cfg.model.heads, cfg.model.kv_heads, dims.head)
    check_divisible(cfg.train.seq_len, dims.ctx, dims.head)
    dp = dims.dp_replicate * dims.dp_shard
    if cfg.train.batch_size % dp:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}, sequences per micro-batch over the whole job) must be "
            f"divisible by the data-parallel degree dp_replicate x dp_shard = {dims.dp_replicate} x {dims.dp_shard} "
            f"= {dp}; use a multiple of {dp}."
        )


def _forward_sum(model: Llama, batch: Batch, autocast_dtype):
    with torch.autocast(device_type=batch.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="sum")


@torch.no_grad()
def evaluate(model: Llama, windows: PackedWindows, cfg: Config, device, autocast_dtype, rt: Runtime) -> float:
    """Mean loss over the first eval_batches x batch_size eval windows (a fixed set, so evals compare)."""
    model.eval()
    total, count = 0.0, 0
    n = min(len(windows), cfg.train.eval_batches * cfg.train.batch_size)
    for start in range(0, n - cfg.train.batch_size + 1, cfg.train.batch_size):
        batch = windows.batch(range(start, start + cfg.train.batch_size))
        total += float(_forward_sum(model, rt.local_batch(batch).to(device), autocast_dtype))
        count += batch.valid_tokens
    model.train()
    return rt.sum([total])[0] / max(count, 1)


def clip_gradients(model, max_norm: float) -> float:
    """Global gradient norm (over all shards) and clipping to max_norm (0 = no clipping)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):  # sharded (DTensor) gradients: the norm is a partial result
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)


def fsdp_bytes_per_step(model: torch.nn.Module, cfg: Config, rt: Runtime) -> dict[str, float]:
    """Closed-form FSDP2 traffic per rank and step (its collectives run inside PyTorch, not comm.py):
    per micro-batch, parameters are all-gathered for forward and again for backward and gradients
    reduce-scattered over the shard group; with HSDP the shards are then all-reduced over replicas."""
    from .parallel.volumes import fsdp_bytes

    if rt.world == 1:
        return {}
    gather = 2 if rt.device.type == "cuda" and cfg.train.dtype in ("auto", "bf16") else 4  # bf16 all-gathers
    per_micro = fsdp_bytes(sum(p.numel() for p in model.parameters()), rt.dims.dp_shard * rt.dims.head * rt.dims.ctx,
                           rt.dims.dp_replicate, gather)
    return {"fsdp": per_micro * cfg.train.grad_accum}


def train(cfg: Config, log=print) -> TrainResult:
    device = resolve_device(cfg.train.device)
    rank, world = init_distributed(device.type, cfg.parallel.timeout_s)
    check_layout(cfg, world)
    rt = Runtime.create(cfg, rank, world, device.type)
    if device.type == "cuda":
        device = rt.device
    if not rt.is_main:
        log = _silent  # noqa: F811  (one voice per job)
    dtype = resolve_dtype(cfg.train.dtype, device)
    autocast_dtype = dtype if dtype != torch.float32 else None
    seed_everything(cfg.train.seed)
    if cfg.metrics.tensorboard:
        try:
            importlib.import_module("tensorboard")
        except ImportError:
            raise ConfigError("metrics.tensorboard=true needs the tensorboard package: pip install tensorboard.") from None

    train_windows, eval_windows = build_data(cfg, log, rt)
    run_dir = rt.broadcast(str(make_run_dir(cfg)) if rt.is_main else None)
    run_dir = Path(run_dir)
    if rt.is_main:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    model = build_training_model(cfg, device, rt, log)
    optimizer = make_optimizer(model, cfg)
    # global batches in seeded order (one global cursor: resumable under any layout), each permuted
    # so that the data-parallel ranks get windows of balanced estimated cost
    sampler = BatchLoader(train_windows, cfg.train.batch_size, cfg.train.seed, dp=rt.dp, balance=cfg.data.balance,
                          cost=cost_coefficients(cfg.model))
    ckpt, start_step = _checkpointing(cfg, run_dir, rt, model, optimizer, sampler, log)
    if device.type == "cuda":  # the full model existed briefly before sharding; measure training from here
        torch.cuda.reset_peak_memory_stats(device)

    t = cfg.train
    flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
    peak, peak_source = device_peak(device, cfg.metrics.peak_tflops)
    layout = (f"{world} ranks: dp_replicate {rt.dims.dp_replicate} x dp_shard {rt.dims.dp_shard} x head "
              f"{rt.dims.head} x ctx {rt.dims.ctx}" + (f" (window {rt.dims.window})" if rt.dims.window else "")
              + f", {rt.dims.placement}" if world > 1 else "1 process")
    log(f"model: {cfg.model.preset} shape, {count_params(model) / 1e6:.2f}M parameters, "
        f"{device.type} {str(dtype).removeprefix('torch.')}, "
        f"memory: checkpoint={cfg.memory.checkpoint}"
        + (f" offload={cfg.memory.offload_fraction} skip_last={cfg.memory.offload_skip_last}"
           if cfg.memory.offload_fraction else "")
        + f", loss_chunk={cfg.memory.loss_chunk}, {layout}; "
        f"MFU against {peak_source}" + (f" ({peak / 1e12:.3f} TFLOP/s per device)" if peak else ""))
    log(f"run directory: {run_dir}")

    metrics_path = Path(cfg.metrics.file) if cfg.metrics.file else run_dir / "metrics.jsonl"
    writer = None
    if rt.is_main:
        writer = MetricsWriter(metrics_path, run_dir / "tensorboard" if cfg.metrics.tensorboard else None)
    fsdp_bytes = fsdp_bytes_per_step(model, cfg, rt)
    scale = grad_scale(rt.dims)
    result = TrainResult(run_dir=run_dir, first_step=start_step + 1)
    progress = _progress(t.steps, cfg.metrics.progress and rt.is_main)
    say = progress.write if progress is not None else log
    window_steps, window_start = 0, time.perf_counter()
    window_bytes = rt.comm_bytes()
    eval_time, eval_bytes = 0.0, [0.0] * len(window_bytes)
    save_blocking = 0.0  # seconds the loop waited for checkpoint saves in the current log window
    total_eval_time = 0.0
    run_start = window_start
    try:
        for step in range(start_step + 1, t.steps + 1):
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [sampler.next_batch() for _ in range(t.grad_accum)]
            valid = sum(b.valid_tokens for b in batches)  # of the global step: the same on every rank
            local_loss = 0.0
            for batch in batches:
                loss_sum = _forward_sum(model, rt.local_batch(batch).to(device), autocast_dtype)
                (loss_sum * (scale / valid)).backward()
                local_loss += float(loss_sum.detach())
            step_loss = rt.sum([local_loss])[0] / max(valid, 1)
            if not math.isfinite(step_loss):
                raise TrainingError(
                    f"the training loss is {step_loss} at step {step} (learning rate {lr:.3g}); stopping before "
                    f"the optimizer applies it. Lower train.lr, raise train.warmup_steps or set train.grad_clip."
                )
            grad_norm = clip_gradients(model, t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(step_loss)
            window_steps += 1
            if ckpt is not None and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                ckpt.save(step, model, optimizer, sampler.state_dict())
                save_blocking += ckpt.last_save_blocking_s
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{step_loss:.3f}", refresh=False)

            if step % cfg.metrics.log_interval == 0 or step == t.steps or step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start - eval_time  # evaluation is not training
                tps = window_steps * t.batch_size * t.grad_accum * t.seq_len / elapsed
                mem, mem_kind = peak_memory_bytes(device)
                now_bytes = rt.comm_bytes()
                sent = [(a - b - e) / window_steps for a, b, e in zip(now_bytes, window_bytes, eval_bytes)]
                stats = rt.max([mem, *sent])
                per_dim = {d: v for d, v in zip(TRACKED_DIMS, stats[1:]) if v}
                record = {
                    "kind": "train", "step": step, "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                    "tokens_per_s": tps, "tflops": tps * flops_per_token / 1e12,
                    "mfu": tps * flops_per_token / (world * peak) if peak else None,
                    "memory_gib": stats[0] / 2**30, "memory_kind": mem_kind + (" max over ranks" if world > 1 else ""),
                    "comm_bytes_per_step": {**per_dim, **fsdp_bytes},
                    "tokens": step * t.batch_size * t.grad_accum * t.seq_len,
                    "elapsed_s": time.perf_counter() - run_start,
                    "world": world,
                }
                if save_blocking:
                    record["checkpoint_blocking_s"] = save_blocking
                if writer is not None:
                    writer.write(record)
                say(format_line(record))
                window_steps, window_start, window_bytes = 0, time.perf_counter(), rt.comm_bytes()
                eval_time, eval_bytes, save_blocking = 0.0, [0.0] * len(window_bytes), 0.0

            if eval_windows is not None and (step % t.eval_interval == 0 or step == t.steps):
                eval_start, before = time.perf_counter(), rt.comm_bytes()
                eval_loss = evaluate(model, eval_windows, cfg, device, autocast_dtype, rt)
                result.eval_losses[step] = eval_loss
                if writer is not None:
                    writer.write({"kind": "eval", "step": step, "loss": eval_loss})
                say(f"step {step:>5} | eval loss {eval_loss:.4f}")
                eval_time += time.perf_counter() - eval_start
                total_eval_time += time.perf_counter() - eval_start
                eval_bytes = [e + a - b for e, a, b in zip(eval_bytes, rt.comm_bytes(), before)]
        if ckpt is not None:
            ckpt.wait()  # the last async save is complete and committed before the job ends
    finally:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()

    total = time.perf_counter() - run_start
    result.tokens_per_s = len(result.losses) * t.batch_size * t.grad_accum * t.seq_len / (total - total_eval_time)
    if cfg.metrics.plots and rt.is_main:
        from .report import write_plots

        write_plots(run_dir, metrics_path)
    last_eval = f", eval loss {list(result.eval_losses.values())[-1]:.4f}" if result.eval_losses else ""
    if result.losses:
        log(f"done: steps {result.first_step}-{t.steps} in {total:.1f}s, loss {result.losses[0]:.4f} -> "
            f"{result.losses[-1]:.4f}{last_eval}. Config, metrics and plots are in {run_dir}/")
    return result


def _checkpointing(cfg: Config, run_dir: Path, rt: Runtime, model, optimizer, sampler, log):
    """The checkpoint manager (None when neither saving nor resuming) and the step to continue after."""
    ck = cfg.checkpoint
    if not ck.interval and ck.resume == "none":
        return None, 0
    from .checkpoint.manager import CheckpointManager, resolve_checkpoint
    from .config import to_dict

    root = Path(ck.dir) if ck.dir else run_dir / "checkpoints"
    layout = {"world": rt.world, **{k: getattr(rt.dims, k) for k in
                                    ("dp_replicate", "dp_shard", "head", "ctx", "window", "placement")}}
    manager = CheckpointManager(root, keep=ck.keep, async_save=ck.async_save, rank=rt.rank, world=rt.world,
                                layout=layout, model_cfg=to_dict(cfg)["model"], log=log)
    path = resolve_checkpoint(ck.resume, root)
    if path is None:
        if ck.resume != "none":
            log(f"checkpoint: nothing to resume in {root}; starting at step 1")
        return manager, 0
    state = manager.load(path, model, optimizer)
    sampler.load_state_dict(state["sampler"])
    saved = state["manifest"]["layout"]
    log(f"checkpoint: resumed step {state['step']} from {path} (written by {saved['world']} ranks: "
        f"head {saved['head']} x ctx {saved['ctx']} x dp {saved['dp_replicate']}x{saved['dp_shard']}; "
        f"now {rt.world} ranks)")
    if state["step"] >= cfg.train.steps:
        log(f"checkpoint: step {state['step']} is already >= train.steps={cfg.train.steps}; nothing to train")
    return manager, int(state["step"])


def _silent(*_args, **_kwargs) -> None:
    pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, leave=False)
