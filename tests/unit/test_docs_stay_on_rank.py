"""SequenceLayout.documents_stay_on_their_rank (the one rule that skips ring attention's transfers) and the
closed-form bytes that follow it (volumes.attention_bytes docs_stay)."""

import torch

from longctx.parallel.context.sequence import plan_layout
from longctx.parallel.context.volumes import attention_bytes


def test_documents_inside_zigzag_chunks_stay():
    ids = torch.arange(32)[None] // 4  # chunks of 4 tokens: ctx 4's zigzag chunks
    assert plan_layout(ids, 4, 1, balance="zigzag").documents_stay_on_their_rank
    assert plan_layout(ids, 2, 2, balance="zigzag").documents_stay_on_their_rank  # head ranks' pieces together


def test_one_document_across_ranks_does_not_stay():
    ids = torch.arange(32)[None] // 4
    ids[0, 6:8] = 2  # positions 6..11 across the rank boundary at 8
    assert not plan_layout(ids, 4, 1, balance="zigzag").documents_stay_on_their_rank
    assert not plan_layout(torch.zeros(1, 32, dtype=torch.long), 2, 1).documents_stay_on_their_rank  # one document


def test_any_row_straddling_keeps_the_ring():
    ids = torch.stack([torch.arange(32) // 4, torch.arange(32) // 4])
    ids[1, 7:9] = 99
    assert not plan_layout(ids, 2, 1, balance="zigzag").documents_stay_on_their_rank


def test_bytes_without_the_ring():
    kw = dict(seq=4 * 4096, batch=1, heads=32, kv_heads=8, head_dim=128, head=1, ctx=4, elem=2)
    full = attention_bytes(**kw)
    assert full["ctx"] == {"ring_kv": 3 * 2 * 4096 * 8 * 128 * 2, "ring_kv_bwd": 3 * 2 * 4096 * 8 * 128 * 2,
                           "ring_dkv": 3 * 2 * 4096 * 8 * 128 * 4}
    assert attention_bytes(**kw, docs_stay=True) == {}
    two_d = dict(kw, head=2)
    stay = attention_bytes(**two_d, docs_stay=True, docs=True)
    assert stay["head"] == attention_bytes(**two_d, docs=True)["head"]  # the all-to-alls are unchanged
    assert set(stay["ctx"]) == {"unshard"}  # ids gathered without a layout still cost their bytes
