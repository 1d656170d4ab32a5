"""Document ids and the sequence layout they ride with, under ring attention (ctx 2, 2 gloo ranks).

The ring attends by the layout's documents, not by the ids tensor beside it, so (a) a layout kept on
an ids tensor must not outlive the ids (a buffer refilled in place for the next batch: the layout
planned from the gathered ids is planned again, one attached to the tokens' shards is refused), and
(b) a layout passed in with ids that are not its own (other documents, or ids sharded another way)
is refused before any communication, instead of attending by the wrong documents.
"""

import pytest
import torch

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.ops.attention import attention
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence

B, S, H, D = 2, 16, 2, 8


def _docs(*cuts_per_row):
    doc = torch.zeros(B, S, dtype=torch.long)
    for row, cuts in enumerate(cuts_per_row):
        for c in cuts:
            doc[row, c:] += 1
    return doc


FIRST, SECOND = _docs([8], [3]), _docs([5, 11], [1, 2, 15])


def _error(fn):
    """The message of the ValueError fn() raises ('no error' if none; 'communicated' if it talked first)."""
    comm.reset_counters()
    try:
        fn()
    except ValueError as e:
        return f"communicated before failing: {e}" if comm.counters() else str(e)
    return "no error"


def _cases():
    mesh = ParallelDims(dp_shard=1, head=1, ctx=2, world_size=2).build_mesh("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    ref = {name: attention(q, k, v, q_doc=d, k_doc=d, backend="math")[0] for name, d in
           (("first", FIRST), ("second", SECOND))}
    out = {}

    # (a) zigzag shards, no layout given: the one planned from the gathered ids must follow the ids
    ql, kl, vl = (shard_sequence(t, mesh) for t in (q, k, v))
    ids = shard_sequence(FIRST, mesh)
    first = distributed_attention(ql, kl, vl, mesh, doc_ids=ids)
    ids.copy_(shard_sequence(SECOND, mesh))  # the next batch, in the same buffer
    second = distributed_attention(ql, kl, vl, mesh, doc_ids=ids)
    out["reused_buffer"] = max((first - shard_sequence(ref["first"], mesh)).abs().max().item(),
                               (second - shard_sequence(ref["second"], mesh)).abs().max().item())

    # (a) a layout the tokens were sharded with (as local_batch attaches it), then the ids rewritten
    layout = plan_layout(FIRST, 2, 1, balance="docs")
    qd, kd, vd = (layout.shard(t, mesh) for t in (q, k, v))
    ids = attach_layout(layout.shard(FIRST, mesh), layout)
    out["attached_exact"] = (distributed_attention(qd, kd, vd, mesh, doc_ids=ids)
                             - layout.shard(ref["first"], mesh)).abs().max().item()
    ids.copy_(layout.shard(SECOND, mesh))
    out["attached_rewritten"] = _error(lambda: distributed_attention(qd, kd, vd, mesh, doc_ids=ids))

    # (b) a layout given with ids: its own ids work, others are refused
    given = layout.shard(FIRST, mesh)
    out["given_exact"] = (distributed_attention(qd, kd, vd, mesh, doc_ids=given, layout=layout)
                          - layout.shard(ref["first"], mesh)).abs().max().item()
    other = layout.shard(SECOND, mesh)
    out["given_other_documents"] = _error(lambda: distributed_attention(qd, kd, vd, mesh, doc_ids=other,
                                                                        layout=layout))
    zigzag_ids = shard_sequence(FIRST, mesh)
    out["given_other_sharding"] = _error(lambda: distributed_attention(qd, kd, vd, mesh, doc_ids=zigzag_ids,
                                                                       layout=layout))
    return out


@pytest.fixture(scope="module")
def results():
    return run_spawned(2, _cases)


def test_a_reused_ids_buffer_is_attended_by_its_new_documents(results):
    for rank in results:
        assert rank["reused_buffer"] < 1e-5, rank


def test_ids_rewritten_under_their_attached_layout_are_refused(results):
    for rank in results:
        assert rank["attached_exact"] < 1e-5, rank
        assert "changed in place after their sequence layout was attached" in rank["attached_rewritten"], rank


def test_a_layout_given_with_other_ids_is_refused_before_communicating(results):
    for rank in results:
        assert rank["given_exact"] < 1e-5, rank
        for case in ("given_other_documents", "given_other_sharding"):
            assert rank[case].startswith("doc_ids do not match the sequence layout"), (case, rank)
