"""A sequence layout given with document ids whose fault is on ONE rank only (head 2 x ctx 2, 4 gloo ranks).

The ids beside a given layout are checked against it on each rank; a fault in one rank's ids used to stop that
rank alone while the others went on into the all-to-all and the ring and waited for it (a crash of the job
with gloo's "Connection closed by peer" on the other ranks, or a hang until NCCL's timeout). Every rank now
raises the same error, naming the faulty rank, before the attention sends a byte.
"""

import torch

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import plan_layout

B, S, H, D = 2, 32, 4, 8


def _case():
    mesh = ParallelDims(dp_shard=1, head=2, ctx=2, world_size=4).build_mesh("cpu")
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 9:] = 1
    doc[1, 20:] = 1
    layout = plan_layout(doc, 2, 2, balance="docs")
    g = torch.Generator().manual_seed(0)
    q, k, v = (layout.shard(torch.randn(B, S, H, D, generator=g), mesh) for _ in range(3))
    ids = layout.shard(doc, mesh)
    if (comm.local_rank(comm.sub_mesh(mesh, "ctx")), comm.local_rank(comm.sub_mesh(mesh, "head"))) == (1, 1):
        ids = ids.clone()
        ids[1, 2] += 7  # this rank's ids alone disagree with the layout
    comm.reset_counters()
    try:
        distributed_attention(q, k, v, mesh, doc_ids=ids, layout=layout)
    except ValueError as e:
        return str(e), comm.counters()
    return "no error", comm.counters()


def test_a_fault_in_one_ranks_ids_is_the_same_error_on_every_rank():
    results = run_spawned(4, _case, timeout=120)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("doc_ids do not match the sequence layout given with them: on context rank 1, "
                              "head rank 1 (1 of the 4 ranks' ids differ), at batch row 1, local token 2"), message
    assert all(not sent for _, sent in results), results  # refused before the attention's traffic


def _layouts_differ():
    """ctx 2: rank 1 plans its layout from other documents (its own ids its own layout's, so the ids check
    alone passes): under rank 0's layout every document stays on its rank (the ring is skipped), under
    rank 1's one straddles (the ring runs): without the check rank 0 returned while rank 1 waited in the ring."""
    mesh = ParallelDims(dp_shard=1, ctx=2, world_size=2).build_mesh("cpu")
    rank = comm.local_rank(comm.sub_mesh(mesh, "ctx"))
    doc = torch.zeros(1, S, dtype=torch.long)
    doc[0, S // 2:] = 1
    if rank == 1:
        doc[0, 4:] = 1  # another batch's documents
    layout = plan_layout(doc, 2, 1, balance="docs")
    g = torch.Generator().manual_seed(0)
    q, k, v = (layout.shard(torch.randn(1, S, H, D, generator=g), mesh) for _ in range(3))
    comm.reset_counters()
    try:
        distributed_attention(q, k, v, mesh, doc_ids=layout.shard(doc, mesh), layout=layout)
    except ValueError as e:
        return str(e), layout.documents_stay_on_their_rank, comm.counters()
    return "no error", layout.documents_stay_on_their_rank, comm.counters()


def test_layouts_that_differ_between_ranks_are_the_same_error_on_every_rank():
    results = run_spawned(2, _layouts_differ, timeout=120)
    assert [stay for _, stay, _ in results] == [True, False]  # (the case this test is for: the ring decided apart)
    messages = {message for message, _, _ in results}
    assert len(messages) == 1, messages
    assert messages.pop().startswith("the sequence layouts given with doc_ids differ between the ranks of the head "
                                     "x ctx group (the layouts of group ranks [1] are not rank 0's)")
    assert all(not sent for _, _, sent in results), results
