"""The planner's search caches and its memory prune change no result (planner/candidate_cache.py):
estimate_activations reads the micro-batch and ctx only through the rank's tokens (the key Shared keeps it by), and
the candidates may_fit skips are exactly those that would have made nothing."""

import dataclasses

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.rank_process import PROCESS_BYTES
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
                          expert_skew=2.0, autocast=copies)
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


# The search's per-candidate shortcuts (candidate_cache.py device_total's kept sums, candidate_costs' window-free
# ActivationCosts, Layout's rows, cost.py's co2 all-reduce per layout, model_states' shard totals, comm_bytes'
# MoE forward runs, bound_keys' layout classes) against computing each figure afresh, on requests that reach each
# of them: Double-Ring windows and expert degrees (debug-moe over 4-GPU nodes), co2 on slow links, three link
# levels, the host tiers on one GPU, a CPU hardware's one-memory peak.
SLOW = H100.replace(inter_gbps=5)
FRESH_CASES = {
    "moe windows": lambda: Request(model("debug-moe"), H100, 16, 2**14, gpus_per_node=4, micro_batches=(1, 2)),
    "co2 slow": lambda: Request(model("llama3-8b"), SLOW, 32, 2**15, micro_batches=(1, 2), allow=("co2",)),
    "co2 held, three levels": lambda: Request(model("llama3-8b"), SLOW.replace(group_ranks=2, middle_gbps=28), 32,
                                              2**15, micro_batches=(1,)),
    "70b one gpu": lambda: Request(model("llama3-70b"), PRESETS["h200"], 1, 2**15, micro_batches=(1,)),
    # (0.05 GiB for the run, as before, and each process's interpreter, which shares a CPU's one memory: plan114)
    "cpu one memory": lambda: Request(model("debug"), H100.replace(
        name="cpu-test", memory_gib=0.05 + PROCESS_BYTES / 2**30 / H100.usable_memory_fraction, host_memory_gib=0),
        2, 2**12),
}


def _fresh_total(req, layout, pol, tier, acts, transient):
    """device_total from scratch: costs/host_bytes.py device_bytes' total (its dict, summed)."""
    from longctx.costs.host_bytes import device_bytes

    s = req.settings
    return device_bytes(req.model, layout.shape, tier, pol.grad_sync, layout.grad_accum, req.hardware.dtype_bytes,
                        acts.total_device, transient, s.grad_bucket_blocks, s.co2_outer_momentum)["total"]


def _fresh_costs(req, layout, step_pol, policy, tier, entry, caches):
    """candidate_costs from scratch: activation_costs of the candidate's own shape (window included)."""
    from longctx.planner.activation_costs import activation_costs

    entry[2] = activation_costs(req.model, req.hardware, layout.shape, step_pol, seq_len=req.seq_len,
                                micro_batch=layout.mb, doc_mask=req.doc_mask, doc_work=req.doc_work, acts=entry[0],
                                transient=entry[1], expert_skew=req.expert_skew, model_states=tier)
    return entry[2]


@pytest.mark.parametrize("case", list(FRESH_CASES))
def test_kept_totals_and_window_free_costs_change_nothing(monkeypatch, case):
    """The search with device_total and candidate_costs computed afresh for every candidate makes the same
    footprints, in the same order, and the same ranking, timed counts, why-lines and suggestions."""
    from longctx.planner.candidate_cache import Caches
    from longctx.planner.link_report import report_text

    def everything():
        req = FRESH_CASES[case]()
        found, n = search._evaluate(req, False, Caches())
        res = plan(req)
        return [repr(fp) for fp in found], n, _everything(res), report_text(res)

    kept = everything()
    assert kept[0], "every case has candidates that fit"
    monkeypatch.setattr(search, "device_total", _fresh_total)
    monkeypatch.setattr(search, "candidate_costs", _fresh_costs)
    assert everything() == kept


@pytest.mark.parametrize("case", list(FRESH_CASES))
def test_every_footprint_the_search_makes_is_the_fresh_footprint_of_its_candidate(case):
    """Each candidate the search keeps (every 7th, and all the co2 ones) equals cost.footprint computed alone:
    no activations, transient or layout dict handed in."""
    from longctx.planner.candidate_cache import Caches
    from longctx.planner.cost import footprint

    req = FRESH_CASES[case]()
    found, _ = search._evaluate(req, False, Caches())
    some = [fp for i, fp in enumerate(found) if i % 7 == 0 or fp.mesh_shape.data_parallel == "co2"]
    assert some
    for fp in some:
        fresh = footprint(req.model, req.hardware, fp.mesh_shape, fp.policy, seq_len=req.seq_len,
                          global_batch=req.global_batch, micro_batch=fp.micro_batch, gpus_per_node=req.gpus_per_node,
                          doc_mask=req.doc_mask, doc_work=req.doc_work, expert_skew=req.expert_skew,
                          model_states=fp.model_states, co2_steps=req.co2_local_steps, settings=req.settings)
        assert fresh == fp, (fp.mesh_shape, fp.policy, fp.model_states)


def test_remembered_shard_totals_and_moe_forward_runs_are_the_sums():
    from longctx.costs.model_states import predicted_model_state_bytes, rank_shard_numels
    from longctx.costs.shape import MeshShape
    from longctx.memory.moe_counts import moe_forward_runs
    from longctx.planner.comm_bytes import _forward_runs

    for preset in ("llama3-8b", "qwen3-30b-a3b", "debug-moe"):
        m = model(preset)
        for shape in (MeshShape(), MeshShape(1, 8), MeshShape(2, 4, 2, 2, expert=8 if m.is_moe else 1),
                      MeshShape(1, 3, 1, 1, expert=1), MeshShape(4, 8, 1, 4, expert=4 if m.is_moe else 1)):
            assert predicted_model_state_bytes(m, shape) == 16.0 * sum(rank_shard_numels(m, shape))
        for pol in policies(Request(m, H100, 8, 2**14))[::5]:
            for tokens in (0, 1000, 4096):
                assert _forward_runs(m, tokens, pol) == moe_forward_runs(m, tokens, pol)


def test_bound_keys_group_equal_layouts_that_are_other_objects():
    """bound_keys numbers layouts by object for speed: a candidate whose MeshShape is an equal copy gets the
    bound of the original, and the layout's least FSDP time is taken over both."""
    from longctx.planner.candidate_cache import Caches

    req = FRESH_CASES["co2 slow"]()
    found, _ = search._evaluate(req, False, Caches())
    copies = [dataclasses.replace(fp, mesh_shape=dataclasses.replace(fp.mesh_shape)) for fp in found]
    assert all(c.mesh_shape is not fp.mesh_shape for c, fp in zip(copies, found))
    bound = search.bound_keys(req, found)
    assert [bound(c) for c in copies] == [bound(fp) for fp in found]
    mixed = [c if i % 2 else fp for i, (c, fp) in enumerate(zip(copies, found))]
    mixed_bound = search.bound_keys(req, mixed)
    assert [mixed_bound(fp) for fp in found] == [bound(fp) for fp in found]
