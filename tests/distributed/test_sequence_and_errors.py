"""shard/unshard round trips and up-front errors, on 4 gloo processes (one spawned job for both)."""

import pytest
import torch
import torch.distributed as dist

from longctx.errors import ConfigError
from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned_many
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import shard_sequence, unshard_sequence


def roundtrip(world):
    out = []
    for head, ctx, placement in [(2, 2, "head-first"), (2, 2, "ctx-first"), (1, 4, "head-first"), (4, 1, "head-first")]:
        mesh = ParallelDims(dp_shard=1, head=head, ctx=ctx, placement=placement, world_size=world).build_mesh()
        x = torch.arange(2 * 32 * 3).reshape(2, 32, 3).float()
        pos = torch.arange(32).repeat(2, 1)
        local, local_pos = shard_sequence(x, mesh), shard_sequence(pos, mesh, seq_dim=1)
        # positions travel with their tokens: the token at local i came from global position local_pos[i]
        ok_pos = torch.equal(local[0, :, 0], x[0, local_pos[0], 0])
        out.append(ok_pos and torch.equal(unshard_sequence(local, mesh), x)
                   and torch.equal(unshard_sequence(shard_sequence(x, mesh, 2 - 1), mesh, 1), x))
    return out


def errors(world):
    mesh = ParallelDims(dp_shard=1, head=2, ctx=2, world_size=world).build_mesh()
    q = torch.randn(1, 8, 4, 8)
    kv = torch.randn(1, 8, 2, 8)
    cases = {
        "heads": (torch.randn(1, 8, 6, 8)[:, :, :3], torch.randn(1, 8, 3, 8), None, 0),
        "seq": (torch.randn(1, 7, 4, 8), torch.randn(1, 7, 2, 8), None, 0),
        "docs": (q, kv, torch.zeros(1, 5, dtype=torch.long), 0),
        "window": (q, kv, None, 3),
        "kv": (torch.randn(1, 8, 6, 8), torch.randn(1, 8, 3, 8), None, 0),
        "docs_reappear": (q, kv, torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]]), 0),
        # the fault in rank 3's shard alone (document 5 resumes after 6 there; the others' ids are
        # fine alone): every rank must fail,
        # not rank 3 alone while the others wait for it in the ids' gather
        "docs_one_rank": (q, kv, torch.tensor([[5, 6, 6, 5, 7, 7, 7, 7] if dist.get_rank() == 3 else [4] * 8]), 0),
        "layout_length": (q, kv, "layout", 0),
    }
    msgs = {}
    from longctx.parallel.context.sequence import plan_layout

    other = plan_layout(torch.zeros(1, 64, dtype=torch.long), 2, 2)  # built for 64 tokens, used for 32
    for name, (qq, kk, doc, window) in cases.items():
        comm.reset_counters()
        layout = other if isinstance(doc, str) else None
        doc = torch.zeros(1, 8, dtype=torch.long) if layout is not None else doc
        try:
            distributed_attention(qq, kk, kk, mesh, doc_ids=doc, window=window, layout=layout)
            msgs[name] = "no error"
        except (ConfigError, ValueError) as e:
            # (document ids are checked once gathered, alike on every rank: one gather of the ids)
            gathered_ids = name.startswith("docs_") and all(set(d) == {"unshard"} for d in comm.counters().values())
            msgs[name] = str(e) if not comm.counters() or gathered_ids else f"communicated before failing: {e}"
    with pytest.raises(ConfigError):
        shard_sequence(torch.zeros(1, 12), mesh)
    return msgs


@pytest.fixture(scope="module")
def spawned():
    """{"roundtrip": per-rank results, "errors": per-rank messages}, in one 4-rank job."""
    return run_spawned_many(4, [("roundtrip", roundtrip, (4,)), ("errors", errors, (4,))])


def test_shard_unshard_round_trip(spawned):
    for rank_result in spawned["roundtrip"]:
        assert all(rank_result)


def test_bad_inputs_fail_before_any_communication(spawned):
    msgs = spawned["errors"][0]
    assert not [m for m in msgs.values() if m.startswith(("communicated", "no error"))], msgs
    assert "not divisible by the head-parallel degree 2" in msgs["heads"]
    assert "not divisible by 2 x ctx x head = 8" in msgs["seq"]
    assert "doc_ids must be shaped like the tokens" in msgs["docs"]
    assert "window 3 must be 0 (plain ring) or divide" in msgs["window"]
    assert "3 key/value heads cannot be split over head-parallel degree 2" in msgs["kv"]
    assert "document id 0 reappears after another document" in msgs["docs_reappear"]
    for rank_msgs in spawned["errors"]:  # said by every rank, not by the one whose shard shows it
        assert "reappears after another document" in rank_msgs["docs_one_rank"], rank_msgs
    assert "layout was built for 1 x 64 tokens over ctx 2 x head 2, but it is used for 1 x 32" in msgs["layout_length"]


def test_layout_inputs_are_checked_without_a_mesh():
    """plan_layout is a pure function: bad document ids fail there, before any process talks."""
    import numpy as np

    from longctx.parallel.context.sequence import plan_layout

    with pytest.raises(ValueError, match=r"must be shaped \[batch, seq\]"):
        plan_layout(torch.zeros(64, dtype=torch.long), 2, 2)
    with pytest.raises(ValueError, match="document id 1 reappears"):
        plan_layout(torch.tensor([[1, 1, 2, 2, 1, 1, 3, 3]]), 2, 1)
    with pytest.raises(ConfigError, match="not divisible by 2 x ctx x head"):
        plan_layout(torch.zeros(1, 12, dtype=torch.long), 2, 2)
    layout = plan_layout(torch.from_numpy(np.repeat(np.arange(5), [3, 20, 1, 30, 10])[None]), 4, 2)
    rows = np.sort(layout.positions.reshape(-1))
    assert np.array_equal(rows, np.arange(64)) and layout.positions.shape == (1, 4, 2, 8)
