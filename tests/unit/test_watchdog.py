"""The hang watchdog's parts on one process: it fires after timeout_s without progress (not while
phases or collectives go on), records the step, phase and place of the main thread with a stack,
and the launcher's report names the hung ranks: idle outside a collective, or frozen (heartbeat
stopped), not those that waited or left with their peers."""

import json
import time

from longctx.parallel import watchdog
from longctx.parallel.watchdog import Watchdog, hang_report


def _stuck_here(seconds):
    time.sleep(seconds)


def test_it_fires_after_the_timeout_with_where_the_main_thread_was(tmp_path):
    w = Watchdog(0.5, rank=3, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(7, "backward")
        _stuck_here(2.0)
    finally:
        w.stop()
    assert w.fired.is_set()
    record = json.loads((tmp_path / "hang3.json").read_text())
    assert (record["rank"], record["step"], record["phase"], record["collective"]) == (3, 7, "backward", None)
    assert "test_watchdog.py" in record["where"] and "_stuck_here" in record["where"]
    assert "in _stuck_here" in (tmp_path / "stack3.txt").read_text()
    assert json.loads((tmp_path / "beat3.json").read_text())["step"] == 7


def test_progress_keeps_it_quiet(tmp_path):
    w = Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        for i in range(15):  # 1.5 s in all, never 0.5 s without progress
            if i % 2:
                watchdog.tick()
            else:
                watchdog.phase(i, "forward")
            time.sleep(0.1)
    finally:
        w.stop()
    assert not w.fired.is_set() and not (tmp_path / "hang0.json").exists()
    watchdog.tick()  # stopped: inert


def _write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_the_report_names_the_hung_and_frozen_ranks(tmp_path):
    now = time.time()
    waiting = {"step": 3, "phase": "forward", "idle_s": 30.2, "time": now,
               "collective": "all_gather_single (distributed_c10d.py)", "where": "train/step.py:90 in forward_loss_sum"}
    for rank in (0, 2):
        _write(tmp_path, f"hang{rank}.json", {"rank": rank, **waiting})
        (tmp_path / f"stack{rank}.txt").write_text(
            "Current thread 0x1 (most recent call first):\n  File \"watchdog.py\", line 1 in _fire\n\n"
            f"Thread 0x2 (most recent call first):\n  File \"step.py\", line 90 in forward_loss_sum r{rank}\n")
    _write(tmp_path, "beat1.json", {"rank": 1, "step": 3, "phase": "forward", "time": now - 25})  # frozen
    _write(tmp_path, "beat3.json", {"rank": 3, "step": 3, "phase": "forward", "time": now - 0.5})  # left with them
    summary, stacks = hang_report(tmp_path, 4)
    assert summary.startswith("rank 1 of 4 hung at step 3 (forward): no progress for 30 s")
    assert "rank 1: its heartbeat stopped 25 s before the others gave up" in summary
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
