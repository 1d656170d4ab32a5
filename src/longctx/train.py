"""The training loop: data -> model -> optimizer -> steps with metrics and evaluation -> plots.

One optimizer step = `train.grad_accum` micro-batches of `train.batch_size` windows. The loss of
a step is the mean over every valid (non-ignored) label token of the step, so micro-batches with
different numbers of valid tokens are weighted exactly as one large batch would be.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from .config import Config, check_supported, to_toml
from .data.corpus import read_documents
from .data.tokenizer import load_tokenizer
from .data.windows import Batch, TokenWindows, WindowSampler, split_documents
from .errors import ConfigError, DataError, TrainingError
from .memory.recompute import apply_recompute
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
    losses: list[float] = field(default_factory=list)  # one per optimizer step
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


def build_data(cfg: Config, log=print):
    """Tokenised train and eval windows for the configured corpus."""
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tok.vocab_size}."
        )
    t0 = time.perf_counter()
    docs = read_documents(cfg.data.corpus, cfg.data.max_docs)
    train_docs, eval_docs = split_documents(docs, cfg.data.eval_fraction)
    seq = cfg.train.seq_len
    train = TokenWindows(tok.encode_batch([d.text for d in train_docs]), tok.eos_id, seq, cfg.data.doc_mask)
    evals = None
    if eval_docs and cfg.train.eval_interval:
        try:
            evals = TokenWindows(tok.encode_batch([d.text for d in eval_docs]), tok.eos_id, seq, cfg.data.doc_mask)
        except DataError:
            raise DataError(
                f"the eval split ({len(eval_docs)} documents) is shorter than one window of {seq} tokens; "
                f"raise data.eval_fraction or set train.eval_interval=0."
            ) from None
    log(f"data: {cfg.data.corpus} -> {len(train_docs)} train / {len(eval_docs)} eval documents, "
        f"{train.num_tokens:,} train tokens in {len(train):,} windows of {seq} "
        f"({tok.name} tokenizer, {time.perf_counter() - t0:.1f}s)")
    return tok, train, evals


def build_training_model(cfg: Config, device: torch.device) -> Llama:
    if cfg.model.init_from:
        from .models.hf import config_from_hf, load_hf  # noqa: F401

        model = load_hf(cfg.model.init_from.removeprefix("hf:"), dtype=torch.float32, device=device)
    else:
        model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    apply_recompute(model.layers, cfg.memory.checkpoint)
    return model


def _forward_sum(model: Llama, batch: Batch, autocast_dtype):
    with torch.autocast(device_type=batch.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="sum")


@torch.no_grad()
def evaluate(model: Llama, windows: TokenWindows, cfg: Config, device, autocast_dtype) -> float:
    """Mean loss over the first eval_batches x batch_size eval windows (a fixed set, so evals compare)."""
    model.eval()
    total, count = 0.0, 0
    n = min(len(windows), cfg.train.eval_batches * cfg.train.batch_size)
    for start in range(0, n, cfg.train.batch_size):
        batch = windows.batch(range(start, min(n, start + cfg.train.batch_size))).to(device)
        total += float(_forward_sum(model, batch, autocast_dtype))
        count += batch.valid_tokens
    model.train()
    return total / max(count, 1)


def train(cfg: Config, log=print) -> TrainResult:
    check_supported(cfg)
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.train.dtype, device)
    autocast_dtype = dtype if dtype != torch.float32 else None
    seed_everything(cfg.train.seed)
    if cfg.metrics.tensorboard:
        try:
            importlib.import_module("tensorboard")
        except ImportError:
            raise ConfigError("metrics.tensorboard=true needs the tensorboard package: pip install tensorboard.") from None

    tok, train_windows, eval_windows = build_data(cfg, log)
    run_dir = make_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    model = build_training_model(cfg, device)
    optimizer = make_optimizer(model, cfg)
    sampler = WindowSampler(len(train_windows), cfg.train.seed)

    t = cfg.train
    flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
    peak, peak_source = device_peak(device, cfg.metrics.peak_tflops)
    log(f"model: {cfg.model.preset} shape, {count_params(model) / 1e6:.2f}M parameters, "
        f"{device.type} {str(dtype).removeprefix('torch.')}, recompute={cfg.memory.checkpoint}; "
        f"MFU against {peak_source}" + (f" ({peak / 1e12:.3f} TFLOP/s)" if peak else ""))
    log(f"run directory: {run_dir}")

    metrics_path = Path(cfg.metrics.file) if cfg.metrics.file else run_dir / "metrics.jsonl"
    writer = MetricsWriter(metrics_path, run_dir / "tensorboard" if cfg.metrics.tensorboard else None)
    result = TrainResult(run_dir=run_dir)
    progress = _progress(t.steps, cfg.metrics.progress)
    say = progress.write if progress is not None else log
    window_tokens = 0
    window_start = time.perf_counter()
    run_start = window_start
    try:
        for step in range(1, t.steps + 1):
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [train_windows.batch(sampler.next_indices(t.batch_size)) for _ in range(t.grad_accum)]
            valid = sum(b.valid_tokens for b in batches)
            step_loss = 0.0
            for batch in batches:
                loss_sum = _forward_sum(model, batch.to(device), autocast_dtype)
                (loss_sum / valid).backward()
                step_loss += float(loss_sum.detach())
            step_loss /= max(valid, 1)
            if not math.isfinite(step_loss):
                raise TrainingError(
                    f"the training loss is {step_loss} at step {step} (learning rate {lr:.3g}); stopping before "
                    f"the optimizer applies it. Lower train.lr, raise train.warmup_steps or set train.grad_clip."
                )
            max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(step_loss)
            window_tokens += t.batch_size * t.grad_accum * t.seq_len
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{step_loss:.3f}", refresh=False)

            if step % cfg.metrics.log_interval == 0 or step == t.steps or step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                tps = window_tokens / elapsed
                mem, mem_kind = peak_memory_bytes(device)
                record = {
                    "kind": "train", "step": step, "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                    "tokens_per_s": tps, "tflops": tps * flops_per_token / 1e12,
                    "mfu": tps * flops_per_token / peak if peak else None,
                    "memory_gib": mem / 2**30, "memory_kind": mem_kind,
                    "tokens": step * t.batch_size * t.grad_accum * t.seq_len,
                    "elapsed_s": time.perf_counter() - run_start,
                }
                writer.write(record)
                say(format_line(record))
                window_tokens, window_start = 0, time.perf_counter()

            if eval_windows is not None and (step % t.eval_interval == 0 or step == t.steps):
                eval_loss = evaluate(model, eval_windows, cfg, device, autocast_dtype)
                result.eval_losses[step] = eval_loss
                writer.write({"kind": "eval", "step": step, "loss": eval_loss})
                say(f"step {step:>5} | eval loss {eval_loss:.4f}")
                window_start = time.perf_counter()  # keep evaluation out of the throughput figures
    finally:
        if progress is not None:
            progress.close()
        writer.close()

    total = time.perf_counter() - run_start
    result.tokens_per_s = t.steps * t.batch_size * t.grad_accum * t.seq_len / total
    if cfg.metrics.plots:
        from .report import write_plots

        write_plots(run_dir, metrics_path)
    last_eval = f", eval loss {list(result.eval_losses.values())[-1]:.4f}" if result.eval_losses else ""
    log(f"done: {t.steps} steps in {total:.1f}s, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}{last_eval}. "
        f"Config, metrics and plots are in {run_dir}/")
    return result


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, leave=False)
