"""The planner's search caches and its memory prune change no result (planner/candidate_cache.py):
estimate_activations reads the micro-batch and ctx only through the rank's tokens (the key Shared keeps it by), and
the candidates may_fit skips are exactly those that would have made nothing."""

import dataclasses

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.memory.accounting import estimate_activations
from longctx.planner import search
from longctx.planner.request import policies
from longctx.planner.search import Request, plan

H100 = PRESETS["h100"]


def model(preset):
    return load_config(None, {"model": {"preset": preset}}).model


@pytest.mark.parametrize("preset", ["debug", "debug-moe", "qwen3-30b-a3b"])
def test_activations_read_micro_batch_and_ctx_only_through_tokens(preset):
    m = model(preset)
    req = Request(m, H100, 8, 2**14)
    for pol in policies(req)[::7]:
        for head in (1, 2):
            for e, copies in ((2, False), (4, True)):
                kw = dict(head=head, policy=pol, dtype_bytes=e, docs=True, expert=2 if m.is_moe else 1,
                          expert_skew=2.0, weight_copies=copies)
                one = estimate_activations(m, 2**14, 1, ctx=1, **kw)
                assert estimate_activations(m, 2**14, 2, ctx=2, **kw) == one
                assert estimate_activations(m, 2**14, 4, ctx=4, **kw) == one


def _everything(res):
    return res.evaluated, [repr(e) for e in res.ranked[:50]], res.timed, res.suggestions, len(res.feasible)


@pytest.mark.parametrize("preset, memory_gib, gpus, seq", [("debug-moe", 0.02, 4, 4096), ("debug", 0.01, 4, 8192),
                                                           ("llama3-8b", 80, 8, 2**18)])
def test_memory_prune_is_exact(monkeypatch, preset, memory_gib, gpus, seq):
    """The same result with may_fit keeping every policy (the search before the prune)."""
    req = Request(model(preset), H100.replace(memory_gib=memory_gib), gpus, seq, gpus_per_node=gpus,
                  micro_batches=(1, 2))
    pruned = _everything(plan(req))
    monkeypatch.setattr(search, "may_fit", lambda req, layout, index, step_pols, caches: range(len(step_pols)))
    assert _everything(plan(dataclasses.replace(req))) == pruned
