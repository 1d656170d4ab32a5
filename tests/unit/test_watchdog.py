"""The hang watchdog's parts on one process: it fires when the main thread has waited in a collective
(a frame of torch/distributed) or in a save for timeout_s without progress, not while phases or
collectives go on and not for long computation; a rank that sees a peer's record records where it
is itself; the launcher's report names the hung ranks: those not waiting in a collective, or
frozen (heartbeat stopped), not those that waited or left with their peers."""

import json
import time

import pytest

from longctx.job import watchdog
from longctx.job.watchdog import Watchdog, hang_report

# a function whose frame looks like one of torch.distributed's (a rank waiting in a collective)
_FAKE = {}
exec(compile("def all_reduce(seconds, sleep, done=None):\n"
             "    if done is None:\n"
             "        return sleep(seconds)\n"
             "    for _ in range(int(seconds / 0.05)):\n"
             "        if done():\n"
             "            return\n"
             "        sleep(0.05)\n", "/x/torch/distributed/distributed_c10d.py", "exec"), _FAKE)


def _stuck_here(seconds):
    time.sleep(seconds)


def _run(tmp_path, rank, body, timeout=0.5):
    w = Watchdog(timeout, rank=rank, folder=tmp_path, exit_process=False).start()
    try:
        body()
    finally:
        w.stop()
    return w


def test_it_fires_after_a_wait_in_a_collective_with_where_the_rank_was(tmp_path):
    def body():
        watchdog.phase(7, "backward")
        # in the collective until the watchdog wrote its stack and record (at most 30 s): a fixed 2 s could end
        # first on a loaded machine, and the stack was then dumped after the rank had left all_reduce
        _FAKE["all_reduce"](30.0, time.sleep, (tmp_path / "hang3.json").exists)

    assert _run(tmp_path, 3, body).fired.is_set()
    record = json.loads((tmp_path / "hang3.json").read_text())
    assert (record["rank"], record["step"], record["phase"]) == (3, 7, "backward")
    assert record["collective"] == "all_reduce (distributed_c10d.py)" and "in body" in record["where"]
    assert 0.5 <= record["idle_s"] < 2.0
    assert "in all_reduce" in (tmp_path / "stack3.txt").read_text()
    assert json.loads((tmp_path / "beat3.json").read_text())["step"] == 7


def test_a_stuck_save_fires_too(tmp_path):
    def body():
        watchdog.phase(4, "save")
        _stuck_here(2.0)

    assert _run(tmp_path, 0, body).fired.is_set()
    record = json.loads((tmp_path / "hang0.json").read_text())
    assert record["phase"] == "save" and record["collective"] is None and "_stuck_here" in record["where"]


@pytest.mark.parametrize("case", ["progress", "long computation"])
def test_it_stays_quiet(case, tmp_path):
    def body():
        watchdog.phase(1, "forward")
        for _ in range(15):  # 1.5 s in all
            if case == "progress":  # never 0.5 s without progress, inside a collective
                watchdog.tick()
                _FAKE["all_reduce"](0.1, time.sleep)
            else:  # computing (no collective) for 1.5 s: a first compile, a long forward
                time.sleep(0.1)

    assert not _run(tmp_path, 0, body).fired.is_set() and not (tmp_path / "hang0.json").exists()
    watchdog.tick()  # stopped: inert


def test_a_peer_record_makes_the_stuck_rank_say_where_it_is(tmp_path):
    (tmp_path / "hang0.json").write_text("{}")  # rank 0 gave up waiting

    def body():
        watchdog.phase(3, "forward")
        _stuck_here(1.5)

    assert _run(tmp_path, 1, body).fired.is_set()
    record = json.loads((tmp_path / "hang1.json").read_text())
    assert record["collective"] is None and "_stuck_here" in record["where"]


def _write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_the_report_names_the_hung_and_frozen_ranks(tmp_path):
    now = time.time()
    waiting = {"step": 3, "phase": "forward", "idle_s": 30.2, "time": now,
               "collective": "all_gather_single (distributed_c10d.py)", "where": "step/loss.py:11 in forward_loss_sum"}
    for rank in (0, 2):
        _write(tmp_path, f"hang{rank}.json", {"rank": rank, **waiting})
        (tmp_path / f"stack{rank}.txt").write_text(
            "Current thread 0x1 (most recent call first):\n  File \"watchdog.py\", line 1 in _fire\n\n"
            f"Thread 0x2 (most recent call first):\n  File \"step.py\", line 90 in forward_loss_sum r{rank}\n")
    _write(tmp_path, "beat1.json", {"rank": 1, "step": 3, "phase": "forward", "time": now - 25})  # frozen
    _write(tmp_path, "beat3.json", {"rank": 3, "step": 3, "phase": "forward", "time": now - 0.5})  # left with them
    summary, stacks = hang_report(tmp_path, 4)
    assert summary.startswith("rank 1 of 4 hung while the others waited at step 3 (forward): no progress for 30 s")
    assert "rank 1: its heartbeat (written once a second) stopped 25 s before the others gave up" in summary
    assert "rank 3: step 3, forward; it stopped when a peer did" in summary
    assert "rank 0: step 3, forward, waiting in a collective, all_gather_single" in summary
    assert "forward_loss_sum r0" in stacks and "--- rank 2 (waiting) ---" in stacks and "_fire" not in stacks


def test_no_record_no_report_and_all_waiting_is_a_mismatch(tmp_path):
    assert hang_report(tmp_path, 2) is None
    for rank in (0, 1):
        _write(tmp_path, f"hang{rank}.json", {"rank": rank, "step": 5, "phase": "backward", "idle_s": 30.0,
                                              "time": time.time(), "collective": "all_reduce (x.py)", "where": None})
    summary, _ = hang_report(tmp_path, 2)
    assert summary.startswith("every rank waited in a collective for 30 s")
