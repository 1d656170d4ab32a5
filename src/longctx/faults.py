"""Fault injection for tests, read in one place: LONGCTX_FAULT (inert when unset).

A testing aid, documented in docs/running.md: `LONGCTX_FAULT=nonfinite@5` makes step 5's loss NaN
on every rank (its gradients follow), so the non-finite guard (train.on_nonfinite) can be shown to
work; `enospc@2` fails the run's second checkpoint save as a full disk would (checkpoint.
on_save_error). Several faults are separated by commas. Nothing in longctx reads the variable
elsewhere.
"""

from __future__ import annotations

import os

from .errors import ConfigError

ENV = "LONGCTX_FAULT"
KINDS = ("nonfinite", "enospc")


def planned(kind: str) -> set[int]:
    """The steps (for enospc: the saves, counted from 1) at which `kind` is injected (empty unless
    LONGCTX_FAULT names it)."""
    steps = set()
    for item in (x.strip() for x in os.environ.get(ENV, "").split(",")):
        if not item:
            continue
        name, _, where = item.partition("@")
        if name not in KINDS or not where.isdigit():
            raise ConfigError(f"{ENV}={os.environ[ENV]!r}: '{item}' is not a fault this version injects; write "
                              f"KIND@STEP with KIND one of {', '.join(KINDS)} (a testing aid; unset it to train).")
        if name == kind:
            steps.add(int(where))
    return steps
