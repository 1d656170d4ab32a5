"""ops/pinned.py and its users, on CPU against the documented contract of torch's caching host allocator
(every pinned request rounded up to a power of two): a fake `allocate` records what would be pinned.

- plan_slabs: power-of-two slabs, tensors inside them and apart, at most one slab at most half full,
  a few percent of waste on real models (torch's per-tensor rounding: 1.10x llama3-8b, 1.29x small-100m);
- HostOptimizer's masters and gradient buffers are carved out of such slabs where it pins, and it trains
  as before;
- a resume loads AdamW's moments into ordinary host memory, as a fresh run's fused AdamW makes them
  (they were pinned: 8 bytes per parameter locked, rounded up, for tensors the device never reads)."""

import pytest
import torch

from longctx.config import load_config
from longctx.models.llama import Llama
from longctx.ops import pinned
from longctx.ops.pinned import ALIGN, plan_slabs, pow2_ceil
from longctx.step.host_optimizer import HostOptimizer, forward_units

CFG = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 3, "heads": 2, "kv_heads": 1,
                                   "ffn_dim": 32, "vocab_size": 64}})


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def _check_plan(sizes):
    slabs, where = plan_slabs(sizes)
    assert all(_is_pow2(s) for s in slabs)
    spans = {}
    for size, (slab, offset) in zip(sizes, where):
        if size:
            assert offset % ALIGN == 0 and offset + size <= slabs[slab]
            spans.setdefault(slab, []).append((offset, offset + size))
    for ranges in spans.values():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    used = [sum(-(-(b - a) // ALIGN) * ALIGN for a, b in spans[k]) for k in range(len(slabs))]
    cap = max(slabs)
    assert sum(u <= cap // 2 for u in used) <= 1
    return slabs


@pytest.mark.parametrize("sizes", [[1], [3, 5, 7], [100] * 33, [2**20 + 1] * 5, [0, 4096, 0, 17],
                                   [7 * 2**20, 3 * 2**20, 2**20, 12345, 999]])
def test_plans_are_powers_of_two_and_tensors_stay_apart(sizes):
    _check_plan(sizes)


@pytest.mark.parametrize("preset,bound,rounded", [("small-100m", 1.05, 1.29), ("llama3-8b", 1.01, 1.10)])
def test_slabs_waste_little_where_per_tensor_rounding_wastes_much(preset, bound, rounded):
    with torch.device("meta"):
        model = Llama(load_config(None, {"model": {"preset": preset}}).model)
    sizes = [p.numel() * 4 for p in model.parameters()] * 2  # fp32 masters and gradient buffers
    exact = sum(sizes)
    assert sum(pow2_ceil(s) for s in sizes) / exact == pytest.approx(rounded, abs=0.01)  # torch's rounding
    assert sum(_check_plan(sizes)) / exact < bound


@pytest.fixture
def fake_pins(monkeypatch):
    """Pinning on: `allocate` gives ordinary memory and records the sizes asked for."""
    asked = []

    def allocate(n):
        asked.append(n)
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(pinned, "allocate", allocate)
    monkeypatch.setattr(pinned, "pins", lambda device: True)
    return asked


def test_carve_makes_disjoint_views_of_power_of_two_slabs(fake_pins):
    specs = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.float32), ((0, 4), torch.float32),
             ((1000,), torch.int64)]
    out = pinned.carve(specs, True)
    assert [(t.shape, t.dtype) for t in out] == [(torch.Size(s), d) for s, d in specs]
    assert all(_is_pow2(n) for n in fake_pins)
    assert sum(fake_pins) == pinned.planned_pinned_bytes([t.numel() * t.element_size() for t in out])
    for k, t in enumerate(out):
        t.fill_(k + 1)
    assert all((t == k + 1).all() for k, t in enumerate(out))  # no tensor overlaps another


def _model():
    model = Llama(CFG.model)
    model.init_weights(0)
    return model


def _opt(model):
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return HostOptimizer(groups, forward_units(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _train(model, opt, steps=3):
    for step in range(steps):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        model(tokens, None, None, labels=tokens).backward()
        opt.clip_gradients(1.0)
        opt.step()
        opt.zero_grad()
    opt.finish_update()


def test_host_optimizer_carves_its_pinned_buffers_from_slabs(monkeypatch):
    plain_model = _model()
    _train(plain_model, _opt(plain_model))
    asked = []
    monkeypatch.setattr(pinned, "allocate", lambda n: asked.append(n) or torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(pinned, "pins", lambda device: True)
    model = _model()
    opt = _opt(model)
    sizes = [p.numel() * 4 for p in model.parameters()] * 2
    assert asked and all(_is_pow2(n) for n in asked)
    assert sum(asked) == pinned.planned_pinned_bytes(sizes)
    _train(model, opt)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_resume_keeps_the_moments_in_ordinary_host_memory_as_a_fresh_run(monkeypatch):
    model = _model()
    opt = _opt(model)
    _train(model, opt, 1)
    fresh = [opt._inner_state(i)[opt.masters[i]] for i in range(len(opt.params))]
    saved = opt.state_dict()
    other = _model()
    opt2 = _opt(other)
    opt2.device = torch.device("cuda")  # as on a GPU (nothing here touches the device)
    pinned_now = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pinned_now.append(t.shape) or t)
    opt2.load_state_dict(saved)
    assert pinned_now == []  # was: exp_avg, exp_avg_sq and step of every parameter pinned
    for i in range(len(opt2.params)):
        loaded = opt2._inner_state(i)[opt2.masters[i]]
        assert {k: v.is_pinned() for k, v in loaded.items()} == {k: v.is_pinned() for k, v in fresh[i].items()}
        assert all(torch.equal(loaded[k], fresh[i][k]) for k in ("exp_avg", "exp_avg_sq"))
