"""A checkpoint save that fails (a full disk) stops the run with an error that says what happened, what is kept,
and how to get past it: free space, or another --checkpoint.dir, and where --checkpoint.resume auto goes on from.
It named the step, the cause and the space but no way out."""

import errno

from longctx.checkpoint.failures import save_failed


def test_a_full_disk_names_the_way_out(tmp_path):
    kept = tmp_path / "step-00000002"
    kept.mkdir()
    (kept / "manifest.json").write_text("{}")
    message = str(save_failed(tmp_path, 4, 2**30, OSError(errno.ENOSPC, "No space left on device"), kept))
    assert "step 4 could not be written" in message and "No space left on device" in message
    assert "free space there" in message and "--checkpoint.dir" in message
    assert message.endswith(f"--checkpoint.resume auto then continues from step-00000002 (with another "
                            f"--checkpoint.dir, --checkpoint.resume {kept}).")


def test_another_checkpoint_dir_is_told_the_kept_checkpoints_path(tmp_path):
    """auto looks in --checkpoint.dir: a new one, with room, holds no step-N, and a resume there with auto was
    refused ('found no checkpoint to continue it from'); the way out names the kept checkpoint's path."""
    kept = tmp_path / "step-00000002"
    kept.mkdir()
    (kept / "manifest.json").write_text("{}")
    message = str(save_failed(tmp_path, 4, 2**30, OSError(errno.ENOSPC, "No space left on device"), kept))
    assert f"with another --checkpoint.dir, --checkpoint.resume {kept}" in message


def test_without_an_earlier_checkpoint_no_resume_is_promised(tmp_path):
    message = str(save_failed(tmp_path / "none", 4, 0, None, None))
    assert "no earlier checkpoint exists" in message and "--checkpoint.dir" in message
    assert "--checkpoint.resume" not in message
