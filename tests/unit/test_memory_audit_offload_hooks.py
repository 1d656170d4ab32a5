"""HostOffloader's saved-tensor hooks: what backward gets back is bit-identical to what was saved
(transposed, sliced with steps, expanded, saved twice, cast, bf16), and nothing it held outlives
backward over 20 steps."""

import gc

import pytest
import torch

from longctx.memory.offload import HostOffloader

X = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(0))
SAVES = {
    "transposed": lambda x: (x.transpose(0, 2) * x.transpose(0, 2).exp()).sum(0),
    "saved_twice": lambda x: (lambda h: h * h)(x.sin()),
    "overlapping_views": lambda x: (lambda h: h[:, 2:] @ h[:, :5].transpose(1, 2))(x.cos()),
    "expanded": lambda x: (lambda h: h.expand(4, 3, 7, 5) * h.expand(4, 3, 7, 5).tanh())(x[:1].sigmoid()),
    "cast": lambda x: (lambda h: h.double() * h.double())(x.tanh()),
    "bf16": lambda x: (lambda h: (h * h).float())(x.to(torch.bfloat16)),
    "step_slice": lambda x: (lambda h: h[:, ::2, 1::2].pow(3))(x.sin()),
    "non_contiguous_matmul": lambda x: x.transpose(1, 2) @ x,
}


def _grad(fn, fraction=None):
    x = X.clone().requires_grad_()
    if fraction is None:
        y = fn(x)
    else:
        off = HostOffloader("cpu")
        with off.block(0), off.offload(fraction):
            y = fn(x)
    return y.detach(), torch.autograd.grad(y.sum(), x)[0]


@pytest.mark.parametrize("fraction", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(SAVES))
def test_restored_tensors_are_bit_identical(name, fraction):
    y0, g0 = _grad(SAVES[name])
    y1, g1 = _grad(SAVES[name], fraction)
    assert torch.equal(y0, y1) and torch.equal(g0, g1)


@pytest.fixture
def young_heap_gc():
    """gc.collect() over the objects made from here on: what was alive before (a test process's
    imports, other tests' objects: seconds per full collection in a loaded worker, 20 of them) is
    frozen out of the scans; a cycle among the step's own objects is still found and freed."""
    session_froze = gc.get_freeze_count() > 0  # (tests/conftest.py freezes what collection left)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    if session_froze:  # as the session's freeze left it: what is alive now frozen, nothing frozen that is garbage
        gc.collect()
        gc.freeze()


def test_nothing_held_after_backward_over_twenty_steps(young_heap_gc):
    off = HostOffloader("cpu")
    w = torch.randn(64, 64, requires_grad=True)
    held = []
    for _ in range(20):
        h = torch.randn(1, 256, 64, requires_grad=True)
        for i in range(4):
            with off.block(i), off.offload(0.5):
                h = torch.relu(h @ w) + h.sin()
        assert any(r() is not None for r in off.host_tensors)  # the host tier was used
        h.sum().backward()
        del h
        gc.collect()
        held.append((sum(r() is not None for r in off.host_tensors), len(off.host_tensors),
                     sum(len(s) for s in off._blocks.values())))
    assert all(live == 0 and parts == 0 for live, _, parts in held)
    assert held[-1][1] == held[1][1]  # the list of (dead) references does not grow per step
