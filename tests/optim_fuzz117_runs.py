"""Runs of longctx's trainer for tests/unit/test_optim_fuzz117.py, recorded step by step: a tiny model trained in
this process by Trainer(cfg).run(), with train/step_run.py's three calls around the update wrapped (nothing else
of the trainer changed) to keep, each step, the micro-batches, the weights before the update, the summed raw
gradients (before clipping: the model's, or the host optimizer's host copies), the rate the optimizer stepped with,
and the weights and AdamW state after the update; the metrics file gives the logged lr, loss and norm, and the log
its lines (a resume's note)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

from longctx.config import load_config
from longctx.job.launch import end_one_rank_group
from longctx.train import step_run
from longctx.train.trainer import Trainer

BASE = ["--model.layers=1", "--model.dim=16", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=32",
        "--train.seq_len=32", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
        "--metrics.progress=false", "--train.device=cpu", "--metrics.log_interval=1"]


@dataclass
class Step:
    micros: list = field(default_factory=list)
    before: dict = field(default_factory=dict)  # weights before the update, by name
    grads: dict = field(default_factory=dict)  # summed raw gradients, before clipping
    lr: float = float("nan")  # the optimizer's rate at the update
    after: dict = field(default_factory=dict)  # weights after the update
    state: dict = field(default_factory=dict)  # name -> (exp_avg, exp_avg_sq, step)
    applied: bool = True  # the guard's decision


@dataclass
class Run:
    cfg: object
    steps: dict  # 1-based step -> Step
    logged: dict  # 1-based step -> metrics record
    lines: list
    groups: list  # the optimizer's groups: (weight_decay, [parameter names])
    fault: int | None = None  # the step made non-finite


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _weights(model) -> dict:
    return {n: _local(p.detach()).double().clone() for n, p in model.named_parameters()}


def _raw_gradients(model, optimizer) -> dict:
    if hasattr(optimizer, "host_gradients"):  # (memory.model_states = host_optimizer: the host copies)
        optimizer.host_gradients()
        by_param = {id(p): m.grad for p, m in zip(optimizer.params, optimizer.masters)}
    else:
        by_param = {id(p): p.grad for p in model.parameters()}
    return {n: torch.zeros(p.shape, dtype=torch.float64) if by_param[id(p)] is None
            else _local(by_param[id(p)]).double().clone() for n, p in model.named_parameters()}


def _state(model, optimizer) -> dict:
    out = {}
    for n, p in model.named_parameters():
        s = optimizer.state.get(p) or {}
        if s:
            out[n] = (_local(s["exp_avg"]).double().clone(), _local(s["exp_avg_sq"]).double().clone(),
                      float(s["step"]))
    return out


@contextlib.contextmanager
def recording(steps: dict):
    """step_run's forward_backward, clip_step_gradients and guarded_step wrapped to fill `steps`."""
    real_fb, real_clip, real_step = step_run.forward_backward, step_run.clip_step_gradients, step_run.guarded_step
    now = {}

    def forward_backward(trainer, step, micro, valid):
        now["step"] = steps[step] = Step(micros=[m for m in micro])
        now["model"] = trainer.model
        return real_fb(trainer, step, micro, valid)

    def clip(model, optimizer, max_norm):
        rec = now["step"]
        rec.before, rec.grads = _weights(model), _raw_gradients(model, optimizer)
        return real_clip(model, optimizer, max_norm)

    def guarded(optimizer, finite):
        real_step(optimizer, finite)
        if hasattr(optimizer, "finish_update"):
            optimizer.finish_update()
        rec = now["step"]
        rec.lr = optimizer.param_groups[0]["lr"]
        rec.applied = bool(finite)
        rec.after, rec.state = _weights(now["model"]), _state(now["model"], optimizer)

    with mock.patch.object(step_run, "forward_backward", forward_backward), \
            mock.patch.object(step_run, "clip_step_gradients", clip), \
            mock.patch.object(step_run, "guarded_step", guarded):
        yield


def case_flags(case: dict) -> list[str]:
    """The command-line overrides of a drawn case (its train.* and model.* keys)."""
    keys = ("steps", "lr", "warmup_steps", "lr_schedule", "lr_decay_fraction", "min_lr_ratio", "weight_decay",
            "beta1", "beta2", "eps", "grad_clip", "grad_accum", "global_batch", "loss_weighting", "seed")
    flags = [f"--train.{k}={case[k]}" for k in keys if k in case]
    flags += [f"--model.tie_embeddings={str(case.get('tied', False)).lower()}"]
    if case.get("bias"):
        flags += ["--model.qkv_bias=true", "--model.out_bias=true"]
    return [*flags, f"--memory.model_states={case.get('states', 'device')}",
            f"--memory.grad_sync={case.get('grad_sync', 'step')}"]


def train_recorded(run_dir: Path, flags: list[str], fault: int | None = None) -> Run:
    """Train a run of BASE + flags in `run_dir`, recorded; `fault`: a step made non-finite (LONGCTX_FAULT)."""
    cfg = load_config(None, [*BASE, f"--train.run_dir={run_dir}", *flags])
    steps, lines = {}, []
    env = {"LONGCTX_FAULT": f"nonfinite@{fault}"} if fault else {}
    with recording(steps), mock.patch.dict("os.environ", env):
        try:  # (memory.model_states = host makes a one-rank group, which train() would end)
            trainer = Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
            names = {id(p): n for n, p in trainer.model.named_parameters()}
            groups = [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in trainer.optimizer.param_groups]
            trainer.run()
        finally:
            end_one_rank_group()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if r.get("kind", "train") == "train" and r["step"] in steps}
    return Run(cfg, steps, logged, lines, groups, fault)
