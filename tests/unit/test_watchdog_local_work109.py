"""The watchdog counted any torch.distributed frame on the main thread's stack as a wait in a collective. A rank
reading a large checkpoint back from a slow disk (DCP's filesystem reader, a rollback's "load") or running an
optimizer step over sharded parameters (DTensor's dispatch) waits for no peer, yet after parallel.timeout_s it
fired, naming the read as the collective, and the job ended. The innermost torch.distributed frame decides now:
storage I/O, local planning and DTensor's local dispatch are the rank's own work; a collective called from inside
them (DCP's plan exchange) is still a wait."""

import json
import time

import pytest

from longctx.job import watchdog
from longctx.job.watchdog import Watchdog


def _fake(path, source):
    """Functions whose frames look like torch.distributed's module `path`."""
    found = {}
    exec(compile(source, f"/x/torch/distributed/{path}", "exec"), found)
    return found


_C10D = _fake("distributed_c10d.py", "def all_gather_object(seconds, sleep):\n    sleep(seconds)\n")
_READER = _fake("checkpoint/filesystem.py", "def read_data(seconds, sleep):\n    sleep(seconds)\n")
_DISPATCH = _fake("tensor/_dispatch.py", "def dispatch(seconds, sleep):\n    sleep(seconds)\n")
# DCP's loader: around both its reads (the rank's own) and its plan exchange (a collective)
_LOADER = _fake("checkpoint/state_dict_loader.py", "def load(inner, seconds, sleep):\n    inner(seconds, sleep)\n")


def _watched(tmp_path, phase, body):
    w = Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(3, phase)
        body()
    finally:
        w.stop()
    return w


@pytest.mark.parametrize("phase,body", [
    ("load", lambda: _LOADER["load"](_READER["read_data"], 1.5, time.sleep)),
    ("optimizer", lambda: _DISPATCH["dispatch"](1.5, time.sleep)),
], ids=["a slow checkpoint read", "a long step over sharded parameters"])
def test_the_ranks_own_work_inside_torch_distributed_is_not_a_wait(tmp_path, phase, body):
    assert not _watched(tmp_path, phase, body).fired.is_set()
    assert not (tmp_path / "hang0.json").exists()


def test_a_collective_inside_the_loader_is_still_a_wait(tmp_path):
    w = _watched(tmp_path, "load", lambda: _LOADER["load"](_C10D["all_gather_object"], 1.5, time.sleep))
    assert w.fired.is_set()
    assert json.loads((tmp_path / "hang0.json").read_text())["collective"] == "all_gather_object (distributed_c10d.py)"
