"""Padding under the layouts: the loader's real-token mask (Batch.real) is sharded like the tokens (the
documents' layout, zigzag, data-parallel rows), and the MoE decisions over the micro-batch leave the
padding out on every rank (its choices travel as expert E, queued nowhere: models/moe_capacity.py), so
head 2 x ctx 2 and dp 2 x ctx 2 (4 ranks, fp32, gloo) record the statistics, drop the choices and give
the loss and gradients of one process holding the padded batch with its mask. A capacity binds hard (a
skewed router), with and without memory.block_chunk pieces; the Sinkhorn router's balanced assignment
runs over the real rows (padding rows are not kept, and out of its statistics)."""

import pytest
import torch
import torch.distributed as dist
from test_moe_capacity_layouts import ROUTINGS, _model, _parallel_model, _reduced, _step

from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned_many
from longctx.memory.apply_policy import apply_memory_policy
from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence

SEQ, BATCH, EOS = 128, 2, 257
REAL = (80, 121)  # each row's real tokens, the rest padding (as data/loader.py pads: at the row's end)
LAYOUTS = {"head2-ctx2-docs": (2, 2, True), "dp2-ctx2-zigzag": (1, 2, False)}  # (head, ctx, documents' layout)


def _batch(vocab):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    doc = torch.stack([(torch.arange(SEQ) >= 40).long() + (torch.arange(SEQ) >= REAL[0]).long(),
                       (torch.arange(SEQ) >= 70).long() + (torch.arange(SEQ) >= REAL[1]).long()])
    starts = [torch.tensor([0, 40, REAL[0]]), torch.tensor([0, 70, REAL[1]])]
    pos = torch.stack([torch.arange(SEQ) - starts[r][doc[r]] for r in range(BATCH)])
    real = torch.arange(SEQ)[None] < torch.tensor(REAL)[:, None]
    tokens[~real] = EOS
    labels[:, :-1][doc[:, 1:] != doc[:, :-1]] = -100
    labels[~real] = -100
    labels[:, -1] = -100
    return tokens, pos, doc, labels, real


def _reference(routing):
    cfg, model = _model(routing)
    if ROUTINGS[routing][2]:
        apply_memory_policy(model.layers, "selective", block_chunk=ROUTINGS[routing][2])
    tokens, pos, doc, labels, real = _batch(cfg.model.vocab_size)
    loss, terms = _step(model, tokens, pos, doc, labels, int((labels != -100).sum()), real=real)
    return loss, terms, {n: p.grad for n, p in model.named_parameters()}


def _rank_runs():
    out = {}
    for layout, (head, ctx, docs) in LAYOUTS.items():
        dims = ParallelDims(head=head, ctx=ctx, world_size=dist.get_world_size())
        mesh = dims.build_mesh("cpu")
        dp_rank = mesh["dp_shard"].get_local_rank()
        for routing in ROUTINGS:
            cfg, model = _parallel_model(routing, dims, mesh)
            full = _batch(cfg.model.vocab_size)
            valid = int((full[3] != -100).sum())
            rows = BATCH // dims.dp_shard
            mine = [t[dp_rank * rows:(dp_rank + 1) * rows] for t in full]
            if docs:
                plan = plan_layout(mine[2], ctx, head, balance="docs")
                tokens, pos, doc, labels, real = (plan.shard(t, mesh) for t in mine)
                attach_layout(doc, plan)
            else:
                tokens, pos, doc, labels, real = (shard_sequence(t, mesh) for t in mine)
            loss, terms = _step(model, tokens, pos, doc, labels, valid, real=real)
            out[(layout, routing)] = _reduced(model, loss, terms)
    return out


@pytest.fixture(scope="module")
def model_runs():
    return run_spawned_many(4, [("model", _rank_runs, ())])["model"]


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padding_is_left_out_alike_under_every_layout(model_runs, layout, routing):
    ref_loss, ref_terms, ref_grads = _reference(routing)
    real_tokens = sum(REAL)
    # the statistics count the real tokens only: every one has top_k choices, per layer
    assert torch.equal(ref_terms.counts.sum(1), torch.full_like(ref_terms.counts[:, 0], 2.0 * real_tokens))
    if "pieces" not in routing and "sinkhorn" not in routing:
        assert ref_terms.dropped.sum() > 0.2 * ref_terms.counts.sum()  # (the capacity binds hard)
    for rank in model_runs:
        loss, counts, dropped, stats, grads = rank[(layout, routing)]
        assert torch.equal(torch.from_numpy(counts), ref_terms.counts), (layout, routing)
        assert torch.equal(torch.from_numpy(dropped), ref_terms.dropped), (layout, routing, dropped, ref_terms.dropped)
        torch.testing.assert_close(torch.from_numpy(stats), ref_terms.stats, rtol=1e-5, atol=1e-6)
        assert abs(loss - float(ref_loss)) <= 1e-5, (layout, routing, loss, float(ref_loss))
        for name, ref in ref_grads.items():
            torch.testing.assert_close(torch.from_numpy(grads[name]), ref, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{layout} {routing} {n}: {m}")
