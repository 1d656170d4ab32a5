"""The ring's block schedule in one process (simulate_ring) against one attention call."""

import pytest
import torch

from longctx.ops.attention import attention
from longctx.parallel.context.ring import simulate_ring
from longctx.parallel.context.sequence import shard_indices


@pytest.mark.parametrize("ctx, window", [(1, 0), (2, 0), (4, 0), (4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_simulated_ring_is_exact(ctx, window, causal):
    gen = torch.Generator().manual_seed(ctx)
    seq = 16 * ctx
    q = torch.randn(2, seq, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, seq, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, seq, 2, 8, generator=gen, requires_grad=True)
    dout = torch.randn(2, seq, 4, 8, generator=gen)
    ref, ref_lse = attention(q, k, v, causal=causal, backend="math")
    gq, gk, gv = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    outs, lses, dqs, dks, dvs = simulate_ring(q.detach(), k.detach(), v.detach(), ctx, window, causal, dout=dout)
    for rank in range(ctx):
        idx = shard_indices(seq, ctx, 1, rank, 0)
        torch.testing.assert_close(outs[rank], ref[:, idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lses[rank], ref_lse[:, :, idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dqs[rank], gq[:, idx], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dks[rank], gk[:, idx], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dvs[rank], gv[:, idx], atol=1e-4, rtol=1e-4)
