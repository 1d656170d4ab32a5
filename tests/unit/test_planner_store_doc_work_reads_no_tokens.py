"""`longctx plan --store DIR` measures doc_work from the store's document ids (planner/documents.py
store_doc_work): those come from the segment index, so reading them must not read any sample's
tokens (it read every token of up to 2,000 samples: 4 GB at 1M tokens, for ids that do not depend
on them)."""

from __future__ import annotations

import pytest
from test_planner_doc_work import _brute_force_doc_work, _store


def test_store_doc_work_reads_no_tokens(tmp_path, monkeypatch):
    from longctx.data.loader import PackedSamples
    from longctx.planner.documents import store_doc_work

    lengths = [30, 50, 10, 63, 100, 5, 7, 200, 41, 12, 17, 90, 3, 64, 25]
    root = _store(tmp_path, "mixed", 64, lengths)
    n = len(PackedSamples(root, "train", True))
    expected = _brute_force_doc_work(root, range(n))  # (a dense mask over the ids the training loop reads)

    def no_token_reads(self, *args, **kwargs):
        raise AssertionError("store_doc_work read a sample's tokens")

    monkeypatch.setattr(PackedSamples, "_tokens_at", no_token_reads)
    work, used, total = store_doc_work(root, 64)
    assert (used, total) == (n, n)
    assert work == pytest.approx(expected, rel=1e-12)
