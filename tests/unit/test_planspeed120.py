"""The planner's speed-ups change no plan (docs/planner.md "How the search is timed"): memory/layer_hosts.py keeps a
MoE model's blocks (offloaded, MoE, host bytes) from estimate_activations for host_parts.py's pinned count, and
_pinned_at looks each block's kind up once per call. Each is checked against a straightforward evaluation: the
stores emptied before every value (cold), so a key that misses an argument (a wrong cache key) gives one request's
blocks to another and is caught here; and a few small requests' plans, every one of them, against cold estimates."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.memory import host_parts, layer_hosts, transients
from longctx.memory.accounting import estimate_activations, layer_activations, peak_models
from longctx.memory.block_parts import compute_bytes
from longctx.memory.host_parts import core_parts, locked_bytes, offloaded_block_parts, pinned_activation_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import transient_bytes
from longctx.planner.cost import estimate
from longctx.planner.search import Request, plan


def _model(preset: str, **fields):
    return dataclasses.replace(load_config(None, {"model": {"preset": preset}}).model, **fields)


def _cold():
    host_parts._KINDS.clear()
    layer_hosts._LAYERS.clear()


# every argument of layer_activations varied from one base (each change moves a MoE model's host bytes)
BASE = dict(seq_len=4096, micro_batch=1, head=1, ctx=1, dtype_bytes=2, docs=True, expert=2, expert_skew=2.0,
            autocast=False, expert_replicas=0, expert_ranks_per_node=0,
            policy=MemoryPolicy("selective", offload_fraction=0.5, offload_skip_last=1))
CHANGES = [dict(), dict(seq_len=8192), dict(micro_batch=2), dict(head=2), dict(ctx=2), dict(dtype_bytes=4),
           dict(dtype_bytes=4, autocast=True), dict(docs=False), dict(expert=4),
           dict(expert=4, expert_skew=3.0), dict(expert=4, expert_skew=1.0),
           dict(expert_replicas=1), dict(expert=4, expert_ranks_per_node=2),
           dict(policy=MemoryPolicy("selective", offload_fraction=0.25, offload_skip_last=1)),
           dict(policy=MemoryPolicy("full", offload_fraction=1.0, offload_skip_last=0)),
           dict(policy=MemoryPolicy("selective", offload_fraction=0.5, offload_skip_last=0)),
           dict(policy=MemoryPolicy("selective", offload_fraction=0.5, offload_skip_last=1, expert_chunk=256)),
           dict(policy=MemoryPolicy("selective", offload_fraction=0.5, offload_skip_last=1, block_chunk=1024)),
           dict(policy=MemoryPolicy("selective", offload_fraction=0.5, offload_skip_last=1, attention_chunk=1024,
                                    attention_offload=True)),
           dict(policy=MemoryPolicy("selective", attention_chunk=1024, attention_offload=True))]


def _reference(m, kw):
    """pinned_activation_bytes as its docstring states it, block by block, nothing kept: each block's parts listed
    (offloaded: offloaded_block_parts, a MoE block's without the SwiGLU; else the core's host state where it is
    offloaded) and locked, a MoE block's unlisted feed-forward at twice its bytes; the largest over peak_models."""
    seq_len, mb, policy, p = kw["seq_len"], kw["micro_batch"], kw["policy"], kw["dtype_bytes"]
    head, ctx, autocast = kw["head"], kw["ctx"], kw["autocast"]
    out = []
    for mk in peak_models(m, mb * seq_len // (head * ctx), policy, kw["expert"], kw["expert_skew"]):
        total = 0.0
        args = {k: v for k, v in kw.items() if k not in ("seq_len", "micro_batch")}
        for la in layer_activations(mk, seq_len, mb, **args):
            if la.offloaded:
                parts = offloaded_block_parts(mk, seq_len, mb, head=head, ctx=ctx, policy=policy, p=p,
                                              mlp=not la.moe, autocast=autocast)
            elif policy.attention_offloaded and policy.recompute in ("selective", "none"):
                parts = core_parts(mk, seq_len, mb, head=head, ctx=ctx, policy=policy, p=compute_bytes(p, autocast))
            else:
                parts = []
            total += locked_bytes(parts)
            if la.moe:
                total += 2 * max(0.0, la.host - sum(parts))
        out.append(total)
    return max(out)


def _pinned(m, kw):
    kw = dict(kw)
    return pinned_activation_bytes(m, kw.pop("seq_len"), kw.pop("micro_batch"), **kw)


def _warm_then_cold(models_and_kws):
    """(pinned bytes of each, each after estimate_activations of all of them: the way the search asks), (each
    from empty stores)."""
    _cold()
    for m, kw in models_and_kws:
        args = dict(kw)
        estimate_activations(m, args.pop("seq_len"), args.pop("micro_batch"), **args)
    warm = [_pinned(m, kw) for m, kw in models_and_kws]
    cold = []
    for m, kw in models_and_kws:
        _cold()
        cold.append(_pinned(m, kw))
    return warm, cold


@pytest.mark.parametrize("preset", ["debug-moe", "small-moe", "debug"])
def test_pinned_bytes_from_the_kept_blocks_equal_a_cold_count(preset):
    m = _model(preset)
    cases = [(m, {**BASE, **change, **({} if m.is_moe else {"expert": 1})}) for change in CHANGES]
    warm, cold = _warm_then_cold(cases)
    assert warm == cold == [_reference(m, kw) for m, kw in cases]
    assert len(set(cold)) > len(cold) // 2 - 2 * (not m.is_moe)  # (the changes move the figure: a missed key is seen)


def test_a_model_of_other_fields_is_not_given_anothers_blocks():
    """Models equal in all but one field (and one object changed in place after its count: a config is not
    changed once built, but a key of its identity would give the old blocks) count their own blocks."""
    base = _model("debug-moe")
    variants = [base, dataclasses.replace(base, moe_expert_dim=base.resolved_expert_dim * 2),
                dataclasses.replace(base, moe_top_k=1), dataclasses.replace(base, layers=base.layers + 2),
                dataclasses.replace(base, moe_router="dts")]
    warm, cold = _warm_then_cold([(v, BASE) for v in variants])
    assert warm == cold == [_reference(v, BASE) for v in variants]
    assert len(set(cold)) == len(cold)
    m = _model("debug-moe")
    _cold()
    before = _pinned(m, BASE)
    m.moe_expert_dim = m.resolved_expert_dim * 2  # (in place: same id, other fields)
    after = _pinned(m, BASE)
    _cold()
    assert after == _pinned(m, BASE) != before


def test_the_stored_blocks_cannot_be_changed_by_a_caller():
    m = _model("debug-moe")
    _cold()
    args = dict(BASE)
    estimate_activations(m, args.pop("seq_len"), args.pop("micro_batch"), **args)
    (kept,) = layer_hosts._LAYERS.values()
    assert isinstance(kept, tuple) and all(isinstance(block, tuple) for block in kept)


def _uncached_phases(monkeypatch):
    """transients.py's phases read without the kept items (the function per_model wraps)."""
    monkeypatch.setattr(transients, "_phase_items", transients._phase_items.__wrapped__)


PHASE_CASES = [dict(head=h, ctx=c, window=w, policy=pol, dtype_bytes=e, autocast=a, docs=d)
               for h, c, w in ((1, 1, 0), (2, 2, 0), (1, 4, 0), (1, 4, 2), (2, 4, 2), (1, 8, 2), (1, 8, 4))
               for pol in [c["policy"] for c in CHANGES if "policy" in c] + [BASE["policy"], MemoryPolicy("full")]
               for e, a in ((2, False), (4, True), (4, False)) for d in (True, False)]


@pytest.mark.parametrize("preset", ["debug-moe", "debug"])
def test_transients_from_kept_phases_equal_uncached_ones(preset, monkeypatch):
    """Every block's phases asked in a mixed order (windows, layouts, policies, dtypes, MoE and dense blocks) give
    the transient of phases computed afresh: a kept phase under a key missing an argument would not."""
    m = _model(preset)
    warm = [transient_bytes(m, 8192, 1, **kw) for kw in PHASE_CASES]
    warm_again = [transient_bytes(m, 8192, 1, **kw) for kw in reversed(PHASE_CASES)][::-1]
    _uncached_phases(monkeypatch)
    cold = [transient_bytes(m, 8192, 1, **kw) for kw in PHASE_CASES]
    assert warm == warm_again == cold
    assert len(set(cold)) >= 40  # (the cases move the figure: a key missing one is seen)


def _cold_estimate(req, e):
    _cold()
    return estimate(req.model, req.hardware, dataclasses.replace(e.mesh_shape, local_steps=0), e.policy,
                    seq_len=req.seq_len, global_batch=req.global_batch, micro_batch=e.micro_batch,
                    gpus_per_node=req.gpus_per_node, doc_mask=req.doc_mask, doc_work=req.doc_work,
                    expert_skew=req.expert_skew, model_states=e.model_states, co2_steps=req.co2_local_steps,
                    settings=req.settings)


REQUESTS = {
    "debug-moe, 4 GPUs, offload": dict(preset="debug-moe", gpus=4, seq_len=8192, offload_fractions=(0.0, 0.5, 1.0)),
    "small-moe, 2 GPUs, host tiers": dict(preset="small-moe", gpus=2, seq_len=16384, offload_fractions=(0.0, 0.25)),
    "debug-moe, 1 GPU, small memory": dict(preset="debug-moe", gpus=1, seq_len=16384, offload_fractions=(0.0, 1.0),
                                           memory_gib=0.5),
    "debug, 16 GPUs in nodes of 2 (Double-Ring windows)": dict(preset="debug", gpus=16, seq_len=32768, gpus_per_node=2,
                                                                offload_fractions=(0.0, 0.5)),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_every_plan_equals_a_cold_estimate_of_it(name, monkeypatch):
    """Every plan of a small request (all of them timed and ranked) has the figures of a straightforward estimate
    of its layout and policy, computed with empty stores and the phases computed afresh."""
    spec = dict(REQUESTS[name])
    m = _model(spec.pop("preset"))
    hw = PRESETS["h100"]
    if "memory_gib" in spec:
        hw = hw.replace(memory_gib=spec.pop("memory_gib"))
    req = Request(m, hw, spec.pop("gpus"), spec.pop("seq_len"), **spec)
    _cold()
    res = plan(req, explain=False)
    ranked = list(res.ranked)
    assert ranked, name
    assert any(e.mesh_shape.window for e in ranked) or "windows" not in name
    _uncached_phases(monkeypatch)
    for e in itertools.islice(ranked, 0, None, max(1, len(ranked) // 150)):
        cold = _cold_estimate(req, e)
        assert cold.as_dict() == e.as_dict(), (name, e.as_dict()["describe"])
