"""costs/host_bytes.py: each memory.model_states tier's device and host bytes, host-link traffic and
host AdamW time, and a rank's host memory by part (issue 49 item 3)."""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.costs.host_bytes import (
    TIERS,
    data_loader_bytes,
    device_state_bytes,
    exposed_host_state_seconds,
    host_link_bytes,
    host_state_bytes,
    predicted_host_bytes,
)
from longctx.costs.model_states import gathered_param_bytes, param_counts, predicted_model_state_bytes
from longctx.costs.shape import MeshShape


def model(preset="small-100m"):
    return load_config(None, {"model": {"preset": preset}}).model


@pytest.mark.parametrize("shape", [MeshShape(), MeshShape(1, 2, 2, 2)])
def test_tiers_split_the_16_bytes_between_device_and_host(shape):
    m = model()
    pc = param_counts(m)
    n = predicted_model_state_bytes(m, shape) / 16
    device = device_state_bytes(m, shape, "device", 2)
    assert device == {"model_states": 16 * n, "gathered_params": gathered_param_bytes(m, shape, 2)}
    opt = device_state_bytes(m, shape, "host_optimizer", 2)
    host = device_state_bytes(m, shape, "host", 2)
    if shape.world == 1:  # no FSDP: weights, and one block's gradients on the way to the host
        assert opt == {"model_states": 4 * n + 4 * pc["block"], "gathered_params": 0.0}
    else:  # the shards' gradients wait for the step
        assert opt["model_states"] == 8 * n and opt["gathered_params"] == device["gathered_params"] > 0
    # host: only FSDP's gathers on the device, at world 1 too (a one-rank FSDP group)
    assert host["model_states"] == 0
    assert host["gathered_params"] == 2 * pc["block"] * 2 + 4 * pc["block"] + pc["root"] * (2 + 4)
    assert [host_state_bytes(m, shape, t) for t in TIERS] == [0, 16 * n, 16 * n]


def test_link_traffic_and_host_adam_time():
    m, shape, hw = model(), MeshShape(), get_hardware("h100")
    n = predicted_model_state_bytes(m, shape) / 16
    assert host_link_bytes(m, shape, "device", 1) == {}
    assert host_link_bytes(m, shape, "host_optimizer", 2) == {"down": 8 * n, "up": 4 * n}
    assert host_link_bytes(m, shape, "host", 1) == {"down": 4 * n, "up": 8 * n}
    # several ranks: the gradients reach the host once a step unless reduced every micro-batch
    fsdp2, n2 = MeshShape(1, 2), predicted_model_state_bytes(m, MeshShape(1, 2)) / 16
    assert host_link_bytes(m, fsdp2, "host", 3) == {"down": 4 * n2, "up": 24 * n2}
    assert host_link_bytes(m, fsdp2, "host", 3, "micro_batch") == {"down": 12 * n2, "up": 24 * n2}
    assert host_link_bytes(m, fsdp2, "host_optimizer", 3) == {"down": 4 * n2, "up": 4 * n2}
    assert exposed_host_state_seconds(m, shape, "device", hw, 1, 1.0, 2.0, 1) == {"host_link": 0.0, "host_adam": 0.0}
    adam = n / (hw.host_adam_gparams_per_s * 1e9)
    up = 4 * n / (hw.host_link_gbps * 1e9)
    # world 1: a long backward hides the gradients going down, the next forward the update and the upload
    t = exposed_host_state_seconds(m, shape, "host_optimizer", hw, 1, 100.0, 200.0, 1)
    assert t == {"host_link": 0.0, "host_adam": 0.0}
    # a forward shorter than the update: what it does not hide is exposed, the upload after it too
    t = exposed_host_state_seconds(m, shape, "host_optimizer", hw, 1, adam / 2, 200.0, 1)
    assert t["host_adam"] == pytest.approx(adam / 2) and t["host_link"] == pytest.approx(up)
    # under FSDP the forward waits for the whole update
    fsdp = MeshShape(1, 2)
    t = exposed_host_state_seconds(m, fsdp, "host_optimizer", hw, 1, 100.0, 200.0, 2)
    assert t["host_adam"] == pytest.approx(adam) and t["host_link"] == pytest.approx(up / 2)
    # host: the step follows the backward; the node's ranks share the host's cores
    t1 = exposed_host_state_seconds(m, shape, "host", hw, 1, 100.0, 200.0, 1)
    t8 = exposed_host_state_seconds(m, shape, "host", hw, 1, 100.0, 200.0, 8)
    assert t1["host_adam"] == pytest.approx(adam) and t8["host_adam"] == pytest.approx(8 * adam)
    # on a CPU (comm_overlap 0) nothing hides
    cpu = hw.replace(comm_overlap=0.0)
    t = exposed_host_state_seconds(m, shape, "host_optimizer", cpu, 1, 100.0, 200.0, 1)
    assert t["host_adam"] == pytest.approx(adam) and t["host_link"] == pytest.approx(up + up)


def test_host_bytes_by_part():
    m = model()
    parts = predicted_host_bytes(m, MeshShape(), "host", seq_len=4096, micro_batch=1, grad_accum=2,
                                 offloaded_activations=1e6, attention_offload=2e6, async_checkpoint=True)
    n = predicted_model_state_bytes(m, MeshShape()) / 16
    assert parts["model_states"] == 16 * n and parts["checkpoint_staging"] == 12 * n
    assert parts["activations"] == 1e6 and parts["attention_offload"] == 2e6
    # two steps of two micro-batches of 4,096 tokens x 4 int64 tensors, and one micro-batch's frames being read
    assert parts["data_loader"] == 2 * 2 * 4096 * 32 + 4096 * 17 + 4096 * 8
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    assert data_loader_bytes(4096, 1, 1, 4) < data_loader_bytes(4096, 1, 1, 1)  # a rank's share of the sequence
