"""A resume from a checkpoint older than the run's last logged step moves the records of the steps past it (the
attempt that went on after it) out of the metrics file, so that the file reads as one run. With
--metrics.file set, the records went to that file but the move looked at <run_dir>/metrics.jsonl only: a
crash at step 6 after the save of step 4 left steps 5-6 twice in the file once the resumed run logged them
again (steps [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]), and loss.png drew both."""

import pytest

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--train.steps=8", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=4", "--metrics.log_interval=1"]


@pytest.mark.parametrize("own_file", [False, True])
def test_a_resumed_run_logs_each_step_once(own_file, tmp_path):
    metrics = tmp_path / "elsewhere" / "m.jsonl" if own_file else tmp_path / "run" / "metrics.jsonl"
    args = [*BASE, f"--train.run_dir={tmp_path / 'run'}", *([f"--metrics.file={metrics}"] if own_file else [])]
    crashed = Trainer(load_config(None, args), log=lambda *a, **k: None)
    run_until_crash(crashed, 7)  # after step 6's line; the newest checkpoint is step 4's
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]

    resumed = Trainer(load_config(None, [*args, "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert resumed.start_step == 4
    resumed.run()
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, 9))  # steps 5-6 once, the resumed run's
    moved = metrics.with_name(f"{metrics.stem}.after-step4.jsonl")
    assert [r["step"] for r in read_jsonl(moved)] == [5, 6]  # the earlier attempt's, kept beside it
