"""Each stage of a build timed, its record kept for the manifest and said in one log line.

A stage runs as a progress phase (progress.py): one that takes long is said while it runs, with
the count its code keeps in `progress.current()` (documents, MB, tokens, iterations).

A stage's record holds its counts, `seconds` and `mb_per_s` (MB of raw input text per second). A
figure that does not exist is None in the record and is said in words in the log line (the
stage's reason under MISSING), never printed as "None".
"""

from __future__ import annotations

import time

from ...progress import phase

MISSING = "_missing"  # a stage record's key for why some of its figures are None (see timed)


def timed(records: dict, name: str, raw_bytes: int | None, log, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` returns (result, record): the record, timed, goes to `records[name]`
    and the log; the result is returned. `raw_bytes` None: the stage's own count of them (its record's `mb`;
    the scan's, which knows the input's bytes only once it has read them)."""
    t0 = time.perf_counter()
    with phase(name, done_line=False):  # (its time is said below)
        result, rec = fn(*args, **kwargs)
    dt = time.perf_counter() - t0
    rec = dict(rec)
    # why a figure is missing ({key: words}): for the log line only; the record keeps the null
    missing = rec.pop(MISSING, {})
    rec["seconds"] = round(dt, 3)
    if raw_bytes is None:
        raw_bytes = round((rec.get("mb") or 0) * 1e6)
    rec["mb_per_s"] = round(raw_bytes / 1e6 / dt, 2) if dt > 0 and raw_bytes else None
    records[name] = rec
    # a figure that does not exist (None) is said in words, or left out: never printed as "None"
    counts = ", ".join(f"{k} {v}" if v is not None else f"{k} n/a ({missing[k]})"
                       for k, v in rec.items()
                       if k not in ("seconds", "mb_per_s") and (v is not None or k in missing))
    log(f"  {name:<9} {dt:6.2f}s" + (f"  {rec['mb_per_s']:8.1f} MB/s" if rec["mb_per_s"] else "")
        + (f"  {counts}" if counts else ""))
    return result
