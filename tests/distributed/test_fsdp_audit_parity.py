"""FSDP2 / HSDP (parallel/fsdp/shard.py) against one process on the same global batch, on gloo CPU.

Each case trains a 2-layer debug model 4 steps through the training path (planner/validate_ranks.py setup_case
and train_step: parallelize -> make_optimizer, micro-batches cut as the loop cuts them) and is compared with a
one-process run of the same config: the global loss before every update, the reduced gradients of the
first step (full tensors) with their global norm (step/gradients.py clip_gradients), and the final weights.

Tolerances (fp32 throughout): the layouts change only the order of fp32 sums (the reduce-scatter and
all-reduce sum over ranks, the sequence-parallel attention merges partial results), so the first step's
gradients and their norm agree to 1e-5 of the largest (measured 2.4e-7 to 6.6e-7). AdamW divides by sqrt(v):
an element whose gradient is ~1e-7 of the largest gets an update of order lr from rounding alone, so after
4 steps at lr 3e-3 the weights are held to 5e-4 and the losses to 2e-5 (measured 2.4e-5 to 1.2e-4 and 4e-7 to
1e-6 on the debug vocabulary; 2.4e-4 and 9.4e-6 at vocabulary 1,000 over 3 ranks, where dp 3's uneven shards
and rep 3's whole copies land 5e-6 from each other: the summation order, not the shards, sets it). The
gradient check is the one that sees a wrong averaging factor: AdamW's update is invariant to a gradient's
scale, the losses and weights are not.
"""

import pytest

from fsdp_audit import config, run_cases
from longctx.job.spawn import run_spawned

pytestmark = pytest.mark.slow

STEPS = 4
LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 2e-5, 1e-5, 5e-4

WORLD4 = {
    "dp4": dict(),
    "rep2 x dp2": dict(parallel__dp_replicate=2),
    "rep4": dict(parallel__dp_replicate=4),
    "rep2 x ctx2": dict(parallel__dp_replicate=2, parallel__ctx=2, parallel__dp_shard=1),
    "rep2 x head2": dict(parallel__dp_replicate=2, parallel__head=2, parallel__dp_shard=1),
    "dp2 x head2": dict(parallel__head=2),
    "head2 x ctx2": dict(parallel__head=2, parallel__ctx=2),
    "rep2 x dp2 tied": dict(parallel__dp_replicate=2, model__tie_embeddings=True),
    "rep2 x dp2 hpz": dict(parallel__dp_replicate=2, parallel__zero_pp="hpz", parallel__ranks_per_node=2),
    "dp4 hpz": dict(parallel__zero_pp="hpz", parallel__ranks_per_node=2),
}
WORLD3 = {
    "dp3 vocab1000": dict(model__vocab_size=1000, train__global_batch=3),
    "dp3 vocab1000 tied": dict(model__vocab_size=1000, model__tie_embeddings=True, train__global_batch=3),
    "rep3 vocab1000": dict(model__vocab_size=1000, parallel__dp_replicate=3, train__global_batch=3),
    # the host tiers' own shards (FSDP's CPU offload; the host AdamW's masters), uneven, under accumulation
    "dp3 vocab1000 tied host accum2": dict(model__vocab_size=1000, model__tie_embeddings=True, train__global_batch=6,
                                           train__grad_accum=2, memory__model_states="host"),
    "dp3 vocab1000 tied host_optimizer accum2": dict(model__vocab_size=1000, model__tie_embeddings=True,
                                                     train__global_batch=6, train__grad_accum=2,
                                                     memory__model_states="host_optimizer"),
}
# the one-process reference of each: the model's keys and the global batch (the layout's keys dropped)
MODEL_KEYS = ("model__vocab_size", "model__tie_embeddings", "train__global_batch")


def _reference_key(kw):
    return tuple(sorted((k, v) for k, v in kw.items() if k in MODEL_KEYS))


def _cases(table):
    return [(name, config(**kw), STEPS, ()) for name, kw in table.items()]


_DONE: dict = {}


def _references() -> dict:
    """{reference key: the one-process run}: every table's references in one one-process job, run once per
    module (a job per table started a rank, and paid its first step's set-up, twice for the same kind of run)."""
    if "references" not in _DONE:
        keys = sorted({_reference_key(kw) for table in (WORLD4, WORLD3) for kw in table.values()})
        names = {key: f"ref {i}" for i, key in enumerate(keys)}
        single = run_spawned(1, run_cases, [(names[k], config(parallel__dp_shard=1, **dict(k)), STEPS, ())
                                            for k in names])[0]
        _DONE["references"] = {k: single[names[k]] for k in names}
    return _DONE["references"]


def _world(table: dict, world: int) -> dict:
    """{case: (rank 0's result, its one-process reference's, every rank's)}: one spawned job per world
    (the references: _references), run once per module."""
    if world not in _DONE:
        references = _references()
        ranks = run_spawned(world, run_cases, _cases(table))
        _DONE[world] = {name: (ranks[0][name], references[_reference_key(kw)], [r[name] for r in ranks])
                        for name, kw in table.items()}
    return _DONE[world]


@pytest.fixture
def results():
    return lambda name: (_world(WORLD4, 4) if name in WORLD4 else _world(WORLD3, 3))[name]


def _max_rel(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    top = max(t.abs().max().item() for t in ref.values())
    return max((got[k] - ref[k]).abs().max().item() for k in ref) / top


@pytest.mark.parametrize("name", [*WORLD4, *WORLD3])
def test_layout_trains_as_one_process(name, results):
    got, ref, _ = results(name)
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    grad = _max_rel(got["grads"], ref["grads"])
    weights = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    print(f"{name}: loss {loss:.1e}, first-step gradients {grad:.1e} (relative), weights {weights:.1e}")
    assert len(got["losses"]) == STEPS and got["losses"][-1] < got["losses"][0] - 0.1  # it trains
    assert loss <= LOSS_TOL and grad <= GRAD_TOL and weights <= WEIGHT_TOL
    assert got["state"].keys() == ref["state"].keys()  # tied: one parameter, named once
    norm = abs(got["norm"] - ref["norm"]) / ref["norm"]
    assert norm <= GRAD_TOL, f"global gradient norm (clip_gradients) {norm:.1e} off"


def test_tied_embedding_is_one_parameter_with_both_uses_in_its_gradient(results):
    """Tied (embedding == LM head) under HSDP: one parameter, and its gradient is the one-process one,
    which holds the embedding's use and the LM head's (each alone is checked apart against it)."""
    got, ref, _ = results("rep2 x dp2 tied")
    assert "output.weight" not in got["state"] and "tok_embeddings.weight" in got["state"]
    g, r = got["grads"]["tok_embeddings.weight"], ref["grads"]["tok_embeddings.weight"]
    assert (g - r).abs().max() <= GRAD_TOL * r.abs().max()
