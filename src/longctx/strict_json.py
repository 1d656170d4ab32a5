"""JSON that every parser reads: a non-finite float (a NaN loss, an infinite perplexity) is written as null.

Python's json module writes NaN and Infinity by default, which JSON does not have: jq, JavaScript,
Go, Rust's serde and many dashboards then refuse the whole file, and a run's metrics become unreadable
at the step that went wrong, when they are wanted most. Every record longctx writes for other tools
(metrics.jsonl, the JSON of eval, generate, plan and the benchmarks) goes through dumps(); a reader
that plots a value takes null as "no number" (a gap), and the record's own fields say why (a
skipped step's `skipped_steps`, an evaluation with no labelled token).
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """json.dumps of finite(obj), refusing (ValueError) anything that would still be written as NaN."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def number(value: Any) -> float:
    """A value read back for plotting or arithmetic: null (written for a non-finite float) as NaN."""
    return math.nan if value is None else float(value)
