"""train.on_nonfinite = rollback counts the run's rollbacks (`rollbacks` in metrics.jsonl), as skip counts its skipped
steps (test_skipped_steps_resume.py): the count is training state, saved with each checkpoint, so a resumed run's
metrics, which continue the run's file, go on counting from it. It once started again at 0 after every resume: a run
that rolled back at step 5 logged rollbacks 1 for steps 6 on, and after a crash and a resume nothing (0, left out),
as if it had never rolled back; a resume from the very checkpoint it rolled back to (which skips the window again,
rollback.py) counts that rollback too."""

import pytest

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--train.steps=8", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=2", "--metrics.log_interval=1", "--train.on_nonfinite=rollback"]


def _quiet(*_a, **_k):
    pass


# crash at the start of step 7 (resumed from step 6, saved after the rollback) or of step 6 (resumed from step 4,
# the checkpoint rolled back to: the window of step 5 stays skipped)
@pytest.mark.parametrize("crash_at, resumed_from", [(7, 6), (6, 5)])
def test_the_rollbacks_count_goes_on_after_a_resume(tmp_path, monkeypatch, crash_at, resumed_from):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@5")
    args = [*BASE, f"--train.run_dir={tmp_path}"]
    crashed = Trainer(load_config(None, args), log=_quiet)
    run_until_crash(crashed, crash_at)
    assert crashed.rollbacks == 1

    monkeypatch.delenv("LONGCTX_FAULT")
    resumed = Trainer(load_config(None, [*args, "--checkpoint.resume=auto"]), log=_quiet)
    assert resumed.start_step == resumed_from
    resumed.run()
    assert resumed.rollbacks == 1
    counts = {r["step"]: r.get("rollbacks", 0) for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert counts == {1: 0, 2: 0, 3: 0, 4: 0, 6: 1, 7: 1, 8: 1}
