"""Model-state bytes per rank against FSDP2's own shards where the FSDP group does not divide a tensor's dim 0.

FSDP2 (Shard(0)) cuts each parameter with torch.chunk over the group and pads every rank's shard to the
first chunk's rows, so the largest rank keeps ceil(rows / g) rows of each tensor. A MoE layer's routed
experts are [experts, ...] tensors: with fewer experts than FSDP ranks (no expert parallelism) each rank
keeps one whole expert of each, not experts / g of one; qwen3-30b-a3b on 24 ranks read 7.5% low, debug-moe
2.5x low (the planner fits a layout that then runs out of memory)."""

import pytest
import torch

from longctx.config import load_config
from longctx.costs.model_states import predicted_model_state_bytes
from longctx.costs.shape import MeshShape
from longctx.models.llama import build_model


def fsdp2_largest_shard_elements(model: torch.nn.Module, group: int) -> int:
    """Elements one rank keeps, from torch.chunk as FSDP2's Shard(0) cuts each parameter (padded to chunk 0)."""
    total = 0
    for p in model.parameters():
        first = torch.chunk(torch.empty(p.shape[0], device="meta"), group)[0].numel()
        total += first * (p.numel() // p.shape[0])
    return total


@pytest.mark.parametrize("preset,over,group", [
    ("debug-moe", {}, 24),          # 8 experts over 24 ranks: one padded expert each
    ("debug-moe", {}, 6),
    ("debug", {}, 7),               # dense: norms and small tensors padded too
    ("qwen3-30b-a3b", {"layers": 1}, 24),
])
def test_model_state_bytes_are_fsdp2_padded_shards(preset, over, group):
    m = load_config(None, {"model": {"preset": preset, **over}}).model
    real = 16 * fsdp2_largest_shard_elements(build_model(m, "meta"), group)
    assert predicted_model_state_bytes(m, MeshShape(dp_shard=group)) == real


def test_model_state_bytes_unchanged_where_the_group_divides():
    m = load_config(None, {"model": {"preset": "debug-moe"}}).model
    model = build_model(m, "meta")
    for group in (1, 2, 4, 8):
        assert predicted_model_state_bytes(m, MeshShape(dp_shard=group)) == \
            16 * fsdp2_largest_shard_elements(model, group)


@pytest.mark.parametrize("group", [3, 24])
def test_co2_averages_the_fullest_ranks_padded_shards(group):
    """CO2's fp32 buffers (step/co2.py OuterSync) are the shape of the rank's local shards: the fullest rank's
    are FSDP2's padded chunks, as its model states are."""
    from longctx.costs.model_states import co2_params

    m = load_config(None, {"model": {"preset": "debug-moe"}}).model
    shape = MeshShape(dp_replicate=2, dp_shard=group, data_parallel="co2", local_steps=2)
    assert shape.fsdp == group
    assert co2_params(m, shape) == fsdp2_largest_shard_elements(build_model(m, "meta"), group)
