"""The process group's backend (job/launch.py backend_for). memory.model_states = host keeps FSDP2's
gradients in host memory (CPU offload), so the gradient norm's all-reduce under clipping runs on CPU
tensors, which NCCL cannot carry: on GPUs that tier's group has gloo for CPU tensors beside NCCL, as
FSDP2 asks of CPU offload (it would fail at the first clipped step of a multi-GPU host-tier run; one
rank's mesh skips the collective). The CUDA call is checked against torch's documented backend string."""

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from longctx.job import launch


@pytest.mark.parametrize("device, host, expected", [("cuda", True, {"cpu": "gloo", "cuda": "nccl"}),
                                                    ("cuda", False, {"cpu": "nccl", "cuda": "nccl"}),
                                                    ("cpu", True, {"cpu": "gloo", "cuda": "gloo"}),
                                                    ("cpu", False, {"cpu": "gloo", "cuda": "gloo"})])
def test_the_host_tier_on_gpus_has_gloo_for_cpu_tensors(device, host, expected):
    backend = launch.backend_for(device, host)
    got = BackendConfig(Backend(backend)).get_device_backend_map()
    assert {k: got.get(k, backend) for k in expected} == expected


def test_launched_and_one_rank_groups_are_made_with_it(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    monkeypatch.setattr(launch.torch.cuda, "set_device", lambda *a: None)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(launch.watchdog, "set_group_timeout", lambda s: None)
    monkeypatch.setattr(launch, "_CREATED", False)
    monkeypatch.setattr(launch.atexit, "register", lambda *a: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    launch.init_distributed("cuda", 60.0, host_states=True)
    launch.init_distributed("cuda", 60.0)
    launch.init_one_rank_group("cuda", host_states=True)
    assert made == ["cpu:gloo,cuda:nccl", "nccl", "cpu:gloo,cuda:nccl"]
