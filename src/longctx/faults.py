"""Fault injection for tests, read in one place: LONGCTX_FAULT (inert when unset).

A testing aid, documented in docs/running.md, that makes the guards of a long run show they work:
- `nonfinite@5`: step 5's loss is NaN on every rank (its gradients follow): train.on_nonfinite;
- `spike@12`: step 12's loss (and gradients) are 1000 times what they were: train.spike_factor;
- `hang@1:3`: rank 1 stops making progress in step 3's forward, as a rank stuck in I/O or a dead
  NIC would (a Python sleep, so its stack shows where): the hang watchdog (job/watchdog.py);
- `enospc@2`: the run's second checkpoint save fails as a full disk would: checkpoint.on_save_error.
Several faults are separated by commas. Each fires once per process: a step run again after a
rollback is not hit again. Nothing in longctx reads the variable elsewhere; the step faults are
injected by train/fault_injection.py (a wrapper around the Trainer's step), enospc by
checkpoint/manager.py.
"""

from __future__ import annotations

import os
import re
import time

from .errors import ConfigError

ENV = "LONGCTX_FAULT"
KINDS = ("nonfinite", "spike", "hang", "enospc")
SPIKE_MULTIPLIER = 1000.0
_DIGITS = re.compile("[0-9]+")


def _items() -> list[tuple[str, str]]:
    out = []
    for item in (x.strip() for x in os.environ.get(ENV, "").split(",")):
        if not item:
            continue
        name, _, where = item.partition("@")
        rank, _, step = where.partition(":") if name == "hang" else ("", "", where)
        # (steps and saves count from 1: a fault @0 would be accepted and never fire)
        # ([0-9]+, not isdigit: '²' is a digit to isdigit and int()'s raw ValueError)
        if (name not in KINDS or not _DIGITS.fullmatch(step) or not int(step)
                or (name == "hang" and not _DIGITS.fullmatch(rank))):
            raise ConfigError(f"{ENV}={os.environ[ENV]!r}: '{item}' is not a fault this version injects; write "
                              f"KIND@STEP with KIND one of nonfinite, spike, enospc (the save's number for enospc), "
                              f"or hang@RANK:STEP, STEP counted from 1 (a testing aid; unset it to train).")
        out.append((name, where))
    return out


def check() -> None:
    """LONGCTX_FAULT parsed, its faults refused as `planned` would refuse them (cli.py's _check_environment: before
    any command's work, not at the Trainer's set-up or the first save)."""
    _items()


def planned(kind: str, rank: int = 0, world: int | None = None) -> set[int]:
    """The steps (for enospc: the saves, counted from 1) at which `kind` is injected (on this rank,
    for hang): empty unless LONGCTX_FAULT names it. Given the job's `world`, a hang of a rank it does
    not have is refused (it would never fire, and the test that planted it would pass for nothing)."""
    steps = set()
    for name, where in _items():
        if name != kind:
            continue
        if kind == "hang":
            hung_rank, _, where = where.partition(":")
            if world is not None and int(hung_rank) >= world:
                raise ConfigError(f"{ENV}={os.environ[ENV]!r}: hang@{hung_rank}:{where} names rank {hung_rank}, but "
                                  f"the job has ranks 0-{world - 1}; name one of them (a testing aid; unset it to "
                                  f"train).")
            if int(hung_rank) != rank:
                continue
        steps.add(int(where))
    return steps


def hang_forever() -> None:
    """What `hang@RANK:STEP` does on its rank: wait, in Python, until something kills the process."""
    while True:
        time.sleep(1.0)
