"""The loss plot's "rolled back (updates discarded)" shading is of the run's own history only.

A rollback (bad step B back to checkpoint C) is recorded in rollbacks.jsonl beside the checkpoints; an
explicit resume of an older checkpoint then abandons that attempt (its records after the resumed step move
to metrics.after-stepN.jsonl) and trains steps C+1..B again, saving its own step C. The plot still shaded
C+1..B as discarded, over the new attempt's trained steps (reproduced with the trainer: nonfinite@6 back
to step 4, then --checkpoint.resume step-2 trained 3-8 cleanly, and the plot shaded 5-6).
"""

import json

from longctx.config.checkpoint_paths import MANIFEST, step_name
from longctx.train.report import rolled_back_steps


def _run(tmp_path, saved_checksums: dict[int, str]):
    run = tmp_path / "run"
    ck = run / "checkpoints"
    ck.mkdir(parents=True)
    for step, checksum in saved_checksums.items():
        (ck / step_name(step)).mkdir()
        (ck / step_name(step) / MANIFEST).write_text(json.dumps({"step": step, "checksum": checksum}))
    rollbacks = [{"bad_step": 6, "rolled_back_to": 4, "skipped_steps": [5, 6], "checkpoint": "first"},
                 {"bad_step": 14, "rolled_back_to": 12, "skipped_steps": [13, 14]}]  # (no checksum: an older record)
    (ck / "rollbacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollbacks))
    return run


def test_a_rollback_to_a_checkpoint_a_later_attempt_saved_again_is_not_shaded(tmp_path):
    assert rolled_back_steps(_run(tmp_path, {2: "a", 4: "second", 12: "b"})) == [(13, 14)]


def test_a_rollback_on_the_runs_history_is_shaded(tmp_path):
    assert rolled_back_steps(_run(tmp_path / "same", {2: "a", 4: "first"})) == [(5, 6), (13, 14)]
    assert rolled_back_steps(_run(tmp_path / "pruned", {})) == [(5, 6), (13, 14)]  # (its checkpoint since deleted)
