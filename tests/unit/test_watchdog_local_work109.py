"""The watchdog counted any torch.distributed frame on the main thread's stack as a wait in a collective. A rank
reading a large checkpoint back from a slow disk (DCP's filesystem reader, a rollback's "load") or running an
optimizer step over sharded parameters (DTensor's dispatch) waits for no peer, yet after parallel.timeout_s it
fired, naming the read as the collective, and the job ended. The innermost torch.distributed frame decides now:
storage I/O, local planning and DTensor's local dispatch are the rank's own work; a collective called from inside
them (DCP's plan exchange) is still a wait; and a storage read is timed as a save's writes are: a hang once the
process reads nothing for timeout_s."""

import json
import time

import pytest
from test_watchdog import _run

from longctx.job import watchdog


def _fake(path, source):
    """Functions whose frames look like torch.distributed's module `path`."""
    found = {}
    exec(compile(source, f"/x/torch/distributed/{path}", "exec"), found)
    return found


_C10D = _fake("distributed_c10d.py", "def all_gather_object(seconds, sleep):\n    sleep(seconds)\n")
_READER = _fake("checkpoint/filesystem.py", "def read_data(seconds, sleep):\n    sleep(seconds)\n")
# a read that goes on (a slow disk): 64 KiB every 50 ms, from a file the test writes
_READING = _fake("checkpoint/filesystem.py", (
    "def read_data(seconds, sleep, path):\n"
    "    import time\n"
    "    end = time.monotonic() + seconds\n"
    "    while time.monotonic() < end:\n"
    "        with open(path, 'rb') as f:\n"
    "            f.read()\n"
    "        sleep(0.05)\n"))
_DISPATCH = _fake("tensor/_dispatch.py", "def dispatch(seconds, sleep):\n    sleep(seconds)\n")
# DCP's loader: around both its reads (the rank's own) and its plan exchange (a collective)
_LOADER = _fake("checkpoint/state_dict_loader.py", "def load(inner, seconds, sleep):\n    inner(seconds, sleep)\n")


def _watched(tmp_path, phase, body):
    """test_watchdog._run (rank 0, timeout 0.5 s) with the rank in `phase` of step 3."""
    def in_phase():
        watchdog.phase(3, phase)
        body()
    return _run(tmp_path, 0, in_phase)


@pytest.mark.parametrize("case", ["a slow checkpoint read", "a long step over sharded parameters"])
def test_the_ranks_own_work_inside_torch_distributed_is_not_a_wait(tmp_path, case):
    data = tmp_path / "shard.distcp"
    data.write_bytes(bytes(64 << 10))
    phase, body = {
        "a slow checkpoint read": ("load", lambda: _LOADER["load"](
            lambda seconds, sleep: _READING["read_data"](seconds, sleep, data), 1.5, time.sleep)),
        "a long step over sharded parameters": ("optimizer", lambda: _DISPATCH["dispatch"](1.5, time.sleep)),
    }[case]
    assert not _watched(tmp_path, phase, body).fired.is_set()
    assert not (tmp_path / "hang0.json").exists()


def test_a_checkpoint_read_that_reads_nothing_is_a_hang(tmp_path):
    """The read stalled on every rank (a shared file system gone during a rollback's load): no collective's timeout
    ends it, so the watchdog does, saying where; a rank stuck there is named hung."""
    w = _watched(tmp_path, "load", lambda: _LOADER["load"](_READER["read_data"], 2.0, time.sleep))
    assert w.fired.is_set()
    record = json.loads((tmp_path / "hang0.json").read_text())
    assert record["collective"] is None and record["io"] == "read_data (filesystem.py)"
    assert "in a checkpoint's I/O, read_data (filesystem.py), reading nothing" in watchdog.describe(record)


def test_a_collective_inside_the_loader_is_still_a_wait(tmp_path):
    w = _watched(tmp_path, "load", lambda: _LOADER["load"](_C10D["all_gather_object"], 1.5, time.sleep))
    assert w.fired.is_set()
    assert json.loads((tmp_path / "hang0.json").read_text())["collective"] == "all_gather_object (distributed_c10d.py)"
