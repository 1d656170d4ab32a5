"""`longctx report` on a metrics file that two runs wrote at once (the same --metrics.file, other run directories:
only the directories are locked): the steps start again at every other line, and the note named every restart,
tens of kilobytes for a run of a few thousand steps. It names the first few and counts the rest."""

from pathlib import Path

from longctx.train.metric_runs import RESTARTS_NAMED
from longctx.train.metric_runs import continued as _continued


def test_the_restart_note_stays_short_when_two_runs_interleave():
    records = [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 2001) for _ in (0, 1)]
    said = []
    kept = _continued(records, Path("m.jsonl"), said.append)
    assert [r["step"] for r in kept] == list(range(1, 2001))
    assert len(said) == 1 and len(said[0]) < 500, len(said[0])
    assert "at step 1 after step 1" in said[0] and f"and {2000 - RESTARTS_NAMED:,} more times" in said[0]


def test_one_restart_is_named_alone():
    records = [{"kind": "train", "step": s} for s in (1, 2, 3, 1, 2)]
    said = []
    _continued(records, Path("m.jsonl"), said.append)
    assert "start again at step 1 after step 3 (" in said[0] and "more" not in said[0]


def test_two_interleaved_runs_are_cut_in_one_pass():
    """Each restart cut the records kept so far anew: quadratic in the file (8.5 s at 20,000 interleaved steps on
    the review machine; ~35 s at 40,000). One pass now (~0.07 s at 40,000)."""
    import time

    records = [{"kind": "train", "step": s} for s in range(1, 40001) for _ in (0, 1)]
    start = time.perf_counter()
    kept = _continued(records, Path("m.jsonl"), lambda _: None)
    assert time.perf_counter() - start < 5.0
    assert len(kept) == 40000
