"""The search's lower bound of a step (planner/step_bound.py) with its expert all-to-all term, and the router
statistics' all-reduce in the planner's bytes.

- Over randomized requests (dense and MoE presets, GPU counts, lengths 8K-128K, expert degrees, skews, FlexMoE
  copies, hierarchical dispatch, hardware) and randomized candidates of each: the bound is never above the
  candidate's step (unrounded, and as the ranking's key), and its expert term is the estimate's own exposed expert
  seconds (the same figure, not a second formula).
- On small requests the ranking read in full (the table's rows, the best) is the order of an exhaustive search:
  every candidate timed and sorted; a MoE request times fewer candidates than under the bound without the term.
- The router statistics' all-reduce: 3 L E + 2 L + 1 fp32 values per micro-batch over every rank, as job/comm.py
  counts a ring all-reduce (316 B a step for debug-moe on 2 ranks)."""

import random

import pytest

from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.planner.candidate_cache import Caches
from longctx.planner.comm_bytes import router_sum_bytes
from longctx.planner.cost import estimate, timed
from longctx.planner.ranking import Ranking
from longctx.planner.search import Request, _evaluate, _sort_key, bound_keys, held, plan, step_text
from longctx.planner.step_bound import bound_seconds, expert_bound

H100 = PRESETS["h100"]
MOE = ("debug-moe", "small-moe", "qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b")
DENSE = ("debug", "llama3-1b", "llama3-8b")
# a space small enough to time: every kind of forward runs (none, full, selective with and without offload,
# block pieces), expert pieces
SMALL = dict(micro_batches=(1, 2), offload_fractions=(0.25, 1.0), loss_chunks=(0,), block_chunks=(0, 4096),
             attention_chunks=(0,), expert_chunks=(0, 4096))


def _model(preset):
    return load_config(None, {"model": {"preset": preset}}).model


def _complete(req):
    return lambda fp: timed(req.model, req.hardware, fp, seq_len=req.seq_len, global_batch=req.global_batch,
                            gpus_per_node=req.gpus_per_node, expert_skew=req.expert_skew)


def _random_request(rng: random.Random) -> Request:
    """A request of random model, GPUs, length, hardware and MoE settings (degrees that divide the experts and the
    GPUs; a hierarchy node size where one splits a degree into whole nodes)."""
    preset = rng.choice(MOE + DENSE)
    m = _model(preset)
    gpus_per_node = rng.choice((4, 8))
    gpus = rng.choice((1, 2, 4, 8, 16))
    hw = rng.choice((H100, PRESETS["h200"], H100.replace(inter_gbps=5), H100.replace(all_to_all_efficiency=0.6),
                     H100.replace(comm_overlap=0.5)))
    kw = dict(SMALL, recomputes=tuple(rng.sample(("none", "full", "selective"), rng.randint(1, 3))))
    if m.is_moe:
        degrees = [x for x in (1, 2, 4, 8, 16) if x <= gpus and gpus % x == 0 and m.moe_experts % x == 0]
        chosen = set(rng.sample(degrees, rng.randint(1, len(degrees))))
        if rng.random() < 0.8:  # (mostly with the largest degree: the term is there only above 1)
            chosen.add(max(degrees))
        kw["expert_degrees"] = tuple(sorted(chosen))
        kw["expert_skew"] = rng.choice((1.0, 1.5, 2.0, 3.0, 64.0))  # (64: above what routing allows, capped)
        if max(kw["expert_degrees"]) > 1 and rng.random() < 0.4:
            kw["expert_replicas"] = (0, 1, 2)
        nodes = [r for r in (2, 4) if gpus_per_node % r == 0 and any(x > r and x % r == 0
                                                                    for x in kw["expert_degrees"])]
        if nodes and "expert_replicas" not in kw and rng.random() < 0.5:
            kw["expert_ranks_per_node"] = rng.choice(nodes)
    return Request(m, hw, gpus, rng.choice((8192, 16384, 32768, 65536, 131072)), gpus_per_node=gpus_per_node, **kw)


@pytest.mark.parametrize("seed", range(16))
def test_the_bound_never_exceeds_the_step_of_random_plans(seed):
    """Each seed: one random request, up to 120 of its candidates that fit, timed in full (the 16 seeds: 10 MoE
    requests, 8 of them with expert degrees above 1, 4 with FlexMoE's copies, 2 with hierarchical dispatch; 6
    dense, 2 of which fit nothing: skipped)."""
    rng = random.Random(1210 + seed)
    req = _random_request(rng)
    found, _ = _evaluate(req, False, Caches())
    if not found:
        pytest.skip(f"nothing fits: {req.model.preset} on {req.gpus} at {req.seq_len}")
    sample = rng.sample(found, min(120, len(found)))
    seconds, keys = bound_seconds(req, found), bound_keys(req, found)
    complete = _complete(req)
    for fp in sample:
        est = complete(fp)
        assert seconds(fp) <= est.step_s, (fp.mesh_shape.describe(), fp.policy.describe(), seconds(fp), est.times)
        assert keys(fp) <= _sort_key(est)


@pytest.mark.parametrize("seed", range(16))
def test_the_expert_term_is_the_estimates_own(seed):
    """The term is the exposed expert all-to-all seconds `timed` adds (FlexMoE's copies' fetches apart), so no
    candidate is bounded below its expert time by a second formula that drifts from it."""
    rng = random.Random(1210 + seed)
    req = _random_request(rng)
    if not req.model.is_moe:
        pytest.skip("a dense model: no expert term")
    found, _ = _evaluate(req, False, Caches())
    classes: dict = {}
    term = expert_bound(req, lambda shape: classes.setdefault(shape, len(classes)))
    complete = _complete(req)
    for fp in rng.sample(found, min(120, len(found))):
        est = complete(fp)
        assert fp.grad_accum * term(fp) == pytest.approx(est.times.get("exposed_expert", 0.0), rel=1e-12, abs=0)


SMALL_REQUESTS = {
    "debug-moe hierarchical": lambda: Request(_model("debug-moe"), H100, 8, 8192, gpus_per_node=4,
                                              expert_degrees=(1, 8), expert_ranks_per_node=2,
                                              **dict(SMALL, micro_batches=(1,))),
    "debug-moe copies skew 3": lambda: Request(_model("debug-moe"), H100, 4, 16384, expert_degrees=(1, 2, 4),
                                               expert_skew=3.0, expert_replicas=(0, 1, 2),
                                               **dict(SMALL, micro_batches=(1,))),
    "small-moe skew max, slow": lambda: Request(_model("small-moe"), H100.replace(inter_gbps=5), 16, 32768,
                                                expert_degrees=(1, 4, 16), expert_skew=8.0,
                                                **dict(SMALL, micro_batches=(1,))),
    "qwen3 8 gpus 8K": lambda: Request(_model("qwen3-30b-a3b"), H100, 8, 8192, **SMALL),
    "dense debug 4 gpus": lambda: Request(_model("debug"), H100, 4, 16384, **SMALL),
}


@pytest.fixture(scope="module", params=list(SMALL_REQUESTS))
def small(request):
    req = SMALL_REQUESTS[request.param]()
    found, _ = _evaluate(req, False, Caches())
    # the exhaustive search: every candidate timed and sorted, co2 held out as the search holds it
    every = [e for e in sorted(map(_complete(req), found), key=_sort_key) if not held(req, e.mesh_shape)]
    return request.param, req, found, every


def test_the_chosen_plan_is_the_exhaustive_searchs(small):
    name, req, found, every = small
    res = plan(req)
    assert every and res.best.as_dict() == every[0].as_dict()
    assert [e.as_dict() for e in res.ranked[:10]] == [e.as_dict() for e in every[:10]]
    assert [float(step_text(e.step_s)) for e in res.ranked] == [float(step_text(e.step_s)) for e in every]


def test_the_expert_term_times_fewer_candidates(small):
    """The table's ten rows under the bound with the term, against the same bound without it (compute, FSDP,
    co2): the same rows, and for each MoE request here fewer candidates timed (35 against 105, 139 against 892,
    108 against 384, 1,068 against 1,934)."""
    name, req, found, every = small
    found = [fp for fp in found if not held(req, fp.mesh_shape)]  # (what the search ranks)
    complete, keys, seconds = _complete(req), bound_keys(req, found), bound_seconds(req, found)
    classes: dict = {}
    term = expert_bound(req, lambda shape: classes.setdefault(shape, len(classes)))
    without = Ranking(found, complete, _sort_key,
                      lambda fp: (0, float(step_text(seconds(fp) - fp.grad_accum * term(fp)))))
    with_term = Ranking(found, complete, _sort_key, keys)
    assert [e.as_dict() for e in with_term[:10]] == [e.as_dict() for e in without[:10]]
    assert with_term.timed <= without.timed
    if req.model.is_moe:
        assert with_term.timed < without.timed, (with_term.timed, without.timed, len(found))


@pytest.mark.parametrize("preset,world,grad_accum,expected", [
    ("debug-moe", 2, 1, 316.0),  # L = 3 MoE layers of E = 8: 79 fp32 values, 2 (n - 1) / n = 1 of them
    ("debug-moe", 4, 2, 2 * 474.0),
    ("qwen3-30b-a3b", 16, 1, 2 * 4 * (3 * 48 * 128 + 2 * 48 + 1) * 15 // 16),  # 138,967 B
    ("debug-moe", 1, 1, 0.0),
    ("debug", 8, 1, 0.0),
])
def test_router_statistics_bytes(preset, world, grad_accum, expected):
    m = _model(preset)
    assert router_sum_bytes(m, world) * grad_accum == expected
    shape = MeshShape(1, world, 1, 1)
    est = estimate(m, H100, shape, MemoryPolicy(), seq_len=4096, global_batch=world * grad_accum)
    assert est.grad_accum == grad_accum
    assert est.comm_bytes.get("router", {}).get("router", 0.0) == expected
