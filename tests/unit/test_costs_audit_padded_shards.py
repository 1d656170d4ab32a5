"""Model-state bytes per rank against FSDP2's own shards where the FSDP group does not divide a tensor's dim 0.

FSDP2 cuts each parameter with torch.chunk over the group on its placement's dim and pads every rank's shard to
the first chunk, so the largest rank keeps ceil(n / g) of that dim. A MoE layer's routed experts are
[experts, ...] tensors: with fewer experts than FSDP ranks (no expert parallelism) dim 0 would leave each rank
one whole expert of each, not experts / g of one, so those are sharded on a dim the group divides
(costs/model_states.py shard_dim; tests/distributed/test_even_expert_shards.py checks FSDP2 itself). Elsewhere
the padding stays and is counted: qwen3-30b-a3b on 24 ranks read 7.5% low without it, debug-moe 2.5x low (the
planner fits a layout that then runs out of memory)."""

import pytest
import torch

from longctx.config import load_config
from longctx.costs.model_states import param_counts, predicted_model_state_bytes, shard_dim
from longctx.costs.shape import MeshShape
from longctx.models.llama import build_model


def fsdp2_largest_shard_elements(model: torch.nn.Module, group: int) -> int:
    """Elements one rank keeps, from torch.chunk as FSDP2 cuts each parameter on its placement's dim (padded to
    chunk 0)."""
    total = 0
    for p in model.parameters():
        d = shard_dim(tuple(p.shape), group)
        first = torch.chunk(torch.empty(p.shape[d], device="meta"), group)[0].numel()
        total += first * (p.numel() // p.shape[d])
    return total


def test_moe_experts_over_more_ranks_than_experts_are_the_even_share():
    """qwen3-30b-a3b (128 experts a layer) over 512 FSDP ranks: on dim 0 each rank kept one padded expert of
    each of 48 layers' w1/w3/w2 (3.4 GiB of states a rank); sharded on a dim 512 divides, the states are the
    even share, 16 bytes x parameters / 512, within what the small tensors' padding adds (under 1%)."""
    m = load_config(None, {"model": {"preset": "qwen3-30b-a3b"}}).model
    shape = MeshShape(dp_shard=32, ctx=16)
    even = 16 * param_counts(m)["total"] / 512
    assert even <= predicted_model_state_bytes(m, shape) <= 1.01 * even


@pytest.mark.parametrize("dims,group,dim", [
    ((128, 768, 2048), 512, 2),   # qwen3-30b-a3b's w1 over 512 ranks: 768 is not a multiple of 512, 2048 is
    ((128, 2048, 768), 512, 1),   # its w2
    ((128, 2048), 512, 1),        # its router's gate
    ((128, 768, 2048), 24, 0),    # 128 over 24: 6 rows a rank, 1.125x the even share: dim 0 stays
    ((3, 128, 128), 2, 1),        # 2 of 3 rows on one rank: 1.33x
    ((3, 127), 2, 0),             # no dim the group divides: dim 0, padded
    ((10,), 4, 0),                # one dim: nothing else to shard
    ((8, 64), 8, 0),              # divisible: dim 0
])
def test_shard_dim(dims, group, dim):
    assert shard_dim(dims, group) == dim


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
