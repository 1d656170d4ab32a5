"""The launcher's summary of a hang (job/watchdog.py hang_report) says what happened and where each rank was, and
also how to go on: the job exits 86 mid-run, and its summary once ended on how to avoid a false alarm only, with no
word that `--checkpoint.resume auto` continues the run from its last checkpoint."""

import json
import time

from longctx.job.watchdog import hang_report


def test_the_hang_summary_says_how_to_go_on(tmp_path):
    now = time.time()
    (tmp_path / "hang0.json").write_text(json.dumps({
        "rank": 0, "step": 3, "phase": "forward", "idle_s": 30.0, "time": now,
        "collective": "all_gather_single (distributed_c10d.py)", "where": "step/loss.py:11 in forward_loss_sum"}))
    (tmp_path / "hang1.json").write_text(json.dumps({
        "rank": 1, "step": 3, "phase": "save", "idle_s": 31.0, "time": now, "collective": None,
        "where": "checkpoint/manager.py:200 in save"}))
    summary, _ = hang_report(tmp_path, 2)
    assert summary.startswith("rank 1 of 2 hung at step 3 (save)")
    assert summary.endswith("`--checkpoint.resume auto` continues the run from its last checkpoint (the steps after "
                            "it train again).")
