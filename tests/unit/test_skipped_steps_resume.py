"""train.on_nonfinite = skip counts the steps whose update was not applied (`skipped_steps` in metrics.jsonl, the
"skipped N (non-finite or spike)" of the log line). The count is training state like the spike window: a resumed run's
metrics continue the run's file (continue_run_files), so its count goes on from the checkpoint's. It once
started again at 0: a run that skipped step 3, crashed in step 5 and resumed from step 4 logged
skipped_steps 1 for steps 3-4 and then nothing (0, left out) for steps 5-6, as if no step had been skipped."""


from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--checkpoint.interval=4", "--metrics.log_interval=1"]


def test_the_skipped_steps_count_goes_on_after_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    args = [*BASE, f"--train.run_dir={tmp_path}"]
    crashed = Trainer(load_config(None, args), log=lambda *a, **k: None)
    run_until_crash(crashed, 5)
    assert crashed.skipped_steps == 1

    monkeypatch.delenv("LONGCTX_FAULT")
    resumed = Trainer(load_config(None, [*args, "--checkpoint.resume=auto"]), log=lambda *a, **k: None)
    assert resumed.start_step == 4
    resumed.run()
    assert resumed.skipped_steps == 1
    counts = {r["step"]: r.get("skipped_steps", 0) for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert counts == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}
