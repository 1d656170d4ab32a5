"""The learning-rate schedule: linear warmup to train.lr, then a decay to lr x min_lr_ratio at the last step.

- train.lr_schedule is the decay's shape: cosine (the default), linear, 1-sqrt (1 - sqrt(progress): the
  cooldown Hägele et al. 2024 found to match a tuned cosine), or constant (train.lr after the warmup,
  no decay: the recipe of YaRN's and LongLoRA's context extension).
- train.lr_decay_fraction is the share of train.steps the decay takes, at the end of the run: 1 (the
  default) decays from the warmup's end; below 1 the learning rate holds at train.lr until the decay
  begins (warmup-stable-decay, WSD: a run can be lengthened before its decay, and a decay branched off
  any stable-phase checkpoint).

A checkpoint keeps its run's schedule settings (schedule_state); a resume whose settings give the next step
another rate than the saved run's would says so (resume_note): the schedule is recomputed over the new
settings from step 1, not stretched from the rate the run had reached, so a longer train.steps under a
decay moves the rate up at the resumed step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

DECAYS = {
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1 - progress,
    "1-sqrt": lambda progress: 1 - math.sqrt(progress),
}


def decay_start(cfg) -> int:
    """The 0-based step at which the decay starts from train.lr: the warmup's end, or later when the decay
    takes less than the whole run (it ends at train.steps - 1, at the floor, and spans
    round(lr_decay_fraction x train.steps) updates when the warmup leaves that many)."""
    t = cfg.train
    # (halves rounded up, and a hair of slack for the fraction's binary error: 0.15 x 10 is 1.4999...)
    length = max(1, math.floor(t.lr_decay_fraction * t.steps + 0.5 + 1e-9))
    return max(t.warmup_steps, t.steps - 1 - length)


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then the decay to lr * min_lr_ratio at the last step (step is 0-based: the
    trainer's step s asks for lr_at(s - 1)). The decay runs from decay_start (at lr) to step
    train.steps - 1 (at the floor, exactly), so the run's last update is made at it."""
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    start = decay_start(cfg)
    progress = min(1.0, max(0.0, (step - start) / max(1, t.steps - 1 - start)))
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * DECAYS[t.lr_schedule](progress)


def schedule_note(cfg) -> str | None:
    """What a run should hear when its warmup leaves no decay: train.warmup_steps at or past train.steps - 1
    (say the default 20 with a 10-step fine-tune) ends the run at or below the peak, never at the floor; under
    constant, a warmup at or past train.steps never reaches train.lr."""
    t = cfg.train
    if t.lr_schedule == "constant":
        if t.warmup_steps < t.steps:
            return None
        return (f"train.warmup_steps {t.warmup_steps} with train.steps {t.steps}: the learning rate rises for the "
                f"whole run (its last step at {lr_at(t.steps - 1, cfg):.3g}) and never reaches train.lr "
                f"{t.lr:g}; set --train.warmup_steps below {t.steps}")
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


def schedule_words(cfg) -> str:
    """The schedule for the setup line where it is not the default cosine over the whole run: "schedule
    constant", "schedule 1-sqrt over the last 60 steps (WSD: train.lr held to step 240)"; else "". A
    fraction whose decay would start inside the warmup is said to leave no stable phase."""
    t = cfg.train
    if t.lr_schedule == "constant":
        return "schedule constant"
    if t.lr_decay_fraction >= 1:
        return "" if t.lr_schedule == "cosine" else f"schedule {t.lr_schedule}"
    start = decay_start(cfg)
    if start == t.warmup_steps:
        return (f"schedule {t.lr_schedule} (train.lr_decay_fraction {t.lr_decay_fraction:g} leaves no stable phase "
                f"after the warmup: the decay starts at its end)")
    return (f"schedule {t.lr_schedule} over the last {t.steps - 1 - start} steps (WSD: train.lr held to step "
            f"{start + 1})")


# the train.* keys lr_at reads: what a checkpoint keeps of its run's schedule
SCHEDULE_KEYS = ("lr", "steps", "warmup_steps", "lr_schedule", "lr_decay_fraction", "min_lr_ratio")
# What the schedule was before a key existed, for a saved schedule_state without it (resume_note): that run trained
# so, whatever the resuming config says. lr_schedule and lr_decay_fraction came in d0bb0d07 (before, a cosine over
# every step after the warmup); lr, steps, warmup_steps and min_lr_ratio were there from the first commit. Every
# schedule_state saved so far holds all six (it came in 037c9ebf, after them), so this is for a state written by
# hand or by another tool, and the place a key added to SCHEDULE_KEYS later names its old behaviour (a missing key
# without one here is read from the resuming config, which can hide a change).
BEFORE_KEYS = {"lr_schedule": "cosine", "lr_decay_fraction": 1.0}


def schedule_state(cfg) -> dict:
    """The run's schedule settings, saved with each checkpoint (train/step_state.py) for resume_note."""
    return {key: getattr(cfg.train, key) for key in SCHEDULE_KEYS}


def resume_note(saved: dict | None, cfg, step: int) -> str | None:
    """What a resume from checkpoint `step` should hear when the next step's rate under this run's settings
    is not the saved run's (`saved`: its schedule_state; None, from a checkpoint written before it was kept:
    nothing to compare; a key it lacks: BEFORE_KEYS's value, the schedule the code ran before the key existed).
    A changed train.steps is listed with the config's changes, but not that it moves the rate: lr_at is
    recomputed over the new length, so a lengthened cosine run jumps up at the resume (100 -> 200 steps at
    step 50: 2.15e-3 -> 2.82e-3), as does one resumed inside a WSD decay."""
    if not saved or step >= cfg.train.steps:
        return None
    filled = {key: value for key, value in BEFORE_KEYS.items() if key not in saved}
    settings = {**schedule_state(cfg), **filled, **saved}
    was, now = lr_at(step, SimpleNamespace(train=SimpleNamespace(**settings))), lr_at(step, cfg)
    if math.isclose(was, now, rel_tol=1e-9):
        return None
    changed = ", ".join(f"train.{key} {settings[key]}{' (not saved: the schedule before the key)' * (key in filled)}"
                        f" -> {value}" for key, value in schedule_state(cfg).items()
                        if key in settings and settings[key] != value)
    moved = f"{now / was - 1:+.0%}" if was else "from 0"  # (min_lr_ratio 0 ends a decay at 0)
    return (f"learning-rate schedule: step {step + 1} trains at {now:.3g}, where the checkpoint's settings give "
            f"{was:.3g} ({moved}; {changed}): the schedule is recomputed over this run's settings from step 1, "
            f"not continued from the rate the run had reached")
