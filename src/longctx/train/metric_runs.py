"""The runs in one metrics file, as `longctx report` reads them: split by `run_id` (run_identity.py), then each
run's records as its last attempt continued it (continued).

Two runs given one metrics.file (other run directories: only the directories are locked) write into it at once or
one after the other; without an id their steps read as one run that started again at every other line. A file of
an older longctx (no ids) is one run, read as before; its records without an id before the first that has one are
that run's (a run an older longctx started and this one resumed, with a new id: run_identity.py)."""

from __future__ import annotations

from pathlib import Path

RESTARTS_NAMED = 3  # restarts of a metrics file's steps the note names at most


def split_runs(records: list[dict]) -> list[tuple[str | None, list[dict]]]:
    """[(run_id, its records in file order)], in the order each run's last record comes (the run written last
    last); [(None, records)] for a file without ids. A record without an id joins the first run that has one."""
    first = next((r["run_id"] for r in records if r.get("run_id")), None)
    runs: dict = {}
    last: dict = {}  # each run's last record's index
    for i, r in enumerate(records):
        run = r.get("run_id") or first
        runs.setdefault(run, []).append(r)
        last[run] = i
    return sorted(runs.items(), key=lambda item: last[item[0]])


def continued(records: list[dict], path: Path, say) -> list[dict]:
    """The records of the run as the file's last attempt continued it: a training step at or before one already
    logged starts again (a second run given the same metrics.file, or a resume by a longctx that left the
    abandoned attempt's records in place; today's moves them aside), and replaces every record from that step on,
    so the plots show one run, not the newest record of each step from two."""
    last, restarts, starts = 0, [], set()
    for i, r in enumerate(records):
        if r.get("kind", "train") == "train":
            if r["step"] <= last:
                restarts.append(f"at step {r['step']} after step {last}")
                starts.add(i)
            last = r["step"]
    # a record is replaced by a later restart at or before its step: one pass from the end with the lowest such
    # step (cutting the records kept so far at each restart went over them all each time: two runs writing one
    # file at once restart at every line, 8.5 s for 20,000 steps, minutes for 100,000)
    kept, floor = [], float("inf")
    for i in range(len(records) - 1, -1, -1):
        if records[i]["step"] < floor:
            kept.append(records[i])
        if i in starts:
            floor = min(floor, records[i]["step"])
    kept.reverse()
    if restarts:  # (two runs writing the file at once restart at every line: the first few said, and a count)
        more = len(restarts) - RESTARTS_NAMED
        said = ", ".join(restarts[:RESTARTS_NAMED]) + (f" and {more:,} more times" if more > 0 else "")
        say(f"note: {path}: its training records start again {said} (a second run given the same "
            f"metrics.file, or a resume by an older longctx): the plots show the records written last from there on")
    return kept
