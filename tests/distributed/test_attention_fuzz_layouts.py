"""Randomized (seeded) comparison of 2D sequence-parallel attention with an independent dense reference,
on 4 gloo ranks in one spawned job.

Each case draws a layout (head x ctx over 4 ranks, a Double-Ring window among the divisors of ctx,
placement), query and kv heads that the head degree can split (replicated kv heads included), a
sequence of 1 to a few zigzag units, packed documents among the edge cases of tests/attention_reference.py
(one document, every token its own, boundaries at a rank's share or a zigzag chunk, a document longer
than a rank's share then padding, mixed), how the documents reach the ring (none; ids sharded zigzag
with no layout; a docs- or zigzag-balanced SequenceLayout given, or attached to the ids as training
does), an attention chunk that does or does not divide a rank's tokens, with or without
attention_offload, and causal or not. Outputs and the q, k, v gradients of every rank's shard are
compared with float64 textbook attention over the whole sequence, to 2e-5.
"""

import numpy as np
import pytest
import torch

from attention_reference import DOC_KINDS, dense_reference, doc_ids, doc_lengths
from longctx.job.spawn import run_spawned

WORLD, CASES, TOL = 4, 40, 2e-5
DOC_ROUTES = ("none", "zigzag ids", "docs layout", "zigzag layout", "attached docs layout")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_case(seed: int) -> dict:
    """One case, the same on every rank (a function of the seed alone)."""
    rng = np.random.default_rng(seed)
    head = int(rng.choice(_divisors(WORLD)))
    ctx = WORLD // head
    heads = head * int(rng.choice([1, 2, 3]))
    unit = 2 * ctx * head
    seq = unit * int(rng.integers(1, max(1, 48 // unit) + 1))
    share, zigzag_chunk = seq // (ctx * head), seq // (2 * ctx)
    batch = int(rng.integers(1, 3))
    return dict(
        seed=seed, head=head, ctx=ctx, window=int(rng.choice([0, *_divisors(ctx)])),
        placement=str(rng.choice(["head-first", "ctx-first"])) if head > 1 and ctx > 1 else "head-first",
        heads=heads, kv=int(rng.choice([kv for kv in _divisors(heads) if kv % head == 0 or head % kv == 0])),
        seq=seq, route=str(rng.choice(DOC_ROUTES)), causal=bool(rng.random() < 0.85),
        chunk=0 if rng.random() < 0.4 else int(rng.integers(1, seq // ctx + 3)), offload=bool(rng.random() < 0.5),
        rows=[doc_lengths(rng, seq, str(rng.choice(DOC_KINDS)), share=share, chunk=zigzag_chunk)
              for _ in range(batch)])


def run_case(case: dict, meshes: dict) -> tuple[float, float]:
    from longctx.job.dims import ParallelDims
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence

    key = (case["head"], case["ctx"], case["window"], case["placement"])
    if key not in meshes:
        meshes[key] = ParallelDims(dp_shard=1, head=key[0], ctx=key[1], window=key[2], placement=key[3],
                                   world_size=WORLD).build_mesh("cpu")
    mesh = meshes[key]
    gen = torch.Generator().manual_seed(case["seed"])
    batch, seq, route = len(case["rows"]), case["seq"], case["route"]
    q, k, v = (torch.randn(batch, seq, n, 8, generator=gen) for n in (case["heads"], case["kv"], case["kv"]))
    dout = torch.randn(batch, seq, case["heads"], 8, generator=gen)
    doc = doc_ids(case["rows"])
    ref_out, ref_grads = dense_reference(q, k, v, None if route == "none" else doc, dout, causal=case["causal"])
    layout, given = None, {}
    if route.endswith("layout"):
        layout = plan_layout(doc, case["ctx"], case["head"], balance="zigzag" if route == "zigzag layout" else "docs")
    shard = (lambda t: layout.shard(t, mesh)) if layout is not None else (lambda t: shard_sequence(t, mesh))
    local_doc = None if route == "none" else shard(doc)
    if route == "attached docs layout":
        attach_layout(local_doc, layout)  # as local_batch hands the ids to the model
    elif layout is not None:
        given["layout"] = layout
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, mesh, causal=case["causal"], doc_ids=local_doc, window=case["window"],
                                attention_chunk=case["chunk"], attention_offload=case["offload"], **given)
    grads = torch.autograd.grad((out * shard(dout)).sum(), (ql, kl, vl))
    return ((out.double() - shard(ref_out)).abs().max().item(),
            max((g.double() - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)))


def _rank_run(seeds):
    meshes = {}
    return [(seed, run_case(draw_case(seed), meshes)) for seed in seeds]


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(WORLD, _rank_run, list(range(CASES)))


def test_cases_cover_the_edge_cases():
    cases = [draw_case(s) for s in range(CASES)]
    assert {c["route"] for c in cases} == set(DOC_ROUTES)
    assert {(c["head"], c["ctx"]) for c in cases} == {(1, 4), (2, 2), (4, 1)}
    assert {c["window"] for c in cases if c["ctx"] == 4} >= {0, 1, 2, 4}
    assert any(c["kv"] < c["head"] for c in cases)  # kv heads replicated over the head group
    assert any(c["chunk"] and (c["seq"] // c["ctx"]) % c["chunk"] for c in cases)  # chunks not dividing
    assert any(c["offload"] and c["chunk"] for c in cases) and any(not c["causal"] for c in cases)
    lengths = [n for c in cases for row in c["rows"] for n in row]
    assert 1 in lengths and 2 in lengths
    assert any(max(row) > c["seq"] // WORLD for c in cases for row in c["rows"])  # longer than a rank's share


def test_sequence_parallel_attention_matches_the_dense_reference(per_rank):
    failures = [f"rank {rank}: {draw_case(seed)}: out {errors[0]:.2e}, grads {errors[1]:.2e}"
                for rank, results in enumerate(per_rank) for seed, errors in results if max(errors) > TOL]
    assert not failures, "\n".join(failures[:6])
