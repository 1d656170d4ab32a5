"""train.on_nonfinite = skip with train.spike_factor: a spike's update is not applied, but its finite loss (1000x
the others under LONGCTX_FAULT=spike@STEP) went into its interval's loss_mean, the curve loss.png draws: a mean
of 925 where the applied steps averaged 4.9. A skipped step is now left out of loss_mean, as a non-finite one
already was."""

import math

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer


def test_a_skipped_spike_is_not_in_the_intervals_mean_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "spike@8")
    cfg = load_config(None, ["--train.steps=10", "--train.seq_len=64", "--train.global_batch=2",
                             "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
                             "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
                             "--checkpoint.final=false", "--metrics.log_interval=5", "--train.spike_factor=3",
                             "--train.spike_window=4", f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    losses = trainer.run().losses
    assert trainer.skipped_steps == 1
    last = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["step"] == 10][0]
    applied = [x for i, x in enumerate(losses[5:10], 6) if i != 8]
    assert last["interval_steps"] == 5
    assert math.isclose(last["loss_mean"], sum(applied) / len(applied), rel_tol=1e-12)
