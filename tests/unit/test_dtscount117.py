"""The memory counts of a DTS-Gate run (moe.router dts) bound its first steps: the router routes every expert at
step 0 and anneals to top_k over moe.dts_steps (models/moe.py scheduled_experts), so the counts that bound peak
memory take experts per token at memory/peak_routing.py peak_top_k (E while the schedule runs), not top_k. Counted
at top_k, E 4 / top_k 1 at 48 tokens kept 229,492 B against 165,736 B counted (0.72x), and the planner and
memory.auto planned runs that could run out of memory in their first steps.

Measured as tests/unit/test_plancount_fuzz117.py measures the other routers (tests/plancount_fuzz117_count.py
saved_bytes: autograd's saved tensors and the router records, by storage and tier) and held to the same bytes
(SCALARS: the loss's few 0-d tensors), at step 0 for several E / top_k / memory policies; past the schedule the
router routes top_k and the count (which has no step) stays E's: an upper bound."""

import pytest
import torch

from longctx.config import ModelConfig
from longctx.job.runtime import Runtime
from longctx.memory.accounting import estimate_activations
from longctx.memory.policy import MemoryPolicy
from longctx.models.moe import DTSRouter
from longctx.train.model import build_llama_training
from plancount_fuzz117_count import config, saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

SCALARS = 32  # as tests/unit/test_plancount_fuzz117.py: the loss's 0-d tensors, not counted per token
TOKENS = 48


def _model_keys(experts: int, top_k: int, shared: bool = False) -> dict:
    keys = {"preset": "debug-moe", "dim": 24, "layers": 2, "heads": 2, "kv_heads": 2, "head_dim": 6, "ffn_dim": 30,
            "vocab_size": 37, "init_std": 0.2, "moe.experts": experts, "moe.top_k": top_k, "moe.expert_dim": 14,
            "moe.dense_layers": "0", "moe.aux_loss": 0.0, "moe.z_loss": 0.0, "moe.router": "dts",
            "moe.dts_steps": 10}
    if shared:
        keys.update({"moe.shared_experts": 1, "moe.shared_dim": 8, "moe.shared_gate": True})
    return keys


def _measure(cfg, step: int | None, bf16: bool = False) -> tuple[int, int, object]:
    rt = Runtime.create(cfg, 0, 1, "cpu")
    model = build_llama_training(cfg, torch.device("cpu"), rt, log=lambda *a, **k: None)
    for router in (r for r in model.modules() if isinstance(r, DTSRouter)):
        router.step = step
    tokens = torch.randint(0, cfg.model.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    device, host, _ = saved_bytes(model, tokens, tokens.clone(), bf16)
    est = estimate_activations(cfg.model, TOKENS, 1, policy=MemoryPolicy.from_config(cfg.memory), dtype_bytes=4,
                               autocast=bf16)
    return device, host, est


CASES = [
    (4, 1, False, {"recompute": "none"}, False),
    (4, 2, False, {"recompute": "none"}, False),
    (6, 2, True, {"recompute": "none"}, False),
    (5, 3, False, {"recompute": "full"}, False),
    (4, 1, True, {"recompute": "selective", "offload_fraction": 1.0, "offload_skip_last": 0}, False),
    (3, 1, False, {"recompute": "selective", "offload_fraction": 0.5, "offload_skip_last": 1}, False),
    (4, 2, False, {"recompute": "none", "expert_chunk": 16}, False),
    (4, 1, False, {"recompute": "none"}, True),
]


@pytest.mark.parametrize("experts,top_k,shared,memory,bf16", CASES)
def test_dts_counts_cover_step_zero(experts, top_k, shared, memory, bf16):
    """At step 0 every expert is routed: the count holds what autograd keeps, to the bytes the other routers meet."""
    cfg = config(_model_keys(experts, top_k, shared), memory, dtype="bf16" if bf16 else "fp32")
    device, host, est = _measure(cfg, step=0, bf16=bf16)
    what = f"E {experts} top_k {top_k} shared {shared} memory {memory} bf16 {bf16}"
    assert est.total_device >= device - SCALARS, f"{what}: {device} B held on the device, counted {est.total_device}"
    assert abs(device - est.total_device) <= SCALARS, f"{what}: {device} B held, counted {est.total_device}"
    assert abs(host - est.total_host) <= SCALARS, f"{what}: {host} B on the host, counted {est.total_host}"


@pytest.mark.parametrize("experts,top_k,expert_dim,chunk", [(4, 1, 80, 64), (3, 2, 120, 100)])
def test_an_expert_chunk_run_is_counted_at_its_largest_step(experts, top_k, expert_dim, chunk):
    """memory.expert_chunk runs a call's experts in checkpointed pieces past `chunk` routed rows: at step 0 (E rows a
    token) they are cut and keep no intermediates, at the schedule's end (top_k rows) they run whole and keep them,
    which is more here. The count is the largest over the schedule's steps (counted at E alone: 164,296 B against
    194,212 held at step 10 in the first case), to the bytes at the step that holds most."""
    keys = {**_model_keys(experts, top_k), "moe.expert_dim": expert_dim}
    cfg = config(keys, {"recompute": "none", "expert_chunk": chunk})
    held = [_measure(cfg, step) for step in range(11)]
    est = held[0][2]
    most = max(device for device, _, _ in held)
    assert abs(most - est.total_device) <= SCALARS, f"{most} B held at the largest step, counted {est.total_device}"
    assert held[0][0] < held[-1][0] - SCALARS  # (the case is one where a later step holds more than step 0)


def test_dts_past_its_schedule_is_still_bounded():
    """A resumed run past moe.dts_steps routes top_k; the count (no step) stays at E: above what is held."""
    cfg = config(_model_keys(4, 1), {"recompute": "none"})
    device, _, est = _measure(cfg, step=10)
    assert device < est.total_device - SCALARS


def test_peak_top_k_follows_the_schedule():
    from longctx.memory.peak_routing import peak_top_k

    base = dict(dim=16, ffn_dim=32, moe_experts=6, moe_top_k=2, moe_expert_dim=8)
    assert peak_top_k(ModelConfig(**base, moe_router="dts", moe_dts_steps=100)) == 6
    assert peak_top_k(ModelConfig(**base, moe_router="dts", moe_dts_steps=0)) == 2  # (top_k from step 0)
    assert peak_top_k(ModelConfig(**base, moe_router="softmax", moe_dts_steps=100)) == 2
