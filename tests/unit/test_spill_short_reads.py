"""data/builder/spill.py reads a ragged item with os.pread, which returns at most 0x7ffff000 bytes a call on Linux:
one document's text over 2 GiB came back short without an error (near-duplicate checks and embeddings read the
whole text). Short reads are emulated by an os.pread that returns at most 7 bytes a call."""

import os

import numpy as np
import pytest

from longctx.data.builder import spill


def _written(tmp_path, items):
    w = spill.RaggedWriter(tmp_path / "text", np.uint8)
    for item in items:
        w.append(item)
    w.close()
    return spill.RaggedReader(tmp_path / "text", np.uint8)


def test_an_item_is_read_whole_when_each_read_returns_part_of_it(tmp_path, monkeypatch):
    items = [b"a" * 5, bytes(range(256)) * 3, b"", b"tail"]
    reader = _written(tmp_path, items)
    real = os.pread
    monkeypatch.setattr(spill.os, "pread", lambda fd, n, at: real(fd, min(n, 7), at))
    assert [reader.raw(i) for i in range(len(items))] == items
    assert reader.raw(1, 10, 700) == items[1][10:700]
    assert reader.get(1).tolist() == list(items[1])
    reader.close()


def test_a_spill_file_cut_short_is_an_error_not_a_short_item(tmp_path):
    reader = _written(tmp_path, [b"x" * 100])
    os.truncate(tmp_path / "text.bin", 40)
    with pytest.raises(OSError, match="read 40 of 100 bytes"):
        reader.raw(0)
    reader.close()
