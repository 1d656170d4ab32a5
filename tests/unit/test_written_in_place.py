"""Which outputs are written where they are instead of through a temporary renamed over them
(durable.written_in_place): devices, pipes and paths under /dev or /proc, never /dev/shm's regular
files, whose outputs (generate's lines) were otherwise written in place, with no FILE.partial: an
interrupted run left a half file there posing as complete."""

import os
from pathlib import Path

import pytest

from longctx.durable import written_in_place


def test_devices_and_proc_paths_are_written_in_place():
    assert written_in_place("/dev/null")
    assert written_in_place("/proc/self/fd/1")
    assert written_in_place("/dev/stdout")


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_dev_shm_files_are_published_by_rename(tmp_path):
    d = Path(f"/dev/shm/longctx_test_{os.getpid()}")
    d.mkdir(exist_ok=True)
    try:
        assert not written_in_place(d / "out.jsonl")
        (d / "old.jsonl").write_text("x\n")
        assert not written_in_place(d / "old.jsonl")
        link = tmp_path / "link.jsonl"
        link.symlink_to(d / "old.jsonl")
        assert not written_in_place(link)
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_regular_files_elsewhere_are_published_by_rename(tmp_path):
    assert not written_in_place(tmp_path / "out.jsonl")
