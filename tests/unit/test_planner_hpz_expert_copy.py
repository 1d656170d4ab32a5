"""parallel.zero_pp = hpz under expert parallelism: the routed experts are FSDP units of their own over
the expert-data group that keep plain resharding (parallel/fsdp/shard.py), so hpz's node-sharded copy
kept from forward to backward holds the dense blocks' weights only; the planner counted the experts too."""

from longctx.config import load_config
from longctx.costs.host_bytes import device_bytes, device_state_bytes, hpz_copy_bytes
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape


def _moe():
    return load_config(None, ["--model.preset=debug-moe"]).model


def test_hpz_copy_leaves_out_expert_units_under_expert_parallelism():
    m = _moe()
    pc = param_counts(m)
    shape = MeshShape(dp_shard=16, expert=8, zero_pp="hpz,qwz,qgz", node=8)
    assert hpz_copy_bytes(m, shape, 2) == (pc["total"] - pc["root"] - pc["experts"]) * 2 / 8


def test_hpz_copy_keeps_the_experts_inside_blocks_without_expert_parallelism():
    m = _moe()
    pc = param_counts(m)
    shape = MeshShape(dp_shard=16, expert=1, zero_pp="hpz,qwz,qgz", node=8)
    assert hpz_copy_bytes(m, shape, 2) == (pc["total"] - pc["root"]) * 2 / 8


def test_planner_gathered_term_under_hpz_and_expert_parallelism():
    m = _moe()
    pc = param_counts(m)
    shape = MeshShape(dp_shard=16, expert=8, zero_pp="hpz,qwz,qgz", node=8)
    plain = device_state_bytes(m, shape, "device", 2)["gathered_params"]
    memory = device_bytes(m, shape, "device", "step", 1, 2, 0.0, 0.0)
    assert memory["gathered_params"] - plain == (pc["total"] - pc["root"] - pc["experts"]) * 2 / 8
