"""FlexMoE's copy slots (parallel.expert_replicas) reach the training-time memory figures: the preflight's host
budget (train/host_budget.py: on a CPU run device memory is host memory) and the automatic offload fraction's host
count (memory/auto.py) add each stored MoE call's `copy_slot_bytes` (measured to the byte in
tests/distributed/test_copies_mem107.py); before 2026-12-05 both counted a run with copies as one without."""

import pytest

from longctx.config import load_config
from longctx.job.checks import check_layout
from longctx.memory.accounting import estimate_activations
from longctx.memory.auto import choose_offload_fraction
from longctx.memory.moe_counts import copy_slot_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.train.host_budget import CPU_DEVICE, rank_host_bytes, run_shape

SEQ = 512


def _config(*overrides):
    return load_config(None, ["--model.preset=debug-moe", "--model.moe.dense_layers=", f"--train.seq_len={SEQ}",
                              "--train.device=cpu", "--train.global_batch=2", "--parallel.expert=2",
                              "--parallel.dp_shard=2", "--memory.recompute=none", *overrides])


def test_the_preflight_counts_the_copy_slots_of_every_stored_call():
    def device(replicas):
        cfg = _config(f"--parallel.expert_replicas={replicas}")
        dims = check_layout(cfg, 2)
        return rank_host_bytes(cfg, dims, "cpu", 2, 1e12)[CPU_DEVICE], cfg, run_shape(cfg, dims)

    plain, _, shape0 = device(0)
    copies, cfg, shape = device(2)
    assert shape0.expert_replicas == 0 and shape.expert_replicas == 2
    m = cfg.model
    rows = SEQ * m.moe_top_k  # one sequence per rank, one stored call per MoE block (recompute none)
    # (and the grouped GEMMs' int32 offsets over the 2 more slots, 3 x 4 B each)
    per_block = copy_slot_bytes(m, 4, 2, 2, rows, chunked=False) + 12 * 2
    assert per_block > 2 * 3 * m.dim * m.resolved_expert_dim * 4  # (more than the copies' weights)
    assert copies - plain == pytest.approx(m.layers * per_block)


def test_the_automatic_offload_fraction_counts_them_on_the_host():
    m = _config().model
    kw = dict(seq_len=SEQ * 8, micro_batch=1, head=1, ctx=1, skip_last=1, dtype_bytes=4, block_seconds=1.0,
              link_bytes_per_s=1e12, expert=2)
    policy = MemoryPolicy("selective", 1.0, 1)

    def offloaded(replicas):  # the rank's host tier at fraction 1
        return estimate_activations(m, SEQ * 8, 1, policy=policy, expert=2, expert_replicas=replicas).total_host
    assert offloaded(2) > offloaded(0)
    # a host budget that holds the offloaded blocks without copies at fraction 1, and not with 2 slots each
    budget = (offloaded(0) + offloaded(2)) / 2 / 0.8
    plain, _ = choose_offload_fraction(m, host_bytes_per_rank=budget, **kw)
    copies, why = choose_offload_fraction(m, host_bytes_per_rank=budget, expert_replicas=2, **kw)
    assert plain == 1.0 and copies < plain, why
