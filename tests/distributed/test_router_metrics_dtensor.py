"""train/router_metrics.py reads the routers' selection bias whatever holds it: a plain tensor (as
FSDP2 leaves buffers), a replicated DTensor (its local tensor), or a sharded one (gathered on every
rank, as every rank writes its metrics line): the same norms on every rank."""

import math
from types import SimpleNamespace

import torch

from longctx.job.spawn import run_spawned

BIAS = [[0.03, -0.04, 0.0, 0.0], [0.01, 0.01, -0.01, -0.01]]


def _norms_of_bias_dtensors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from longctx.train.router_metrics import RouterInterval

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name, placement in (("plain", None), ("replicated", Replicate()), ("sharded", Shard(0))):
        biases = [torch.tensor(b) if placement is None else distribute_tensor(torch.tensor(b), mesh, [placement])
                  for b in BIAS]
        interval = RouterInterval([1, 2], every=1,
                                  bias_layers=[SimpleNamespace(router=SimpleNamespace(expert_bias=b)) for b in biases])
        counts = torch.tensor([[2.0, 2, 2, 2], [1, 3, 2, 2]])
        stats = torch.ones(5)
        interval.add(1, stats, counts.max(1).values / counts.mean(1), counts, torch.tensor(True))
        out[name] = interval.record(1)["moe_bias_norm"]
    return out


def test_bias_norms_of_plain_replicated_and_sharded_buffers():
    want = [float(f"{math.hypot(*b):.4g}") for b in BIAS]
    for rank_result in run_spawned(2, _norms_of_bias_dtensors):
        assert rank_result == {"plain": want, "replicated": want, "sharded": want}
