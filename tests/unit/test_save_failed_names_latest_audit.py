"""The failed-save message says which checkpoint is kept and that `latest` still points to it. It named the
newest complete checkpoint in the directory, which after an explicit resume of an older one is the abandoned
attempt's, not the one `latest` names (and resume auto continues from)."""

from longctx.checkpoint.failures import save_failed


def test_the_message_names_the_checkpoint_latest_points_to(tmp_path):
    for name in ("step-00000002", "step-00000008"):  # step 8: an abandoned attempt's
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text("step-00000002\n")
    # (the run's own checkpoint is the one `latest` names)
    message = str(save_failed(tmp_path, 4, 2**30, OSError(28, "No space left on device"), tmp_path / "step-00000002"))
    assert "the previous checkpoint, step-00000002, is intact and `latest` still points to it" in message


def test_no_checkpoint_at_all_is_said(tmp_path):
    assert "no earlier checkpoint exists" in str(save_failed(tmp_path / "none", 4, 0, None, None))


def test_after_resuming_an_older_checkpoint_the_message_names_it_not_the_abandoned_latest(tmp_path, monkeypatch):
    import pytest

    from longctx.config import load_config
    from longctx.config.checkpoint_paths import CheckpointError
    from longctx.train.trainer import train

    base = ["--model.layers=1", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
            "--data.max_docs=40", "--train.seq_len=64", "--train.global_batch=2", f"--train.run_dir={tmp_path}"]
    monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    train(load_config("configs/debug.toml", [*base, "--train.steps=4", "--checkpoint.interval=2"]), log=lambda *a: None)
    ck = tmp_path / "checkpoints"  # `latest` names step 4; the second attempt resumes step 2, its first save fails
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@1")
    again = [*base, "--train.steps=6", "--checkpoint.interval=3", f"--checkpoint.resume={ck / 'step-00000002'}"]
    with pytest.raises(CheckpointError) as failed:
        train(load_config("configs/debug.toml", again), log=lambda *a, **k: None)
    message = str(failed.value)
    # its way on is the checkpoint it resumed; resume auto would continue the abandoned attempt's step 4
    assert f"this run's previous checkpoint, {ck / 'step-00000002'}, is intact" in message
    assert f"--checkpoint.resume {ck / 'step-00000002'} then continues this run" in message
    assert "auto then continues from step-00000004" not in message
