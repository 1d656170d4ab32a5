"""LONGCTX_FAULT (faults.py) is read before a run: a spelling it cannot inject is refused, never a fault that
silently does not fire (steps and saves count from 1, so `@0` would never happen)."""

import pytest

from longctx import faults
from longctx.errors import ConfigError


@pytest.mark.parametrize("spec", ["nonfinite@0", "enospc@0", "hang@1:0", "spike@x", "bogus@3", "hang@2"])
def test_a_fault_that_cannot_fire_is_refused(monkeypatch, spec):
    monkeypatch.setenv(faults.ENV, spec)
    with pytest.raises(ConfigError, match="counted from 1"):
        faults.planned("nonfinite")


def test_faults_are_read_per_kind_and_rank(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nonfinite@5, spike@7,hang@1:3,enospc@2")
    assert faults.planned("nonfinite") == {5} and faults.planned("spike") == {7}
    assert faults.planned("hang", rank=1) == {3} and faults.planned("hang", rank=0) == set()
    assert faults.planned("enospc") == {2}


def test_a_hang_of_a_rank_the_job_does_not_have_is_refused(monkeypatch):
    """hang@2:3 in a 2-rank job never fired and said nothing: the hang test that planted it passed for nothing."""
    monkeypatch.setenv(faults.ENV, "hang@2:3")
    with pytest.raises(ConfigError, match="names rank 2, but the job has ranks 0-1"):
        faults.planned("hang", rank=0, world=2)
    assert faults.planned("hang", rank=2, world=3) == {3}
