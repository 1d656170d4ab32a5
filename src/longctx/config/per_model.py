"""`per_model`: remember what a function makes of one model config (and further arguments) while that config lives.

A config is never changed once built (config/load.py), so what is computed from one object stays right for it: the
planner asks the same counts of one model for each of its tens of thousands of candidates (costs/), and a resumed
run's model as its remaining steps count it (memory/peak_routing.py from_step) is one object per config and step.
Here, on the config's floor, so that memory/ and costs/ (floors 6 and 7) share the one implementation."""

from __future__ import annotations

import functools
import weakref


def per_model(fn):
    """Remember fn(m, *args) per model config object `m` and `args`: the entry is dropped when its config is
    (a weak reference; an id reused by a later object is told apart by that reference)."""
    memo: dict[tuple, tuple] = {}

    @functools.wraps(fn)
    def cached(m, *args):
        key = (id(m), args)
        hit = memo.get(key)
        if hit is None or hit[0]() is not m:
            ref = weakref.ref(m, lambda _, key=key: memo.pop(key, None))
            hit = memo[key] = (ref, fn(m, *args))
        return hit[1]

    return cached
