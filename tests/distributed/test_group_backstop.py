"""Every process group a training job builds waits the watchdog's backstop (watchdog.backend_timeout_s:
parallel.timeout_s + grace + 30 s), not torch's default: DeviceMesh gives the groups it creates torch's
default (gloo 30 min, NCCL 10 min), so with parallel.timeout_s raised past that, a hang in FSDP's, the
ring's or the experts' collectives was ended by the backend before the watchdog could say where each rank
was (docs/running.md). 4 gloo ranks, timeout_s 3600."""

import torch
import torch.distributed as dist

from longctx.job.spawn import run_spawned

TIMEOUT_S = 3600.0


def _timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _timeouts():
    from types import SimpleNamespace

    from longctx.config import load_config
    from longctx.job import comm, watchdog
    from longctx.job.dims import ParallelDims
    from longctx.job.runtime import Runtime
    from longctx.parallel.expert.call_tokens import MicroBatchTokens
    from longctx.parallel.expert.install import node_meshes
    from longctx.parallel.fsdp.shard import fsdp_mesh

    watchdog.set_group_timeout(TIMEOUT_S)  # (as init_distributed does for parallel.timeout_s = 3600)
    cfg = load_config(None, ["--parallel.head", "2", "--parallel.ctx", "2"])
    runtime = Runtime.create(cfg, dist.get_rank(), 4, "cpu")
    expert = ParallelDims(dp_shard=4, expert=2, world_size=4).build_expert_mesh("cpu")
    tokens = MicroBatchTokens(runtime.mesh, comm.flattened(runtime.mesh["dp_replicate", "dp_shard", "head", "ctx"],
                                                           "router"))
    meshes = {"fsdp_hsdp": fsdp_mesh(SimpleNamespace(world_size=4, dp_replicate=2), "cpu"),
              "fsdp": fsdp_mesh(SimpleNamespace(world_size=4, dp_replicate=1), "cpu"),
              "world": comm.world_mesh("cpu"), "layout": runtime.mesh, "runtime_world": runtime.world_mesh,
              "expert": expert, "expert_flat": expert["expert_data_expert"], "router": tokens.group,
              "moe_share": tokens.share, "moe_shares": tokens.shares,
              **dict(zip(("expert_node", "expert_local"), node_meshes(expert, 1)))}
    found = {f"{name}[{m.mesh_dim_names[d]}]": _timeout(m.get_group(d))
             for name, m in meshes.items() for d in range(m.ndim)}
    return found, watchdog.backend_timeout_s(TIMEOUT_S), dist.get_world_size()


def test_every_mesh_group_waits_the_watchdogs_backstop():
    found, wanted, world = run_spawned(4, _timeouts)[0]
    assert world == 4 and len(found) == 17
    assert {name: t for name, t in found.items() if t != wanted} == {}
