"""`longctx checkpoint export` on a full disk and for other users (checkpoint/export.py): safetensors raises its
own SafetensorError (no OSError) when the disk fills under the weights, which reached the user as a raw
traceback; and safetensors writes its files 0600, so the exported weights (unlike config.json beside them) were
unreadable to any other user (a serving account, a colleague loading the export)."""

import os
import stat

import pytest

pytest.importorskip("transformers")
from safetensors import SafetensorError  # noqa: E402
from test_export_audit import checkpoint  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import CheckpointError  # noqa: E402
from longctx.models import hf  # noqa: E402


def test_a_disk_that_fills_under_the_weights_is_said_and_leaves_nothing(tmp_path, monkeypatch):
    step = checkpoint(tmp_path, "byte")

    def full(*_args, **_kwargs):  # (what safetensors raises: docs' tmpfs of 300 KiB, measured)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_file", full)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"No space left on device.*need about [\d.]+ MiB.*Nothing was written"):
        export_hf(step, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # neither OUT nor a temporary


def test_the_exported_files_are_readable_as_the_umask_allows(tmp_path):
    mask = os.umask(0o022)
    try:
        out, *_ = export_hf(checkpoint(tmp_path, "byte"), tmp_path / "out", max_shard_bytes=2**20)
    finally:
        os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes) and "model.safetensors.index.json" in modes
    assert modes == dict.fromkeys(modes, 0o644), modes


def test_an_error_other_than_space_is_not_said_as_a_full_disk(tmp_path, monkeypatch):
    """A tokenizer file the export cannot read (another user's 0600 file) was said as a full disk: "the weights
    need about 1.1 MiB ... 75,802 MiB is free ... Free space there, or export into a directory on another disk"."""
    from test_tokenizer_follows_model import bpe_tokenizer

    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    bpe_tokenizer(tokenizer)
    step = checkpoint(tmp_path, str(tokenizer))

    def denied(source, _dest):
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(hf.shutil, "copyfile", denied)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="Permission denied.*tokenizer.json.*Nothing was written") as e:
        export_hf(step, out)
    assert "Free space" not in str(e.value) and "need about" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "tok"]  # neither OUT nor a temporary


def test_a_failed_rename_over_a_previous_export_puts_it_back(tmp_path, monkeypatch):
    """The previous export is moved aside before the new one is renamed into OUT: when that rename failed, OUT
    was gone and the previous export lay in a hidden .out.replaced-* folder, while the error said "Nothing was
    written to OUT (it is as it was)"."""
    import errno

    from longctx.checkpoint import export

    step = checkpoint(tmp_path, "byte")
    out, *_ = export_hf(step, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(_work, _final):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(export, "publish", failing)
    with pytest.raises(CheckpointError, match="it is as it was"):
        export_hf(step, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "out"]  # (no hidden folder left)
