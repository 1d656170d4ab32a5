"""Document ids of any integer type reach 2D sequence-parallel attention without a layout (gathered once to
plan the ring): int16, int32 and uint8 ids give the same attention as int64 ones, against the float64 dense
reference, and the gather sends the bytes volumes.attention_bytes counts (int64 ids). 2 gloo ranks."""

import pytest
import torch

from attention_reference import dense_reference, doc_ids
from longctx.job.spawn import run_spawned

DTYPES = ("int64", "int32", "int16", "uint8")


def _rank(world):
    from longctx.job import comm
    from longctx.job.dims import ParallelDims
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import shard_sequence
    from longctx.parallel.context.volumes import attention_bytes

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 2, 8, generator=gen) for _ in range(3))
    dout = torch.randn(2, 16, 2, 8, generator=gen)
    doc = doc_ids([[3, 5, 8], [1, 15]])
    ref_out, ref_grads = dense_reference(q, k, v, doc, dout)
    results = {}
    for head, ctx in ((1, 2), (2, 1)):
        mesh = ParallelDims(dp_shard=1, head=head, ctx=ctx, world_size=world).build_mesh("cpu")
        expected = attention_bytes(seq=16, batch=2, heads=2, kv_heads=2, head_dim=8, head=head, ctx=ctx, elem=4,
                                   docs=True, backward=False)
        for name in DTYPES:
            ql, kl, vl = (shard_sequence(t, mesh).requires_grad_() for t in (q, k, v))
            comm.reset_counters()
            local_doc = shard_sequence(doc.to(getattr(torch, name)), mesh)
            try:
                out = distributed_attention(ql, kl, vl, mesh, doc_ids=local_doc)
            except RuntimeError as e:
                results[(head, ctx, name)] = f"{type(e).__name__}: {e}"
                continue
            counted = comm.counters()
            grads = torch.autograd.grad((out * shard_sequence(dout, mesh)).sum(), (ql, kl, vl))
            err = max([(out.double() - shard_sequence(ref_out, mesh)).abs().max().item()]
                      + [(g.double() - shard_sequence(r, mesh)).abs().max().item() for g, r in zip(grads, ref_grads)])
            results[(head, ctx, name)] = (err, counted == expected, counted, expected)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(2, _rank, 2)


@pytest.mark.parametrize("name", DTYPES)
def test_document_ids_of_any_integer_type_attend_alike(name, per_rank):
    for rank, results in enumerate(per_rank):
        for (head, ctx, dtype), result in results.items():
            if dtype != name:
                continue
            assert not isinstance(result, str), f"rank {rank}, head {head} x ctx {ctx}, {dtype} ids: {result}"
            err, bytes_ok, counted, expected = result
            assert err < 1e-5, f"rank {rank}, head {head} x ctx {ctx}, {dtype} ids: error {err:.2e}"
            assert bytes_ok, f"rank {rank}, head {head} x ctx {ctx}, {dtype} ids: sent {counted}, counted {expected}"
