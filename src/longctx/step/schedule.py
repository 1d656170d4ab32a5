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


def schedule_note(cfg) -> str | None:
    """What a run should hear when its warmup leaves no decay: train.warmup_steps at or past train.steps - 1
    (say the default 20 with a 10-step fine-tune) ends the run at or below the peak, never at the floor."""
    t = cfg.train
    if t.steps <= 1 or t.warmup_steps < t.steps - 1:
        return None
    top = lr_at(t.steps - 1, cfg)
    # (two steps have no room for both: "below 1" would be no warmup at all)
    fix = (f"set --train.warmup_steps below {t.steps - 1} for a warmup and a decay" if t.steps > 2
           else "set --train.warmup_steps 0 for a decay")
    return (f"train.warmup_steps {t.warmup_steps} with train.steps {t.steps}: the learning rate "
            + ("rises for the whole run (its last step at " if t.warmup_steps >= t.steps else "reaches ")
            + f"{top:.3g}{')' if t.warmup_steps >= t.steps else ' at the last step'} and never decays to the floor "
            f"(train.min_lr_ratio); {fix}")
