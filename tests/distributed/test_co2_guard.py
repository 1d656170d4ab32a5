"""train.data_parallel = co2: each replica clips its own gradients, and the guard (train.on_nonfinite)
reads the largest of their norms (train/co2.py CO2Rounds.agreed_norm, a MAX all-reduce over the
replicas). A MAX all-reduce drops a NaN met after a number (gloo's max(1, NaN) is 1), so a replica whose
gradients went NaN while the global loss stayed finite passed the guard, applied its NaN update and
spread it to every replica at the next merge. Whichever replica holds it, the agreed norm is not finite."""

import math

from longctx.job.spawn import run_spawned


def _agreed(norms):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from longctx.train.co2 import CO2Rounds

    replicas = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("dp_replicate",))
    hook = CO2Rounds(None, replicas)
    return [float(hook.agreed_norm(torch.tensor(case[dist.get_rank()]))) for case in norms]


def test_one_replicas_nonfinite_gradient_norm_reaches_every_rank():
    nan, inf = float("nan"), float("inf")
    cases = [(1.0, nan), (nan, 1.0), (1.0, inf), (2.0, 3.0)]
    for rank in run_spawned(2, _agreed, cases):
        *bad, good = rank
        assert not any(math.isfinite(v) for v in bad), bad
        assert good == 3.0
