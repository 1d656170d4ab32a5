"""Chunked attention core under 2D sequence parallelism (4 gloo ranks): every ring block in chunks.

Against the same layout without chunks (fp32, to 1e-5): attention outputs and gradients for
head 2 x ctx 2, a plain ring of 4 and Double-Ring (ctx 4, windows of 2), with and without packed
documents (in a docs-balanced sequence layout), grouped-query attention and host offload of the
ring's kept state; then a model's gradients under every recompute policy at head 2 x ctx 2.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from longctx.config import load_config
from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.models.llama import build_model
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence
from longctx.parallel.parallelize import apply_memory, use_sequence_parallel_attention

B, H, D, SEQ = 2, 8, 16, 256
LAYOUTS = [(2, 2, 0), (1, 4, 0), (1, 4, 2), (4, 1, 0)]  # head, ctx, window
# (kv heads, documents, chunk, offload); chunks that do and do not divide a rank's tokens
CASES = [(8, False, 16, False), (2, False, 24, True), (2, True, 16, False), (1, True, 40, True), (4, True, 7, False)]
POLICIES = [("none", 0.0), ("full", 0.0), ("selective", 0.0), ("selective", 0.5), ("full", 1.0)]


def _docs(seq):
    doc = torch.zeros(B, seq, dtype=torch.long)
    for c in (1, 2, 37, seq // 2 + 3, seq - 1):
        doc[0, c:] += 1
    doc[1, 100:] = 1
    return doc


def _attention_cases():
    results = []
    for head, ctx, window in LAYOUTS:
        mesh = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, world_size=4).build_mesh("cpu")
        for kv, docs, chunk, offload in CASES:
            gen = torch.Generator().manual_seed(7 + kv + chunk)
            q, k, v = (torch.randn(B, SEQ, n, D, generator=gen) for n in (H, kv, kv))
            dout = torch.randn(B, SEQ, H, D, generator=gen)
            layout = plan_layout(_docs(SEQ), ctx, head, balance="docs") if docs else None
            shard = ((lambda t, layout=layout, mesh=mesh: layout.shard(t, mesh)) if docs
                     else (lambda t, mesh=mesh: shard_sequence(t, mesh)))
            doc = shard(_docs(SEQ)) if docs else None
            runs = []
            for c, off in ((0, False), (chunk, offload)):
                ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                comm.reset_counters()
                out = distributed_attention(ql, kl, vl, mesh, causal=True, doc_ids=doc, window=window, layout=layout,
                                            attention_chunk=c, attention_offload=off)
                grads = torch.autograd.grad((out * shard(dout)).sum(), (ql, kl, vl))
                runs.append((out.detach(), grads, comm.counters()))
            (o0, g0, c0), (o1, g1, c1) = runs
            results.append(((head, ctx, window, kv, docs, chunk, offload), (o1 - o0).abs().max().item(),
                            max((a - b).abs().max().item() for a, b in zip(g1, g0)), c1 == c0))
    return results


def _batch(vocab):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, 128), generator=g)
    labels = torch.randint(0, vocab, (B, 128), generator=g)
    labels[:, ::7] = -100
    doc = _docs(128)
    starts = {}
    pos = torch.zeros_like(doc)
    for r in range(B):
        for i in range(128):
            starts.setdefault((r, int(doc[r, i])), i)
            pos[r, i] = i - starts[(r, int(doc[r, i]))]
    return tokens, pos, doc, labels


def _model_grads():
    cfg = load_config(overrides=["--model.layers=2", "--parallel.head=2", "--parallel.ctx=2", "--memory.loss_chunk=0"])
    dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    base = build_model(cfg.model, seed=3)
    full = _batch(cfg.model.vocab_size)
    valid = int((full[3] != -100).sum())
    layout = plan_layout(full[2], dims.ctx, dims.head, balance="docs")
    tokens, pos, doc, labels = (layout.shard(t, mesh) for t in full)
    attach_layout(doc, layout)
    worst = {}
    for policy, fraction in POLICIES:
        grads = []
        for chunk, offload in ((0, False), (24, fraction == 0.0)):
            model = copy.deepcopy(base)
            use_sequence_parallel_attention(model, dims, mesh)
            mem = cfg.memory
            mem.recompute, mem.offload_fraction, mem.attention_chunk, mem.attention_offload = policy, fraction, chunk, \
                offload
            apply_memory(model, mem, "cpu")
            (model(tokens, pos, doc, labels=labels, loss_reduction="sum") / valid).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        worst[(policy, fraction)] = max((grads[1][n] - grads[0][n]).abs().max().item() for n in grads[0])
    return worst


def _rank_run():
    return _attention_cases(), _model_grads()


@pytest.fixture(scope="module")
def runs():
    return run_spawned(4, _rank_run)


def test_chunked_ring_blocks_match_unchunked(runs):
    failures = [f"{case}: out {o:.2e} grad {g:.2e} comm {'same' if same else 'DIFFERS'}"
                for attention_results, _ in runs for case, o, g, same in attention_results
                if o > 1e-5 or g > 1e-5 or not same]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("policy,fraction", POLICIES)
def test_model_gradients_match_without_attention_chunks(runs, policy, fraction):
    for _, worst in runs:
        assert worst[(policy, fraction)] <= 1e-5, worst
