"""Ring attention keeps fp64 inputs in fp64, as the single-device kernels do (ops/attention.py stat_dtype).

The ring merged its blocks' partial outputs, log-sum-exps and gradients in accumulators fixed at fp32, so an
fp64 distributed attention silently agreed with the fp64 single-device one only to fp32 rounding (~1e-7):
an fp64 parity run (the one that tells a layout bug from rounding) could not see errors below that.
Here 2 gloo ranks (ctx 2; head 2 x ctx 1) against the fp64 math reference, to 1e-12: plain zigzag, packed
documents (segment plans), chunked blocks (memory.attention_chunk) and grouped-query heads."""

import torch

from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.ops.attention import attention
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.ring import simulate_ring
from longctx.parallel.context.sequence import plan_layout, shard_sequence

B, H, KV, D, SEQ = 2, 4, 2, 8, 24


def _inputs():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, SEQ, H, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, SEQ, KV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, SEQ, H, D, generator=gen, dtype=torch.float64)
    doc = torch.zeros(B, SEQ, dtype=torch.long)
    doc[0, 5:] += 1
    doc[0, 14:] += 1
    doc[1, 11:] += 1
    return q, k, v, dout, doc


def _errors(world):
    """Per case: (dtype of out, max |out - ref|, max |grad - ref grad| over q, k, v) on this rank."""
    q, k, v, dout, doc = _inputs()
    results = {}
    for head, ctx in ((1, 2), (2, 1)):
        mesh = ParallelDims(dp_shard=1, head=head, ctx=ctx, world_size=world).build_mesh("cpu")
        for docs in (False, True):
            for chunk in (0, 5):
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                ref, _ = attention(qr, kr, vr, causal=True, q_doc=doc if docs else None,
                                   k_doc=doc if docs else None, backend="math")
                ref_grads = torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))
                if docs:
                    layout = plan_layout(doc, ctx, head, balance="docs")
                    shard = lambda t, m=mesh, lay=layout: lay.shard(t, m)  # noqa: E731
                else:
                    layout, shard = None, lambda t, m=mesh: shard_sequence(t, m)  # noqa: E731
                ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                out = distributed_attention(ql, kl, vl, mesh, causal=True, doc_ids=shard(doc) if docs else None,
                                            layout=layout, attention_chunk=chunk, backend="math")
                grads = torch.autograd.grad((out * shard(dout)).sum(), (ql, kl, vl))
                results[head, ctx, docs, chunk] = (
                    str(out.dtype), (out - shard(ref)).abs().max().item(),
                    max((g - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)))
    return results


def test_fp64_ring_matches_fp64_reference_to_fp64_rounding():
    per_rank = run_spawned(2, _errors, 2)
    bad = [(rank, case, res) for rank, results in enumerate(per_rank) for case, res in results.items()
           if res[0] != "torch.float64" or res[1] > 1e-12 or res[2] > 1e-12]
    assert not bad, f"{len(bad)} cases off beyond fp64 rounding, e.g. (rank, (head, ctx, docs, chunk), " \
                    f"(dtype, out err, grad err)): {bad[:4]}"


def test_simulated_fp64_ring_keeps_fp64():
    """simulate_ring (the schedule in one process) merges like the ring: fp64 stays fp64."""
    q, k, v, dout, _ = _inputs()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention(qr, kr, vr, causal=True, backend="math")
    outs, lses, dqs, dks, dvs = simulate_ring(q, k, v, 3, causal=True, backend="math", dout=dout)
    assert all(lse.dtype == torch.float64 for lse in lses)
    ref_grads = torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))
    # shard the reference by the same zigzag positions the simulation used
    from longctx.parallel.context.sequence import shard_indices

    for rank in range(3):
        idx = shard_indices(SEQ, 3, 1, rank, 0)
        assert (outs[rank] - ref[:, idx]).abs().max().item() < 1e-12
        for got, want in zip((dqs[rank], dks[rank], dvs[rank]), ref_grads):
            assert (got - want[:, idx]).abs().max().item() < 1e-12
