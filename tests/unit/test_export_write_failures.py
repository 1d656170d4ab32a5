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
