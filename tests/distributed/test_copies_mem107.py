"""FlexMoE's copy slots (parallel.expert_replicas, parallel/expert/placement.py) against the memory count (gloo, 2
ranks, debug-moe at expert 2: 4 experts a rank, one 196,608 B in fp32): every MoE block of a rank whose copy slots
are all filled keeps, for backward, exactly what `layer_activations(..., expert_replicas=R)` counts, at 0, 1 and 2
slots, under recompute none (the call's saved tensors kept: the copy slots' weights, the slot order),
selective (the feed-forward recomputed: nothing more), selective with offload (the stored calls' on the host), bf16
autocast and memory.expert_chunk. Before 2026-12-05 the count knew nothing of the slots: 1,195,996 B a block short at
1 slot and 1,589,224 B at 2 under recompute none (rank 0, block 0), and it counted the grouped GEMMs' offsets over
every expert, not the rank's (48 B a block over at 0 slots). Until 2026-12-05 the own experts and the copies ran
as one grouped GEMM over weights joined into new tensors, which it saved, and the fetched copies were kept once
more: 7,211,188 / 7,480,768 B at 1 / 2 slots (rank 0, block 0, recompute none), 6,228,148 / 6,301,120 B since
they run apart (parallel/expert/placement.py own_and_copy_experts), against 5,664,808 B without copies.
"""

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
from longctx.parallel.expert.placement import Placement
from longctx.planner.validate_experts import every_slot_filled
from longctx.train.trainer import Trainer

MOE = [*BASE, "--model.preset=debug-moe", "--train.steps=1", "--model.moe.dense_layers=", "--parallel.expert=2",
       "--parallel.ctx=2"]


def _blocks(args, run_dir, replicas, bf16=False):
    """Per MoE block of a bare (no FSDP) expert-parallel model with `replicas` copy slots every one filled (0: the
    static placement): the bytes this rank holds for backward, its tokens' shape, and (its rows, the routed rows it
    receives) in the block's first call. `bf16`: the forward under bf16 autocast over the fp32 weights."""
    from longctx.models.llama import build_model
    from longctx.models.moe import moe_layers
    from longctx.parallel.expert.install import use_expert_parallel
    from longctx.parallel.parallelize import apply_memory, use_sequence_parallel_attention

    cfg = load_config("configs/debug.toml", [*MOE, *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    rt = trainer.rt
    model = build_model(cfg.model, device="cpu", seed=0)
    use_sequence_parallel_attention(model, rt.dims, rt.mesh)
    use_expert_parallel(model, rt.dims.build_expert_mesh("cpu"))
    apply_memory(model, cfg.memory, "cpu")
    if bf16:  # (as step/loss.py runs a training forward)
        forward = model.forward
        model.forward = lambda *a, **k: _autocast_call(forward, *a, **k)
    ep, E = cfg.parallel.expert, cfg.model.moe_experts
    placement = every_slot_filled(E, ep, replicas) if replicas else Placement.static(E, ep)
    first = {}  # block -> its first call's rows per expert (the stored one where a policy splits the block's calls)

    def seen(i):
        def hook(mod, inputs, out):
            first.setdefault(i, inputs[1].tolist())
        return hook
    for i, layer in enumerate(moe_layers(model)):
        layer.experts.placement = placement if replicas else None
        layer.experts.register_forward_hook(seen(i))
    local = to_device(trainer.sampler.step_batches(1)[0][0], trainer.device)  # this rank's share
    trainer.sampler.close()
    # (forward only: a backward's recomputed calls would be seen too)
    held = measure_activations(model, local.tokens, local.positions, local.doc_ids, labels=local.labels, backward=False)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [first[i] for i in range(len(first))])
    rank, slots = dist.get_rank() % ep, placement.slots
    # that call's routed rows on this rank (its tokens x top_k) and the slot rows the rank receives in it
    calls = [(sum(counts), sum(sum(placement.slot_counts(every[r][i])[rank * slots:(rank + 1) * slots])
                               for r in range(ep))) for i, counts in enumerate(every[dist.get_rank()])]
    return held["blocks"], tuple(local.tokens.shape), calls


def _autocast_call(fn, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args, **kwargs)


# name: (arguments, bf16 autocast, the policy counted)
CASES = {"none": (["--memory.recompute=none"], False, MemoryPolicy("none")),
         "selective": (["--memory.recompute=selective"], False, MemoryPolicy("selective")),
         # the first 3 of 4 blocks offloaded, half their tokens' calls stored: the copy slots' bytes on the host
         "selective-offload": (["--memory.recompute=selective", "--memory.offload_fraction=0.5"], False,
                               MemoryPolicy("selective", 0.5)),
         # the copy slots' bf16 casts saved (the own experts' casts are autocast's weight copies, as without copies)
         "none-autocast": (["--memory.recompute=none"], True, MemoryPolicy("none")),
         # the experts in checkpointed pieces: the pieces hold the copy slots' fp32 weights as their input
         "none-expert-chunk": (["--memory.recompute=none", "--memory.expert_chunk=256"], False,
                               MemoryPolicy("none", expert_chunk=256))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case in one spawned job of 2 ranks."""
    root = tmp_path_factory.mktemp("copies")
    return run_spawned_many(2, [((name, r), _blocks, (args, str(root / f"{name}{r}"), r, bf16))
                                for name, (args, bf16, _) in CASES.items() for r in (0, 1, 2)])


@pytest.mark.parametrize("policy", list(CASES))
@pytest.mark.parametrize("replicas", [0, 1, 2])
def test_a_rank_with_its_copy_slots_filled_holds_what_the_count_says(replicas, policy, runs):
    """Exact wherever the rank receives at least an even share of rows (the count's skew is at least 1: a rank
    receiving fewer is counted at the even share, a bound). 0: the static placement, exact as well (its grouped
    GEMMs' offsets over the rank's experts, not over every expert: 48 B a block over before)."""
    m = load_config("configs/debug.toml", MOE).model
    exact = 0
    for rank in range(2):
        blocks, (rows_per_rank, local_len), received = runs[policy, replicas][rank]
        static = runs[policy, 0][rank][0]
        seq = local_len * 2
        _, bf16, counted = CASES[policy]
        kw = dict(ctx=2, policy=counted, dtype_bytes=4, expert=2, expert_replicas=replicas, autocast=bf16)
        for i, (got, (own, rows)) in enumerate(zip(blocks, received)):
            skew = rows / own
            want = layer_activations(m, seq, rows_per_rank, expert_skew=skew, **kw)[i]
            want = {"device": want.device, "host": want.host}
            if policy.startswith("none"):
                # the fetch's two int64 indices, sent and received (8 B x replicas each), are made from host lists
                # (torch.tensor), not by an op: memory/measured.py sees them only where the offloader copies them
                # to the host (the offload case: exact)
                want["device"] -= 16 * replicas
            print(f"{policy}, {replicas} slot(s), rank {rank} block {i} (skew {skew:.2f}): holds {got} B "
                  f"({got['device'] - static[i]['device']:+,} device, {got['host'] - static[i]['host']:+,} host over "
                  f"the static placement), counted {want}")
            if skew >= 1:
                exact += 1
                assert got == want, (rank, i, skew, got, want)
            else:
                assert got["device"] <= want["device"] and got["host"] <= want["host"], (rank, i, skew, got, want)
    assert exact >= 2  # (the routing gives both kinds of rank)
