"""A checkpoint save that fails (LONGCTX_FAULT=enospc@2: the second save meets a full disk), sync and
async: the partial save is removed, `latest` still names the first checkpoint, which verifies and
resumes; checkpoint.on_save_error = stop stops with a message that says how much space was needed,
warn trains on and saves again later."""

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import LATEST, CheckpointError
from longctx.train.trainer import Trainer

BASE = ["--train.steps=6", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--checkpoint.interval=2"]


def _left(run_dir):
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()), (root / LATEST).read_text().strip()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(async_save, tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")
    cfg = load_config(None, [*BASE, f"--checkpoint.async={str(async_save).lower()}", f"--train.run_dir={tmp_path}"])
    with pytest.raises(CheckpointError, match=r"step 4 could not be written .*No space left on device.* needs about "
                                              r"[0-9.]+ GiB \([0-9.]+ GiB free there\).*step-00000002, is intact"):
        Trainer(cfg, log=lambda *a, **k: None).run()
    names, latest = _left(tmp_path)
    assert names == [LATEST, "step-00000002"] and latest == "step-00000002"  # no temporary directory left
    # the kept checkpoint verifies and resumes
    resumed = load_config(None, [*BASE, "--checkpoint.resume=auto", f"--train.run_dir={tmp_path}"])
    monkeypatch.delenv("LONGCTX_FAULT")
    trainer = Trainer(resumed, log=lambda *a, **k: None)
    assert trainer.start_step == 2
    assert len(trainer.run().losses) == 4


def test_warn_trains_on_and_saves_again(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")
    said = []
    cfg = load_config(None, [*BASE, "--checkpoint.on_save_error=warn", "--checkpoint.keep=5",
                             f"--train.run_dir={tmp_path}"])
    result = Trainer(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a)))).run()
    assert len(result.losses) == 6
    names, latest = _left(tmp_path)
    assert names == [LATEST, "step-00000002", "step-00000006"] and latest == "step-00000006"
    assert any("step 4 could not be written" in s and "Training goes on" in s for s in said)


def test_bad_choice_is_a_config_error():
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match="on_save_error = .ignore. is not one of the valid choices: stop, warn"):
        load_config(None, ["--checkpoint.on_save_error=ignore"])


def test_a_signal_at_a_step_whose_save_failed_saves_it_then(tmp_path, monkeypatch):
    """on_save_error = warn: step 4's periodic save meets a full disk and training goes on; a SIGTERM
    in that same step must save step 4 (the fault fires once), not say "saved step 4" with none there."""
    import os
    import signal

    from longctx.errors import Preempted

    monkeypatch.setenv("LONGCTX_FAULT", "enospc@2")
    cfg = load_config(None, [*BASE, "--checkpoint.on_save_error=warn", "--checkpoint.keep=5",
                             f"--train.run_dir={tmp_path}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    step = trainer.step

    def stepping(s):
        out = step(s)
        if s == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = stepping
    with pytest.raises(Preempted, match="saved step 4 on SIGTERM"):
        trainer.run()
    names, latest = _left(tmp_path)
    assert "step-00000004" in names and latest == "step-00000004", names
