"""Found by the README tour of 2026-12-06 (benchmarks/readme_tour.py, docs/eval.md's `longctx eval ... --mode
generate`): a heartbeat line said a count just short of whole as '8.0/25 sequences' between '6/25' and '9/25'.
A count in a small total is said with one decimal only when that decimal is not zero; otherwise whole."""

import time

import pytest

from longctx.progress import Phase


def _line(done: float, total: float) -> str:
    phase = Phase("eval passkey", total=total, unit="sequences")
    phase.done = done
    return phase.describe(time.monotonic())


@pytest.mark.parametrize("done,shown", [(7.99999, "8/25"), (7.96, "8/25"), (23.04, "23/25"), (1.0, "1/25")])
def test_a_count_that_rounds_to_whole_is_said_whole(done, shown):
    assert f": {shown} sequences" in _line(done, 25)


@pytest.mark.parametrize("done,shown", [(16.9, "16.9/25"), (0.4, "0.4/2"), (1.5, "1.5/2")])
def test_a_part_of_one_is_still_said_in_a_small_total(done, shown):
    total = float(shown.split("/")[1])
    assert f": {shown} sequences" in _line(done, total)


def test_a_large_total_is_said_whole():
    assert ": 1,235/2,000 sequences" in _line(1234.6, 2000)


@pytest.mark.slow  # (a tokenizer trained and a small Qwen3 saved, twice: ~7 s of CPU, a minute on a loaded VM)
def test_the_tour_prepares_a_kept_directory_toured_before(tmp_path):
    """`readme_tour.py --keep DIR` run again on DIR (one page at a time, --only) crashed in prepare()
    (FileExistsError on DIR/configs) before any command ran."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import readme_tour

    first = readme_tour.prepare(tmp_path)
    assert readme_tour.prepare(tmp_path) == first
    assert (tmp_path / "Qwen3-0.6B" / "config.json").is_file() and (tmp_path / "configs" / "debug.toml").is_file()
