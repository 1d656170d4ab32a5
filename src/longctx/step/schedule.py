"""The learning-rate schedule: linear warmup to train.lr, then cosine decay to lr x min_lr_ratio."""

from __future__ import annotations

import math


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step (step is 0-based:
    the trainer's step s asks for lr_at(s - 1)). The decay runs from the first step after the warmup
    (at lr) to step train.steps - 1 (at the floor, exactly), so the run's last update is made at it."""
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))
