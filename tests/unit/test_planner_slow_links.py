"""The planner over slow links (issue 50 item 4): CO2's exposed outer all-reduce and its state against hand
computations and against step/co2.py's real buffers; co2 chosen only when allowed; hpZ on a node's group
on three-level hardware; bytes per link level from bench comm's closed forms; co2 where none applies."""

import dataclasses
import math

import pytest
import torch.distributed as dist

from longctx.bench.comm_bytes import Unit, step_bytes
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.model_states import block_params, co2_state_bytes, param_counts
from longctx.costs.shape import MeshShape
from longctx.errors import ConfigError
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import estimate
from longctx.planner.link_report import report, why
from longctx.planner.output import plan_config, runnable
from longctx.planner.search import Request, candidate_shapes, plan
from longctx.planner.slow_links import co2_exposed_seconds, co2_local_steps, link_level_bytes

H100 = PRESETS["h100"]
BASE = load_config(None, {"model": {"preset": "llama3-8b"}})
M = BASE.model
SLOW = H100.replace(inter_gbps=5)  # 1/90 of NVLink
THREE = SLOW.replace(group_ranks=2, middle_gbps=28)  # a node's groups 1/16 of inside a group, 5.6x the nodes'


def _request(hw, gpus=32, seq=2**13, **kw):
    return Request(M, hw, gpus, seq, gpus_per_node=8, micro_batches=(1,), recomputes=("selective",),
                   model_states=("device",), **kw)


def test_co2_exposed_time_is_the_all_reduce_beyond_h_steps_of_compute():
    assert co2_exposed_seconds(10.0, 2.0, 4, H100) == pytest.approx((10.0 - 8.0) / 4)
    assert co2_exposed_seconds(10.0, 2.0, 8, H100) == 0.0
    assert co2_exposed_seconds(10.0, 2.0, 4, H100.replace(comm_overlap=0.0)) == pytest.approx(10.0 / 4)
    assert co2_local_steps(10.0, 2.0, H100, (2, 4, 8)) == 8       # the smallest H that hides it
    assert co2_local_steps(10.0, 3.0, H100, (2, 4, 8)) == 4
    assert co2_local_steps(100.0, 1.0, H100, (2, 4)) == 4         # none hides it: the least exposed


def test_co2_estimate_by_hand():
    """rep4 x dp8 on 4 nodes of 8 at 5 GB/s: each rank all-reduces its fp32 shard (P / 8) over 4 replicas,
    2 x 3/4 of it across nodes, once per H steps, under H steps of compute; no per-step replica gradients."""
    shape = MeshShape(dp_replicate=4, dp_shard=8, data_parallel="co2", local_steps=1)
    kw = {"seq_len": 2**13, "global_batch": 32, "gpus_per_node": 8}
    pol = MemoryPolicy("selective")
    co2, sync = estimate(M, SLOW, shape, pol, **kw), estimate(M, SLOW, MeshShape(4, 8), pol, **kw)
    allreduce = 2 * 3 / 4 * 4 * param_counts(M)["total"] / 8 / 5e9
    compute = co2.times["compute"]
    assert allreduce > compute > allreduce / 2  # H = 1 leaves some exposed, H = 2 hides it
    assert co2.times["exposed_co2_outer"] == pytest.approx(allreduce - compute)
    assert co2.step_s == pytest.approx(sum(v for k, v in co2.times.items() if k != "step"))
    h2 = estimate(M, SLOW, dataclasses.replace(shape, local_steps=2), pol, **kw)
    assert h2.times["exposed_co2_outer"] == 0.0
    assert estimate(M, SLOW, dataclasses.replace(shape, local_steps=0), pol, **kw).mesh_shape.local_steps == 2
    assert co2.times["exposed_fsdp"] < sync.times["exposed_fsdp"]  # the replicas' gradient all-reduce is gone
    assert co2.memory["co2_state"] == pytest.approx(3 * 4 * param_counts(M)["total"] / 8)
    assert co2.memory["total"] - sync.memory["total"] == pytest.approx(co2.memory["co2_state"])
    assert co2.comm_bytes["co2"]["co2_outer"] == pytest.approx(allreduce * 5e9)
    assert co2.comm_bytes["fsdp"]["fsdp"] < sync.comm_bytes["fsdp"]["fsdp"]


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_co2_state_bytes_equal_the_outer_syncs_buffers(one_rank_world, momentum):
    """A debug model's parameters as DTensors of a one-rank replica (its shard: every parameter), CO2's
    outer step built and one round ended (the change in flight received): its fp32 buffers' bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from longctx.models.llama import build_model
    from longctx.step.co2 import OuterSync

    cfg = load_config(None, {"model": {"preset": "debug"}}).model
    model = build_model(cfg)
    shards = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    replicas = init_device_mesh("cpu", (1,), mesh_dim_names=("replicate",))
    params = [distribute_tensor(p.detach(), shards, [Shard(0)]) for p in model.parameters()]
    sync = OuterSync(params, replicas, local_steps=2, lr=1.0, momentum=momentum, clip=0.0, penalty=0.0)
    sync.end_round()
    sync.end_round()  # the second round applies the first's change: momentum exists from here
    sync.finish()
    held = [sync.start, sync.anchor, sync.momentum, sync.arrived]
    measured = sum(t.numel() * t.element_size() for t in held if t is not None)
    shape = MeshShape(dp_replicate=2, data_parallel="co2", local_steps=2)
    assert co2_state_bytes(cfg, shape, outer_momentum=momentum > 0) == measured


def test_co2_is_chosen_on_a_slow_link_only_when_allowed():
    held = plan(_request(SLOW), explain=False)
    allowed = plan(_request(SLOW, allow=("co2",)), explain=False)
    assert held.best.mesh_shape.data_parallel == "sync"
    assert not any(e.mesh_shape.data_parallel == "co2" for e in held.ranked)
    assert held.co2_plans and held.co2_plans[0].step_s < 0.6 * held.best.step_s
    lines = why(held)
    assert any("not chosen: co2" in x and "--allow co2" in x and "convergence" in x for x in lines), lines
    best = allowed.best
    assert best.mesh_shape.data_parallel == "co2" and best.step_s == held.co2_plans[0].step_s
    assert any("co2 hides the replica all-reduce" in x and "convergence" in x for x in why(allowed))
    cfg = plan_config(best, allowed.request, BASE)
    assert (cfg.train.data_parallel, cfg.train.co2_local_steps) == ("co2", best.mesh_shape.local_steps)
    assert runnable(cfg, 32) == ""


def test_co2_on_fast_links_is_not_worth_it():
    """Inter-node at NVLink speed: the replicas' all-reduce costs nothing to hide, co2 saves nothing."""
    res = plan(_request(H100.replace(inter_gbps=450), allow=("co2",)), explain=False)
    assert res.best.mesh_shape.data_parallel == "sync"


def test_co2_allowed_on_one_node_says_why_none_applies():
    res = plan(_request(SLOW, gpus=8, allow=("co2",)), explain=False)
    assert res.best is not None and res.best.mesh_shape.data_parallel == "sync"
    assert any("none applies" in x and "one node" in x for x in why(res))
    with pytest.raises(ConfigError, match="--allow takes co2"):
        _request(SLOW, allow=("co3",))
    with pytest.raises(ConfigError, match="needs middle_gbps > 0"):
        _request(SLOW.replace(group_ranks=2))
    with pytest.raises(ConfigError, match="a group size dividing the 8 GPUs per node"):
        _request(THREE.replace(group_ranks=3))


def test_three_level_hardware_puts_hpz_on_a_group_and_says_why():
    res = plan(_request(THREE), explain=False)
    best = res.best.mesh_shape
    assert best.zero_pp == "hpz,qwz,qgz" and best.hpz_ranks == 2 and best.dp_replicate == 1, best.describe()
    node_level = [e for e in res.feasible if e.mesh_shape == dataclasses.replace(best, hpz_ranks=0)
                  and e.policy == res.best.policy]
    assert node_level and node_level[0].step_s > res.best.step_s
    assert any("parallel.hpz_ranks = 2" in x and "28 GB/s" in x for x in why(res))
    cfg = plan_config(res.best, res.request, BASE)
    assert (cfg.parallel.hpz_ranks, cfg.parallel.ranks_per_node) == (2, 8) and runnable(cfg, 32) == ""
    # the same cluster with two levels: no group to put hpZ on
    assert not any(s.hpz_ranks for s in candidate_shapes(_request(SLOW)))


def _units(world: int, node: int, hpz: int = 0) -> list[Unit]:
    blocks = [Unit(-(-p // world), -(-p // node), hpz_elements=-(-p // hpz) if hpz else 0) for p in block_params(M)]
    root = param_counts(M)["root"]
    return [*blocks, Unit(-(-root // world), -(-root // node), root=True)]


def test_bytes_per_level_are_bench_comms_closed_forms():
    """The chosen three-level plan's bytes per level equal step_bytes' three_level mode (bf16 gathers);
    only the node's inner levels differ from ZeRO++ on the node; co2 with a replica per node likewise."""
    res = plan(_request(THREE), explain=False)
    levels = report(res)["bytes_per_level"]
    assert levels == step_bytes("three_level", _units(32, 8, 2), 4, 8, group=2, hpz_ranks=2, gather_bytes=2)
    node = link_level_bytes(M, dataclasses.replace(res.best.mesh_shape, hpz_ranks=0), THREE, 8)
    assert node["inter_node_bytes"] == levels["inter_node_bytes"]
    assert levels["intra_group_bytes"] > node["intra_group_bytes"]
    co2 = MeshShape(dp_replicate=4, dp_shard=8, data_parallel="co2", local_steps=4)
    assert link_level_bytes(M, co2, SLOW, 8) == step_bytes("co2", _units(8, 8), 4, 8, local_steps=4, gather_bytes=2)
    assert math.isclose(sum(block_params(M)) + param_counts(M)["root"], param_counts(M)["total"])


def test_hsdp_bytes_per_level_by_hand():
    """2 replicas of 16 ranks (2 nodes each) on 4 nodes of 8: each replica's FSDP step as bench comm counts
    it on 2 x 8, its loss all-reduce replaced by one over all 32 ranks (sent 2 x 8 x 31 // 32 = 15 bytes by
    each, 4 ring hops across nodes), and per unit a fp32 all-reduce of the 16-rank shard e between the 2
    replicas on 16 rings whose both hops cross nodes (2 x 4 e x 1 // 2 bytes each)."""
    got = link_level_bytes(M, MeshShape(2, 16), SLOW, 8)
    one = step_bytes("fsdp", _units(16, 8), 2, 8, gather_bytes=2)
    replicas = 16 * sum(2 * (2 * 4 * u.elements // 2) for u in _units(16, 8))
    assert got["inter_node_bytes"] == 2 * (one["inter_node_bytes"] - 2 * 15) + 4 * 15 + replicas
    assert got["intra_node_bytes"] == 2 * (one["intra_node_bytes"] - 14 * 15) + 28 * 15
    assert got["intra_group_bytes"] == 0
    co2 = link_level_bytes(M, MeshShape(2, 16, data_parallel="co2", local_steps=2), SLOW, 8)
    outer = 2 * 4 * sum(u.elements for u in _units(16, 8)) // 2  # each rank's shard, 2 replicas
    assert co2["inter_node_bytes"] == 2 * (one["inter_node_bytes"] - 30) + 60 + 16 * 2 * 4 + 16 * 2 * outer // 2
    assert co2["inter_node_bytes"] < got["inter_node_bytes"]
    # co2 over replicas of half a node (8 of 4 ranks): each replica ring of 8 ranks crosses nodes 4 times and
    # stays inside one 4 times; the norm sends 2 x 4 x 7 // 8 = 7 bytes, the outer all-reduce 1/H of its shard's
    half = link_level_bytes(M, MeshShape(8, 4, data_parallel="co2", local_steps=4), SLOW, 8)
    inner = step_bytes("fsdp", _units(4, 4), 1, 4, gather_bytes=2)  # one replica's own FSDP, inside a node
    sent = 2 * 4 * sum(u.elements for u in _units(4, 4)) * 7 // 8
    assert half["inter_node_bytes"] == 4 * 15 + 4 * 4 * 7 + 4 * 4 * sent // 4
    assert half["intra_node_bytes"] == 8 * (inner["intra_node_bytes"] - 4 * 12) + 28 * 15 + 4 * 4 * 7 + 4 * sent
    assert link_level_bytes(M, MeshShape(dp_shard=16, expert=2), SLOW, 8) is None


def test_longctx_plan_allow_co2_writes_a_co2_config_and_says_why(tmp_path, capsys):
    """`longctx plan` on the slow cluster: without --allow the written plan stays sync and the text names
    co2 beside it; with --allow co2 the JSON explains the choice, gives bytes per level, and the plan
    written is co2's."""
    import json

    from longctx.cli import main as longctx_main

    args = ["plan", "--model", "llama3-8b", "--gpus", "32", "--seq-len", "8K", "--hardware", "h100", "--hw",
            "inter_gbps=5", "--micro-batch", "1", "--recompute", "selective", "--model-states", "device"]
    out = tmp_path / "sync.toml"
    assert longctx_main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "slow links: not chosen: co2" in printed and "slow links: bytes per link level, inter-node" in printed
    assert load_config(out).train.data_parallel == "sync"
    out = tmp_path / "co2.toml"
    assert longctx_main([*args, "--allow", "co2", "--json", "--out", str(out)]) == 0
    links = json.loads(capsys.readouterr().out)["slow_links"]
    assert any(line.startswith("co2 hides the replica all-reduce") for line in links["why"])
    assert 0 < links["bytes_per_level"]["inter_node_bytes"] < links["bytes_per_level"]["intra_node_bytes"]
    cfg = load_config(out)
    assert cfg.train.data_parallel == "co2" and cfg.train.co2_local_steps in (2, 4, 8)
    assert cfg.parallel.dp_replicate > 1
