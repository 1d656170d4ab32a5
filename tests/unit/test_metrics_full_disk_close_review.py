"""A metrics line a full disk refuses stops the run with the TrainingError that says how to resume, also once
the run's `finally` closes the writer: the line left in the file's buffer was flushed again at close() and its
raw OSError replaced the TrainingError."""

import os

import pytest

from longctx.errors import TrainingError
from longctx.train.metrics import MetricsWriter


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write: ENOSPC)")
def test_the_full_disk_error_survives_the_writers_close():
    writer = MetricsWriter("/dev/full")
    with pytest.raises(TrainingError, match="step 3 could not be written"):
        try:
            writer.write({"step": 3, "loss": 1.0})
        finally:
            writer.close()  # (Trainer.run's finally: RunMetrics.close)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write: ENOSPC)")
def test_the_unwritten_line_is_said_in_the_error():
    """Step N is saved before its line is written (the line carries the save's blocking time), so a resume goes
    on at N + 1 and never writes N's line: the error carries it, or metrics.jsonl lost it for good."""
    writer = MetricsWriter("/dev/full")
    with pytest.raises(TrainingError, match=r'The line not written .*: \{"step": ?3, "loss": ?1.25\}'):
        try:
            writer.write({"step": 3, "loss": 1.25})
        finally:
            writer.close()
