"""Which process group each transfer of the 2D attention runs on (gloo processes).

NCCL serialises one communicator's operations, so transfers meant to overlap must not share a
group: Double-Ring's inner and outer transfers, and the Ulysses all-to-all apart from the ring and
from the job-wide groups (FSDP's, the metrics' world group). Both layouts run in one spawned job
(run_spawned_many), each on the groups of its own mesh.
"""

import pytest
import torch
import torch.distributed as dist

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned_many
from longctx.ops.attention import attention
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import shard_sequence

B, S, H, D = 1, 64, 4, 8


def _groups_of_attention(world, head, ctx, window):
    dims = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, world_size=world)
    mesh = dims.build_mesh("cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, D, generator=gen) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = attention(qr, kr, vr, causal=True, backend="math")[0]
    ref_grads = torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))
    ql, kl, vl = (shard_sequence(t, mesh).requires_grad_() for t in (q, k, v))
    comm.reset_counters()
    out = distributed_attention(ql, kl, vl, mesh, causal=True, window=window)
    grads = torch.autograd.grad((out * shard_sequence(dout, mesh)).sum(), (ql, kl, vl))
    err = max([(out - shard_sequence(ref, mesh)).abs().max().item()] +
              [(g - shard_sequence(r, mesh)).abs().max().item() for g, r in zip(grads, ref_grads)])
    # the groups others use: the default one, the mesh dims' own (shared: with head 1 and ctx = world,
    # DeviceMesh gives ctx the default group), FSDP's over dp_shard x head x ctx, the metrics' world
    others = {dist.group.WORLD.group_name, *(comm.group_name(comm.sub_mesh(mesh, d)) for d in ("head", "ctx")),
              comm.group_name(mesh["dp_shard", "head", "ctx"]._flatten("fsdp")),
              comm.group_name(mesh["dp_replicate", "dp_shard", "head", "ctx"]._flatten("world"))}
    return comm.groups_used(), err, others


@pytest.fixture(scope="module")
def spawned():
    """{layout: per-rank (groups used, max error, the groups others use)}, both layouts in one 4-rank job."""
    return run_spawned_many(4, [("double ring", _groups_of_attention, (4, 1, 4, 2)),
                                ("head2 x plain ring", _groups_of_attention, (4, 2, 2, 0))])


def test_double_ring_inner_and_outer_transfers_run_on_two_groups(spawned):
    for used, err, others in spawned["double ring"]:
        assert err < 1e-5
        ring = used["ctx"]
        # forward blocks, backward blocks and gradient accumulators: the inner hops on the ring lane,
        # the outer transfers on the ring_outer lane -- two groups, no more, none another user's
        for label in ("ring_kv", "ring_kv_bwd", "ring_dkv"):
            assert len(ring[label]) == 2, (label, ring)
        assert len({g for names in ring.values() for g in names}) == 2
        assert not others & {g for names in ring.values() for g in names}, (others, ring)


def test_plain_ring_uses_one_group_and_ulysses_its_own_none_shared(spawned):
    for used, err, others in spawned["head2 x plain ring"]:
        assert err < 1e-5
        ring = {g for names in used["ctx"].values() for g in names}
        ulysses = {g for names in used["head"].values() for g in names}
        assert len(ring) == 1 and len(ulysses) == 1  # a plain ring: one lane
        assert not ulysses & ring and not (ulysses | ring) & others, (ulysses, ring, others)
