"""tests/host_origin.py, the CPU stand-in for a GPU's two memories (memory.model_states = host), on tensors alone:
what it must flag (the H200's failure: torch.stack of a host gradient norm and a device loss, train/read_back.py
before 7661cf6), what a GPU allows (a copy to the loss's device; a 0-d host tensor as an elementwise scalar), and
which copies wait for the device (not non_blocking)."""

import torch

from host_origin import ACCEL, DEVICE, HOST, HostOrigins, tracking


def _two_memories(o: HostOrigins):
    loss = torch.ones((), dtype=torch.float64, device=ACCEL)  # an activation's figure
    norm = torch.full((), 2.0, dtype=torch.float64)  # made in host memory (no device: the default)
    return loss, norm


def test_a_host_tensor_stacked_with_a_device_tensor_is_a_mix():
    o = HostOrigins()
    with tracking(o):
        loss, norm = _two_memories(o)
        torch.stack([loss, norm])
    assert o.of(loss) == DEVICE and o.of(norm) == HOST
    assert [(k, op) for k, op, _ in o.events] == [("mix", "stack")]


def test_a_copy_to_the_losss_device_joins_it_and_says_whether_it_waits():
    o = HostOrigins()
    with tracking(o):
        loss, norm = _two_memories(o)
        assert norm.device == torch.device("cpu") and loss.device == ACCEL  # (as a GPU run reads them)
        moved = norm.to(loss.device)
        torch.stack([loss, moved])
        norm.to(loss.device, non_blocking=True)
        loss.to("cpu")
    assert o.of(moved) == DEVICE
    assert [k for k, _, _ in o.events] == ["h2d_sync", "h2d", "d2h_sync"]


def test_a_0d_host_tensor_is_a_scalar_to_an_elementwise_operation_only():
    o = HostOrigins()
    with tracking(o):
        loss, norm = _two_memories(o)
        x = torch.ones(3, dtype=torch.float64, device=ACCEL)
        y = x * norm  # CUDA takes a 0-d CPU tensor as a scalar here
        x * torch.ones(3, dtype=torch.float64)  # but not a 1-d one
    assert o.of(y) == DEVICE
    assert [k for k, _, _ in o.events] == ["scalar", "mix"]
