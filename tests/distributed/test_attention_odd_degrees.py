"""2D sequence-parallel attention on 6 gloo ranks: an odd context degree (ctx 3, head 2), Double-Ring
windows of 2 and 3 over ctx 6, head 3 and head 6 with kv heads replicated (MQA) and split, against an
independent float64 dense reference (tests/attention_reference.py), outputs and q, k, v gradients to 2e-5.

The other layout tests run 1, 2, 4 or 8 ranks, so every context degree they reach is a power of two;
here the zigzag chunks 2 ctx = 6 and 12, the rounding of windows and the kv replication of head 3 and 6
are exercised, with hundreds of tiny documents (1-2 tokens), a document across every rank and documents
longer than a rank's share, through the zigzag ids and both balanced layouts, with and without chunks.
"""

import pytest
import torch

from attention_reference import dense_reference, doc_ids
from longctx.job.spawn import run_spawned

WORLD, TOL = 6, 2e-5
SEQ = 360  # 2 x 6 x 3 x 10: a multiple of every zigzag unit below; 200+ documents when tiny


def _tiny(seq):
    lengths, n = [], 0
    while n < seq:
        lengths.append(min(1 + len(lengths) % 2, seq - n))
        n += lengths[-1]
    return lengths


# (head, ctx, window, placement, heads, kv, document lengths of each row, route, causal, attention chunk)
CASES = [
    (2, 3, 0, "head-first", 4, 1, [_tiny(SEQ)], "docs layout", True, 0),
    (2, 3, 1, "ctx-first", 4, 2, [[SEQ], [7, 200, 153]], "zigzag ids", True, 0),
    (2, 3, 3, "head-first", 6, 2, [[1] * 5 + [300] + [1] * 55], "zigzag layout", True, 7),
    (1, 6, 2, "head-first", 3, 1, [_tiny(SEQ), [100, 1, 259]], "docs layout", True, 0),
    (1, 6, 3, "head-first", 3, 3, [[SEQ]], "none", True, 0),
    (1, 6, 0, "head-first", 2, 1, [[61, 299]], "zigzag ids", False, 11),
    (3, 2, 0, "head-first", 6, 1, [[SEQ]], "none", True, 0),
    (3, 2, 1, "ctx-first", 3, 3, [_tiny(SEQ)], "docs layout", True, 16),
    (6, 1, 0, "head-first", 6, 2, [[180, 1, 179]], "zigzag ids", True, 0),
    (6, 1, 0, "head-first", 12, 3, [[SEQ]], "none", True, 25),
]


def run_case(case, meshes):
    from longctx.job.dims import ParallelDims
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import plan_layout, shard_sequence

    head, ctx, window, placement, heads, kv, rows, route, causal, chunk = case
    key = (head, ctx, window, placement)
    if key not in meshes:
        meshes[key] = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, placement=placement,
                                   world_size=WORLD).build_mesh("cpu")
    mesh = meshes[key]
    gen = torch.Generator().manual_seed(len(meshes) + heads + kv)
    q, k, v = (torch.randn(len(rows), SEQ, n, 8, generator=gen) for n in (heads, kv, kv))
    dout = torch.randn(len(rows), SEQ, heads, 8, generator=gen)
    doc = doc_ids(rows)
    ref_out, ref_grads = dense_reference(q, k, v, None if route == "none" else doc, dout, causal=causal)
    layout = None
    if route.endswith("layout"):
        layout = plan_layout(doc, ctx, head, balance="zigzag" if route == "zigzag layout" else "docs")
    shard = (lambda t: layout.shard(t, mesh)) if layout is not None else (lambda t: shard_sequence(t, mesh))
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, mesh, causal=causal, doc_ids=None if route == "none" else shard(doc),
                                window=window, layout=layout, attention_chunk=chunk)
    grads = torch.autograd.grad((out * shard(dout)).sum(), (ql, kl, vl))
    return ((out.double() - shard(ref_out)).abs().max().item(),
            max((g.double() - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)))


def _rank_run():
    meshes = {}
    return [run_case(case, meshes) for case in CASES]


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(WORLD, _rank_run)


def test_cases_reach_odd_degrees_and_replicated_kv_heads():
    assert any(c[1] % 2 for c in CASES) and {c[2] for c in CASES if c[1] == 6} >= {2, 3}
    assert any(c[0] > c[5] for c in CASES) and any(c[0] == 3 for c in CASES)
    assert any(len(row) >= 200 for c in CASES for row in c[6])


def test_odd_degree_layouts_match_the_dense_reference(per_rank):
    failures = [f"rank {rank}: {CASES[i][:6]} {CASES[i][7:]}: out {o:.2e}, grads {g:.2e}"
                for rank, results in enumerate(per_rank) for i, (o, g) in enumerate(results) if max(o, g) > TOL]
    assert not failures, "\n".join(failures[:6])
