"""The failed-save message says which checkpoint is kept and that `latest` still points to it. It named the
newest complete checkpoint in the directory, which after an explicit resume of an older one is the abandoned
attempt's, not the one `latest` names (and resume auto continues from)."""

from longctx.checkpoint.failures import save_failed


def test_the_message_names_the_checkpoint_latest_points_to(tmp_path):
    for name in ("step-00000002", "step-00000008"):  # step 8: an abandoned attempt's
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text("step-00000002\n")
    message = str(save_failed(tmp_path, 4, 2**30, OSError(28, "No space left on device")))
    assert "the previous checkpoint, step-00000002, is intact and `latest` still points to it" in message


def test_no_checkpoint_at_all_is_said(tmp_path):
    assert "no earlier checkpoint exists" in str(save_failed(tmp_path / "none", 4, 0, None))
