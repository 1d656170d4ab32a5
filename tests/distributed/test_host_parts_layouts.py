"""memory/host_parts.py's lists of host allocations under sequence layouts (2 gloo ranks): head 2 (the
attention output in sequence layout a tensor of its own, q/k/v in head layout) and ctx 2 (the ring's kept
state), against the allocations the real offloader and ChunkStore make (ops/chunked.py host_copy)."""

from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from longctx.config import MemoryConfig, load_config
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.memory import offload
from longctx.memory.host_parts import core_parts, offloaded_block_parts
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from longctx.ops import chunked
from longctx.parallel.context.sequence import attach_layout, plan_layout
from longctx.parallel.parallelize import apply_memory, use_sequence_parallel_attention

SEQ, LAYERS = 200, 3
# (recompute, fraction, block chunk, attention chunk, attention offload)
CASES = [("selective", 0.3, 0, 0, False), ("selective", 0.45, 16, 24, True), ("selective", 0.0, 0, 24, True),
         ("full", 0.3, 0, 0, False)]


def _logged(model, tok, pos, doc) -> dict:
    """{block: [nbytes of each host allocation its forward made]} of one forward and backward."""
    where, log, real = {"block": None}, defaultdict(list), chunked.host_copy
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda _m, _a, i=i: where.update(block=i))
        block.register_forward_hook(lambda *_a: where.update(block=None))
    offload.host_copy = chunked.host_copy = lambda t, s: log[where["block"]].append(t.nbytes) or real(t, s)
    try:
        model(tok, pos, doc, labels=tok).backward()
    finally:
        offload.host_copy = chunked.host_copy = real
    return dict(log)


def _rank(head, ctx):
    cfg = load_config(overrides=[f"--model.layers={LAYERS}", f"--parallel.head={head}", f"--parallel.ctx={ctx}",
                                 "--memory.loss_chunk=0"])
    dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    doc = torch.zeros_like(tokens)
    pos = torch.arange(SEQ).expand(1, SEQ)
    layout = plan_layout(doc, dims.ctx, dims.head)
    tok, p, d = (layout.shard(t, mesh) for t in (tokens, pos, doc))
    attach_layout(d, layout)
    out = []
    for recompute, fraction, bc, ac, ao in CASES:
        model = build_model(cfg.model, seed=0)
        use_sequence_parallel_attention(model, dims, mesh)
        mem = MemoryConfig(recompute=recompute, offload_fraction=fraction, block_chunk=bc, attention_chunk=ac,
                           attention_offload=ao, loss_chunk=0)
        apply_memory(model, mem, "cpu")
        log = _logged(model, tok, p, d)
        out.append(log)
    return cfg.model, out


@pytest.mark.slow
@pytest.mark.parametrize("head,ctx", [(2, 1), (1, 2)])
def test_listed_parts_under_a_sequence_layout(head, ctx):
    for m, logs in run_spawned(2, _rank, head, ctx):
        for (recompute, fraction, bc, ac, ao), log in zip(CASES, logs):
            policy = MemoryPolicy.from_config(MemoryConfig(recompute=recompute, offload_fraction=fraction,
                                                           block_chunk=bc, attention_chunk=ac, attention_offload=ao))
            kw = {"head": head, "ctx": ctx, "policy": policy, "p": 4}
            for i in range(LAYERS):
                if fraction > 0 and i < LAYERS - 1:
                    expected = offloaded_block_parts(m, SEQ, 1, **kw)
                elif policy.attention_offloaded and recompute != "full":
                    expected = core_parts(m, SEQ, 1, **kw)
                else:
                    expected = []
                got = log.get(i, [])[:1] if recompute == "full" else log.get(i, [])
                assert sorted(got) == sorted(expected), (recompute, fraction, bc, ac, ao, i)
