"""job/spawn.py: a rank's result is read whole by the caller, even after the rank has exited.

The queue's own pickler hands a tensor over as a shared-memory file descriptor that the caller
fetches from the rank while reading the result: once the rank had exited (the caller read late, on a
loaded machine) the read failed with ConnectionResetError / FileNotFoundError, now and then in tests
whose ranks return tensors. Here the caller reads only after the rank has exited, every time."""

import pickle

import pytest
import torch

from longctx.job import spawn


def _tensors():
    return {"weights": torch.arange(12.0).view(3, 4), "ids": [torch.tensor([7, 8, 9])]}


def _not_picklable():
    return lambda: None


def _after_exit(fn):
    """(out, problem): fn's result, read by the caller only once its one rank has exited."""
    ctx = spawn._context()
    results, store = ctx.Queue(), spawn._job_store()
    proc = ctx.Process(target=spawn._entry, daemon=True,
                       args=(spawn._CallerState(), 0, 1, store.port, fn, (), results, 1))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0, f"the rank did not exit cleanly ({proc.exitcode})"
    out = {}
    spawn._collect(results, [proc], out, timeout=30)
    return out[0]


def test_tensors_are_read_after_the_rank_has_exited():
    got = _after_exit(_tensors)
    assert torch.equal(got["weights"], torch.arange(12.0).view(3, 4))
    assert torch.equal(got["ids"][0], torch.tensor([7, 8, 9]))


def test_an_unpicklable_result_is_the_ranks_error():
    with pytest.raises(RuntimeError, match="rank 0 of 1 failed") as err:
        _after_exit(_not_picklable)
    assert "pickl" in str(err.value).lower() or isinstance(err.value.__cause__, pickle.PicklingError)


def test_run_spawned_returns_tensors_by_rank():
    assert [r["weights"].sum().item() for r in spawn.run_spawned(2, _tensors)] == [66.0, 66.0]
