"""The planner's ranking, timed as it is read (planner/ranking.py), gives exactly the order of timing
every candidate and sorting them: the same estimates, the same ties, co2 held out the same way; its
bound never exceeds a candidate's key; a filtered first() is the first of the full order; and it
times a small share of the candidates for a table's rows."""

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.planner.candidate_cache import Caches
from longctx.planner.cost import estimate
from longctx.planner.link_report import why
from longctx.planner.ranking import Ranking
from longctx.planner.search import Request, _evaluate, _sort_key, bound_keys, plan

H100 = PRESETS["h100"]
SLOW = H100.replace(inter_gbps=5)
THREE = SLOW.replace(group_ranks=2, middle_gbps=28)


def _model(preset):
    return load_config(None, {"model": {"preset": preset}}).model


# (name, request): dense over two nodes (ZeRO++ variants, co2 held out), co2 allowed on slow links,
# three-level hardware (hpZ on a node's group), a MoE model (expert degrees, expert chunks), host tiers
CASES = {
    "8b 16 gpus 256K": lambda: Request(_model("llama3-8b"), H100, 16, 2**18),
    "8b co2 allowed, slow": lambda: Request(_model("llama3-8b"), SLOW, 32, 2**15, micro_batches=(1, 2),
                                            allow=("co2",)),
    "8b three levels": lambda: Request(_model("llama3-8b"), THREE, 32, 2**15, micro_batches=(1,)),
    "moe 8 gpus 64K": lambda: Request(_model("qwen3-30b-a3b"), H100, 8, 2**16, micro_batches=(1, 2)),
    "70b one gpu 32K host tiers": lambda: Request(_model("llama3-70b"), PRESETS["h200"], 1, 2**15,
                                                  micro_batches=(1,)),
}


def _complete(req):
    from longctx.planner.cost import timed

    return lambda fp: timed(req.model, req.hardware, fp, seq_len=req.seq_len, global_batch=req.global_batch,
                            gpus_per_node=req.gpus_per_node, expert_skew=req.expert_skew)


def _reference(req):
    """Every candidate that fits, timed and sorted (the search before rankings were read lazily)."""
    found, _ = _evaluate(req, False, Caches())
    every = sorted(map(_complete(req), found), key=_sort_key)
    held = "co2" not in req.allow
    return ([e for e in every if not (held and e.mesh_shape.data_parallel == "co2")],
            [e for e in every if held and e.mesh_shape.data_parallel == "co2"], found)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    req = CASES[request.param]()
    return req, plan(req), _reference(req)


def test_the_lazy_order_is_the_full_sort(case):
    req, res, (ranked, held, found) = case
    assert ranked, "every case has plans that fit"
    assert len(res.ranked) == len(ranked) and len(res.co2_plans) == len(held)
    assert [e.as_dict() for e in res.ranked] == [e.as_dict() for e in ranked]
    assert [e.as_dict() for e in res.co2_plans] == [e.as_dict() for e in held]
    assert res.timed == len(found)  # read to the end: every candidate timed once


def test_the_bound_never_exceeds_a_candidates_key_and_a_wrong_bound_breaks_the_order(case):
    req, _, (ranked, _, found) = case
    complete = _complete(req)
    keys = [_sort_key(complete(fp)) for fp in found]
    bound = bound_keys(req, found)
    assert all(bound(fp) <= k for fp, k in zip(found, keys))
    # the check above is what keeps the order: a bound above the real key (the compute of 3 steps)
    # ranks by bounds, not times, wherever the times differ
    over = Ranking([fp for fp in found if fp.mesh_shape.data_parallel != "co2" or "co2" in req.allow], complete,
                   _sort_key, lambda fp: (0, 3 * fp.lower_bound_s))
    if len({round(e.step_s, 6) for e in ranked}) > 1:
        assert [e.as_dict() for e in over] != [e.as_dict() for e in ranked]


def test_a_filtered_first_is_the_first_of_the_full_order(case):
    req, res, (ranked, _, _) = case
    fresh = plan(req)  # nothing read yet beyond the best
    for keep in (lambda x: x.mesh_shape.zero_pp == "", lambda x: x.policy.recompute == "full",
                 lambda x: x.micro_batch == 2, lambda x: x.model_states != "device",
                 lambda x: x.mesh_shape.expert > 1, lambda x: x.mesh_shape.hpz_ranks > 0):
        want = next((e for e in ranked if keep(e)), None)
        got = fresh.ranked.first(keep)
        assert (got is None) == (want is None)
        if want is not None:
            assert got.as_dict() == want.as_dict()


def test_a_ranked_estimate_is_the_estimate_of_its_candidate(case):
    req, res, _ = case
    for e in res.ranked[:5]:
        direct = estimate(req.model, req.hardware, e.mesh_shape, e.policy, seq_len=req.seq_len,
                          global_batch=req.global_batch, micro_batch=e.micro_batch, gpus_per_node=req.gpus_per_node,
                          doc_mask=req.doc_mask, doc_work=req.doc_work, expert_skew=req.expert_skew,
                          model_states=e.model_states, co2_steps=req.co2_local_steps)
        assert direct.as_dict() == e.as_dict()


def test_a_table_times_a_small_share_of_the_plans_and_the_why_lines_are_those_of_the_full_order():
    req = Request(_model("llama3-8b"), H100, 64, 2**20, global_batch=128)
    res = plan(req)
    res.feasible[:10]
    why_lines = why(res)
    assert len(res.feasible) > 25_000  # (29,323 since each placement tries only its own window)
    assert res.timed < len(res.feasible) / 10, (res.timed, len(res.feasible))
    assert any("the best plain plan" in line for line in why_lines)
