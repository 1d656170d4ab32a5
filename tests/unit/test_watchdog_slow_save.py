"""A save that takes longer than parallel.timeout_s on a slow disk is not a hang while its writes grow
(job/watchdog.py watch_writes; the checkpoint manager measures its rank's files, checkpoint/manifest.py
rank_bytes) or while it hashes what it wrote (sha256 ticks): the watchdog ended such a rank, and the save
with it (the last step's, waited for at the end of the run, lost). A save whose writes stop still fires."""

import time

import pytest

from longctx.checkpoint.manifest import rank_bytes, sha256
from longctx.job import watchdog
from longctx.job.watchdog import Watchdog


@pytest.fixture
def writes():
    yield
    watchdog.watch_writes(None)


def _save(tmp_path, seconds: float, grows_for: float, timeout: float = 1.0) -> Watchdog:
    """A save phase of `seconds` on rank 1, writing its file for the first `grows_for` of them."""
    d = tmp_path / "save"
    d.mkdir()
    watchdog.watch_writes(lambda: rank_bytes(d, 1))
    w = Watchdog(timeout, rank=1, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(9, "save")
        with open(d / "__1_0.distcp", "wb") as f:
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                if time.monotonic() - start < grows_for:
                    f.write(b"x" * 4096)
                    f.flush()
                time.sleep(0.02)
    finally:
        w.stop()
    return w


def test_a_save_whose_writes_grow_is_not_a_hang(tmp_path, writes):
    assert not _save(tmp_path, 3.0, grows_for=3.0).fired.is_set()


def test_a_save_whose_writes_stop_still_fires(tmp_path, writes):
    w = _save(tmp_path, 3.0, grows_for=0.3)
    assert w.fired.is_set() and (tmp_path / "hang1.json").exists()


def test_only_the_ranks_own_files_count(tmp_path):
    (tmp_path / "__1_0.distcp").write_bytes(b"a" * 10)
    (tmp_path / "__0_0.distcp").write_bytes(b"b" * 7)
    (tmp_path / ".metadata").write_bytes(b"c" * 3)  # (the job's files: rank 0's)
    assert (rank_bytes(tmp_path, 1), rank_bytes(tmp_path, 0)) == (10, 10)
    with pytest.raises(OSError):
        rank_bytes(tmp_path / "published", 0)


def test_hashing_a_saved_file_is_progress(tmp_path):
    """sha256 reads in 4 MiB blocks; a file read slowly (here: many small blocks) keeps the save phase alive."""
    f = tmp_path / "big"
    f.write_bytes(b"z" * (1 << 16))
    w = Watchdog(0.5, rank=0, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(3, "save")
        start = time.monotonic()
        while time.monotonic() - start < 1.5:
            sha256(f, chunk=1 << 10)
    finally:
        w.stop()
    assert not w.fired.is_set()
