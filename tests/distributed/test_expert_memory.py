"""Expert parallelism's memory against the planner's count (gloo, 4 ranks):

- skew: with every token's first choice forced to expert 0, the most loaded rank of an expert-4
  group keeps, in each MoE block, the bytes `layer_activations(..., expert=4, expert_skew=its
  received rows over an even share)` counts (to the byte), in fp32 and under bf16 autocast over fp32
  weights (there the received rows' bf16 casts and intermediates, and autocast's copies of the rank's
  experts only: counted at 4 B and for every expert, 1.54x over before 2026-12-05), while the
  even-routing count would be far below what it holds;
- model states: what a rank holds of small-moe's parameters, gradients and AdamW state at expert 1
  and 4, under FSDP over the 4 ranks and under replication, against planner.model_states (with FSDP
  over every rank the states at rest are 1 / world at either degree: what expert parallelism
  saves there is the gathered working set, test_expert_parallel's sharded-not-copied test).
"""

import os

import pytest
import torch
import torch.distributed as dist
from test_training_parity import BASE

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.memory.accounting import layer_activations
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.parallel.context.shares import to_device
from longctx.train.trainer import Trainer

MOE = [*BASE, "--model.preset=debug-moe", "--train.steps=1"]
# the model-state test's model: debug-moe in the suite (the count is exact at any size); the issue's
# figure is small-moe's, about 5 minutes here: LONGCTX_EXPERT_MEMORY_PRESET=small-moe pytest ...
STATES_PRESET = os.environ.get("LONGCTX_EXPERT_MEMORY_PRESET", "debug-moe")


def _hot_rank_blocks(args, run_dir, bias, bf16=False):
    """Per MoE block of a bare (no FSDP) expert-parallel model: the bytes this rank holds for
    backward, its tokens, and the routed rows it receives (from every rank's expert counts). `bf16`: the
    forward under bf16 autocast over the fp32 weights (one GPU process of the device tier)."""

    from longctx.models.llama import build_model
    from longctx.models.moe import moe_layers
    from longctx.parallel.expert.install import use_expert_parallel
    from longctx.parallel.parallelize import apply_memory, use_sequence_parallel_attention

    cfg = load_config("configs/debug.toml", [*MOE, "--model.moe.dense_layers=", *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    rt = trainer.rt
    model = build_model(cfg.model, device="cpu", seed=0)
    use_sequence_parallel_attention(model, rt.dims, rt.mesh)
    use_expert_parallel(model, rt.dims.build_expert_mesh("cpu"))
    apply_memory(model, cfg.memory, "cpu")
    if bf16:  # (as step/loss.py runs a training forward; backward outside)
        forward = model.forward
        model.forward = lambda *a, **k: _autocast_call(forward, *a, **k)
    counts = []
    for layer in moe_layers(model):
        layer.router.expert_bias[0] = bias  # the selection's bias only: weights unchanged
        # (read on the host: a clone would be a tensor the block's forward made and something holds, 64 B counted)
        layer.experts.register_forward_hook(lambda mod, inputs, out: counts.append(inputs[1].tolist()))
    local = to_device(trainer.sampler.step_batches(1)[0][0], trainer.device)  # this rank's share
    trainer.sampler.close()
    held = measure_activations(model, local.tokens, local.positions, local.doc_ids, labels=local.labels)
    ep, rank = cfg.parallel.expert, dist.get_rank()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counts)
    group = range(rank - rank % ep, rank - rank % ep + ep)
    owned = len(counts[0]) // ep  # (each rank's experts, owner-major)
    received = [sum(sum(every[r][i][rank % ep * owned:(rank % ep + 1) * owned]) for r in group)
                for i in range(len(counts))]
    share = sum(c[0] for c in counts) / sum(sum(c) for c in counts)
    return [b["device"] for b in held["blocks"]], tuple(local.tokens.shape), received, share


def _autocast_call(fn, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def hot_runs(tmp_path_factory):
    """Both expert chunks, fp32 and under bf16 autocast, in one spawned job of 4 ranks."""
    root = tmp_path_factory.mktemp("skew")
    return run_spawned_many(4, [((chunk, bf16), _hot_rank_blocks,
                                 (["--parallel.expert=4", "--parallel.ctx=4", f"--memory.expert_chunk={chunk}"],
                                  str(root / f"{chunk}{bf16}"), 10.0, bf16))
                                for chunk in (0, 256) for bf16 in (False, True)])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("expert_chunk", [0, 256])
def test_the_most_loaded_expert_rank_holds_what_the_count_says(expert_chunk, bf16, hot_runs):
    """memory.expert_chunk 256: the experts' intermediates recomputed in pieces, the received rows kept. Under
    autocast the received rows' grouped GEMM casts and the intermediates are bf16 (as on one device)."""
    per_rank = hot_runs[expert_chunk, bf16]
    cfg = load_config("configs/debug.toml", [*MOE, "--model.moe.dense_layers="])
    m, k = cfg.model, cfg.model.moe_top_k
    hot = max(range(4), key=lambda r: sum(per_rank[r][2]))
    blocks, (rows_per_rank, local_len), received, share = per_rank[hot]
    assert share >= 0.45  # top-2: every token's first of its 2 choices is expert 0 (half of all choices)
    seq, tokens = local_len * 4, rows_per_rank * local_len
    policy = MemoryPolicy(expert_chunk=expert_chunk)
    kw = dict(ctx=4, policy=policy, dtype_bytes=4, expert=4, autocast=bf16)
    even = layer_activations(m, seq, rows_per_rank, **kw)
    for i, (got, rows) in enumerate(zip(blocks, received)):
        skew = rows / (tokens * k)
        want = layer_activations(m, seq, rows_per_rank, expert_skew=skew, **kw)[i].device
        print(f"block {i}: rank {hot} receives {rows} rows ({skew:.2f} x an even share); holds {got / 2**20:.2f} MiB, "
              f"counted {want / 2**20:.2f} MiB (even routing: {even[i].device / 2**20:.2f} MiB)")
        assert skew >= 1.9  # the skew is real: about twice an even share and more
        # exact (before 2026-12-05 the grouped GEMMs' offsets and the pieces' counts were counted over every expert,
        # not the rank's: within 1%)
        assert got == want, (i, got, want)
        assert got > 1.1 * even[i].device  # an even-routing count would not hold it


def _model_states(args, run_dir):
    """This rank's bytes of parameters, gradients (their shards' shapes) and AdamW state, after a step."""
    cfg = load_config("configs/debug.toml", [*BASE, f"--model.preset={STATES_PRESET}", "--train.steps=1",
                                             "--train.seq_len=64",
                                             *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    trainer.step(1)
    trainer.sampler.close()
    states = 0
    for p in trainer.model.parameters():
        states += 2 * local(p)  # the parameter and its gradient (the same shard)
        states += sum(local(v) for v in trainer.optimizer.state.get(p, {}).values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    return states


def test_model_states_under_expert_parallelism_against_the_planner(tmp_path):
    """A MoE preset on 4 ranks: the states a rank holds at rest at expert 1 and 4, with the experts
    fully sharded (dp_shard 4) or replicated (dp_replicate 4), each within 10% of the planner's."""
    from longctx.costs.model_states import predicted_model_state_bytes
    from longctx.costs.shape import MeshShape

    m = load_config(None, [f"--model.preset={STATES_PRESET}"]).model
    layouts = {"fsdp4": (["--parallel.dp_shard=4"], dict(dp_shard=4)),
               "replicate4": (["--parallel.dp_replicate=4", "--parallel.dp_shard=1"], dict(dp_replicate=4))}
    runs = run_spawned_many(4, [((name, ep), _model_states, ([*layout, f"--parallel.expert={ep}"],
                                                              str(tmp_path / f"{name}{ep}")))
                                for name, (layout, _) in layouts.items() for ep in (1, 4)])
    for name, (_, shape) in layouts.items():
        for ep in (1, 4):
            got = runs[name, ep]
            want = predicted_model_state_bytes(m, MeshShape(**shape, expert=ep))
            print(f"{name} expert {ep}: rank 0 holds {got[0] / 2**20:.1f} MiB of model states (planner "
                  f"{want / 2**20:.1f})")
            for states in got:
                assert abs(states - want) <= 0.10 * want, (name, ep, states, want)
        planned = [predicted_model_state_bytes(m, MeshShape(**shape, expert=ep)) for ep in (4, 1)]
        print(f"{name}: model states at expert 4 / expert 1 = {runs[name, 4][0] / runs[name, 1][0]:.3f} (planner "
              f"{planned[0] / planned[1]:.3f})")
