"""Packed documents that each stay on one context rank cost the ring nothing (4 gloo ranks, one spawn).

When every document of every batch row lies on one context rank's positions (SequenceLayout.
documents_stay_on_their_rank), no query needs another rank's keys: the ring is skipped, forward and
backward attend the own block only, and no ring_kv / ring_kv_bwd / ring_dkv bytes are sent (they were
the full ring's before, the skipped blocks' gradients travelling as zeros). One document across a rank
boundary keeps the ring. Both are exact against a dense float64 reference: ctx 2, ctx 4 with Double-Ring
windows of 2, head 2 x ctx 2; causal or not, GQA, and the chunked core (FPDT's ChunkGrid plans).
"""

import pytest
import torch

from attention_reference import dense_reference
from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import attach_layout, plan_layout
from longctx.parallel.context.volumes import attention_bytes

WORLD, B, S, H, D = 4, 2, 32, 4, 8
MESHES = {"ctx2": dict(dp_shard=2, ctx=2), "ctx4_window2": dict(ctx=4, window=2), "head2_ctx2": dict(head=2, ctx=2)}
RING = ("ring_kv", "ring_kv_bwd", "ring_dkv")


def doc_ids(kind):
    """'stay': 4-token documents (row 0) and 2-token ones (row 1), inside zigzag chunks of every mesh here;
    'straddle': the same, but row 0's document 2 covers positions 6..11, across the boundary at 8 (a rank
    boundary of every mesh here)."""
    pos = torch.arange(S)
    ids = torch.stack([pos // 4, pos // 2])
    if kind == "straddle":
        ids[0, 6:8] = 2
    return ids


def cases():
    for mesh in MESHES:
        for kind, balance in (("stay", "zigzag"), ("stay", "docs"), ("straddle", "zigzag")):
            for causal in (True, False):
                yield mesh, kind, balance, causal, 2, 0
        yield mesh, "stay", "zigzag", True, 4, 4  # the chunked core, full heads
        yield mesh, "straddle", "zigzag", True, 4, 4


def run_case(mesh_name, kind, balance, causal, kv, chunk, meshes):
    if mesh_name not in meshes:
        meshes[mesh_name] = ParallelDims(world_size=WORLD, **MESHES[mesh_name]).build_mesh("cpu")
    mesh = meshes[mesh_name]
    ctx, head = mesh["ctx"].size(), mesh["head"].size()
    g = torch.Generator().manual_seed(7)
    q, dout = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    k, v = torch.randn(B, S, kv, D, generator=g), torch.randn(B, S, kv, D, generator=g)
    ids = doc_ids(kind)
    ref, ref_grads = dense_reference(q, k, v, ids, dout, causal=causal)
    layout = plan_layout(ids, ctx, head, balance=balance)
    ql, kl, vl = (layout.shard(t, mesh).requires_grad_() for t in (q, k, v))
    local_ids = attach_layout(layout.shard(ids, mesh), layout)
    comm.reset_counters()
    out = distributed_attention(ql, kl, vl, mesh, causal=causal, doc_ids=local_ids, attention_chunk=chunk,
                                window=MESHES[mesh_name].get("window", 0))
    grads = torch.autograd.grad((out * layout.shard(dout, mesh)).sum(), (ql, kl, vl))
    sent = comm.counters()
    err = max((a.double() - layout.shard(b, mesh)).abs().max().item()
              for a, b in zip((out, *grads), (ref, *ref_grads)))
    expected = attention_bytes(seq=S, batch=B, heads=H, kv_heads=kv, head_dim=D, head=head, ctx=ctx, elem=4,
                               docs_stay=layout.documents_stay_on_their_rank)
    return {"stay": layout.documents_stay_on_their_rank, "err": err, "sent": sent, "expected": expected}


def _rank_run():
    meshes = {}
    return [run_case(*case, meshes) for case in cases()]


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(WORLD, _rank_run)


CASES = list(cases())


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_exact_against_the_dense_reference(per_rank, i):
    for rank, results in enumerate(per_rank):
        assert results[i]["err"] < 2e-5, (rank, CASES[i], results[i]["err"])


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_ring_bytes_only_when_a_document_straddles(per_rank, i):
    """Fails before the skip: documents on their own ranks still sent the whole ring (3 labels, full size)."""
    mesh, kind, balance, *_ = CASES[i]
    for rank, results in enumerate(per_rank):
        r = results[i]
        if kind == "straddle":
            assert not r["stay"]
            assert all(r["sent"]["ctx"][label] > 0 for label in RING), (rank, r["sent"])
        elif balance == "zigzag":  # documents inside zigzag chunks: they stay by construction
            assert r["stay"]
        if r["stay"]:
            assert not any(label in r["sent"].get("ctx", {}) for label in RING), (rank, CASES[i], r["sent"])
        assert r["sent"] == r["expected"], (rank, CASES[i], r["sent"], r["expected"])
