"""2D sequence-parallel attention at the shapes the other layout tests do not draw, on 2 and 4 gloo ranks,
against the float64 dense reference of tests/attention_reference.py (outputs and q, k, v gradients).

The fuzz and parity tests use head_dim 8 or 16 and 4, 6 or 8 ranks. Here: odd head dims (5, 7, 33, which
the CPU flash kernels take in other tile paths), kv heads fewer than the head degree (replicated: head 4 with
1 or 2 kv heads, head 2 with 1), a plain ring of 2, Double-Ring ctx 4 window 2, with and without
attention chunks that divide nothing, and packed rows: one document across every rank, every token its own
document, a very skewed row (one document of all but 3 tokens, then three of 1) in both orders, under the
zigzag ids, a zigzag layout and the document-balanced split, a micro-batch of 2 rows with different layouts.
bf16 inputs are compared by their error against the one-process bf16 attention's (ops/attention.py) error.
At 8K tokens on 2 ranks, the largest tensor any aten op allocates inside the ring, Ulysses, chunked and
document paths is recorded: linear in S (k and v stacked for the ring), never S x S or (S / ctx)^2.
"""

import pytest
import torch

from attention_reference import dense_reference, doc_ids
from longctx.job.spawn import run_spawned_many

TOL, BF16_RATIO = 2e-5, 4.0
ROUTES = ("none", "zigzag ids", "zigzag layout", "docs layout")


def _rows(seq, d):
    skewed = [[seq - 3, 1, 1, 1], [1, 1, 1, seq - 3]]
    return {5: [[seq], [1] * seq], 7: skewed, 33: [[seq // 2 + 1, seq // 2 - 1], [1, seq - 2, 1]]}[d]


def cases(world):
    """(head, ctx, window, heads, kv, head_dim, route, chunk): every route and head dim on every layout."""
    layouts = [(1, 2, 0), (2, 1, 0)] if world == 2 else [(1, 4, 2), (2, 2, 0), (4, 1, 0)]
    out = []
    for head, ctx, window in layouts:
        heads_kv = [(2 * head, 1), (4 * head, 2)] if head > 1 else [(2, 1), (3, 3)]
        for i, d in enumerate((5, 7, 33)):
            heads, kv = heads_kv[i % len(heads_kv)]
            for j, route in enumerate(ROUTES):
                out.append((head, ctx, window, heads, kv, d, route, 3 if (i + j) % 2 else 0))
    return out


def _mesh(meshes, world, head, ctx, window):
    from longctx.job.dims import ParallelDims

    key = (head, ctx, window)
    if key not in meshes:
        meshes[key] = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, world_size=world).build_mesh("cpu")
    return meshes[key]


def run_case(case, meshes, world, dtype):
    """(out error, gradient error) against float64; for bf16, each divided by one process's bf16 error."""
    from longctx.ops.attention import attention
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import plan_layout, shard_sequence

    head, ctx, window, heads, kv, d, route, chunk = case
    mesh = _mesh(meshes, world, head, ctx, window)
    seq = 12 * world
    rows = [[seq], [seq]] if route == "none" else _rows(seq, d)
    gen = torch.Generator().manual_seed(d + heads)
    q, k, v, dout = (torch.randn(len(rows), seq, n, d, generator=gen).to(dtype) for n in (heads, kv, kv, heads))
    doc = None if route == "none" else doc_ids(rows)
    ref_out, ref_grads = dense_reference(q, k, v, doc, dout)
    layout = None
    if route.endswith("layout"):
        layout = plan_layout(doc, ctx, head, balance="zigzag" if route == "zigzag layout" else "docs")
    shard = (lambda t: layout.shard(t, mesh)) if layout is not None else (lambda t: shard_sequence(t, mesh))
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, mesh, doc_ids=None if doc is None else shard(doc), window=window,
                                layout=layout, attention_chunk=chunk)
    grads = torch.autograd.grad((out.float() * shard(dout).float()).sum(), (ql, kl, vl))
    errors = ((out.double() - shard(ref_out)).abs().max().item(),
              max((g.double() - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)))
    if dtype == torch.float32:
        return errors
    one = [t.detach().requires_grad_() for t in (q, k, v)]
    o1, _ = attention(*one, q_doc=doc, k_doc=doc)
    g1 = torch.autograd.grad((o1.float() * dout.float()).sum(), one)
    floor = ((o1.double() - ref_out).abs().max().item(),
             max((g.double() - r).abs().max().item() for g, r in zip(g1, ref_grads)))
    return tuple(e / max(f, 1e-3) for e, f in zip(errors, floor))


def run_cases(world, dtype):
    meshes = {}
    return [(case, run_case(case, meshes, world, dtype)) for case in cases(world)]


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any aten op returns while active: (numel, op, shape)."""

    def __init__(self):
        super().__init__()
        self.top = (0, "", ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.top[0]:
                self.top = (t.numel(), str(func), tuple(t.shape))
        return out


def largest_allocations(world, seq):
    """Per (head, ctx, route, chunk) at `seq` tokens: the largest tensor of forward and backward."""
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import plan_layout, shard_sequence

    meshes, found = {}, {}
    doc = doc_ids([[seq // 3, 5, 1, seq - seq // 3 - 6]])
    for head, ctx in ((1, 2), (2, 1)):
        mesh = _mesh(meshes, world, head, ctx, 0)
        for route in ("none", "zigzag ids", "docs layout"):
            for chunk in (0, 1024):
                layout = plan_layout(doc, ctx, head, balance="docs") if route == "docs layout" else None
                shard = layout.shard if layout is not None else shard_sequence
                ql, kl, vl = (shard(torch.randn(1, seq, 2, 8), mesh).requires_grad_() for _ in range(3))
                with _Largest() as seen:
                    out = distributed_attention(ql, kl, vl, mesh, doc_ids=None if route == "none" else shard(doc, mesh),
                                                layout=layout, attention_chunk=chunk)
                    torch.autograd.grad(out.sum(), (ql, kl, vl))
                found[(head, ctx, route, chunk)] = seen.top
    return found


SEQ_BIG = 8192


def _jobs(world):
    jobs = [("fp32", run_cases, (world, torch.float32)), ("bf16", run_cases, (world, torch.bfloat16))]
    if world == 2:
        jobs.append(("memory", largest_allocations, (world, SEQ_BIG)))
    return jobs


@pytest.fixture(scope="module")
def spawned():
    done = {}

    def get(world):
        if world not in done:
            done[world] = run_spawned_many(world, _jobs(world))
        return done[world]

    return get


def test_cases_cover_the_edges():
    for world in (2, 4):
        drawn = cases(world)
        assert {c[6] for c in drawn} == set(ROUTES) and {c[5] for c in drawn} == {5, 7, 33}
        assert any(c[4] < c[0] for c in drawn)  # kv heads replicated (head 2 or 4, kv 1 or 2)
        assert any(c[7] for c in drawn) and any(not c[7] for c in drawn)
    assert any(c[1] == 4 and c[2] == 2 for c in cases(4))


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_outputs_and_gradients_match_the_reference(spawned, world):
    failures = [f"rank {r}: {case}: out {e[0]:.2e}, grads {e[1]:.2e}"
                for r, results in enumerate(spawned(world)["fp32"]) for case, e in results if max(e) > TOL]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_errors_stay_near_one_process(spawned, world):
    failures = [f"rank {r}: {case}: out x{e[0]:.2f}, grads x{e[1]:.2f} one process's bf16 error"
                for r, results in enumerate(spawned(world)["bf16"]) for case, e in results if max(e) > BF16_RATIO]
    assert not failures, "\n".join(failures[:8])


def test_no_op_allocates_seq_squared(spawned):
    for rank, found in enumerate(spawned(2)["memory"]):
        for key, (numel, op, shape) in found.items():
            # the largest legitimate tensor: [k, v] stacked, [2, 1, S / 2, 2, 8] or [2, 1, S, 1, 8] = 16 S
            assert numel <= 16 * SEQ_BIG, f"rank {rank}, {key}: {op} made {shape} ({numel} elements)"
