"""debug-moe (models/moe.py) under the parallel layouts and the memory policies against one process:
per-step losses and the router statistics the metrics record (balancing losses, load), both within
1e-4 (fp32, gloo); and two runs of one layout give the same bits.

The layouts are the training-parity test's (test_training_parity.LAYOUTS). Every run trains a few
steps: a wrong split of the router statistics shows at step 1 (the loss and the statistics of the
forward), a wrong gradient or bias at step 2. Starting ranks costs seconds per job, so every
configuration of one world size runs in one spawned job (run_spawned_many: one after another on one
process group, each with its own run directory); the tests read their configuration's results."""

import os
import time
from pathlib import Path

import pytest
from test_training_parity import BASE, LAYOUTS, NO_SAVE

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import train

# steps per run: 4 in the suite (a wrong split shows at step 1, a wrong gradient at step 2, the bias
# and the optimizer's moments at steps 2-4); the 10-step figures: LONGCTX_MOE_PARITY_STEPS=10
STEPS = int(os.environ.get("LONGCTX_MOE_PARITY_STEPS", "4"))
MOE = [*BASE, *NO_SAVE, "--model.preset=debug-moe", "--metrics.log_interval=1", f"--train.steps={STEPS}"]
STATS = ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate")
TOL = 1e-4

POLICIES = {
    "selective": ["--memory.recompute=selective"],
    "full": ["--memory.recompute=full"],
    "offload0.5-selective": ["--memory.recompute=selective", "--memory.offload_fraction=0.5"],
    "attention_chunk": ["--memory.recompute=full", "--memory.attention_chunk=32"],
    "block_chunk": ["--memory.recompute=selective", "--memory.block_chunk=64"],
}


def _train_losses(args, run_dir):
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def _router_stats(run_dir) -> list[dict]:
    """Per step, the router figures rank 0 wrote to metrics.jsonl."""
    lines = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "moe_aux_loss" in r]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    return [{k: r[k] for k in STATS} for r in lines]


def _single(args, run_dir):
    start = time.perf_counter()
    losses = _train_losses(args, run_dir)
    print(f"single process: {time.perf_counter() - start:.1f}s")
    return losses, _router_stats(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(MOE, tmp_path_factory.mktemp("single"))


def _jobs(world):
    """(key, args without the run directory) of every configuration run on `world` ranks: the layouts,
    then (4 ranks) the memory policies under head 2 x ctx 2. head2-ctx2 comes first among the 4-rank
    layouts, so that it runs in a fresh process, as test_two_runs_give_the_same_bits needs."""
    jobs = [(layout, [*MOE, *args]) for layout, (w, args) in LAYOUTS.items() if w == world]
    if world == 4:
        assert jobs[0][0] == "head2-ctx2"
        jobs += [(f"head2-ctx2 {policy}", [*MOE, *extra, *LAYOUTS["head2-ctx2"][1]])
                 for policy, extra in POLICIES.items()]
    return jobs


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """spawned(world) -> {key: (losses of every rank, run directory, rank 0's seconds)}: every
    configuration of that world size in one job, run on first use."""
    done = {}

    def get(world):
        if world not in done:
            base = tmp_path_factory.mktemp(f"moe-world{world}")
            dirs = {key: base / key.replace(" ", "-") for key, _ in _jobs(world)}
            seconds = {}
            results = run_spawned_many(world, [(key, _train_losses, (args, str(dirs[key])))
                                               for key, args in _jobs(world)], seconds=seconds)
            done[world] = {key: (losses, dirs[key], seconds[key]) for key, losses in results.items()}
        return done[world]

    return get


def run(key, spawned):
    """(losses of every rank, router stats) of one configuration (a layout, or 'head2-ctx2 POLICY')."""
    world = LAYOUTS[key.split()[0]][0]
    losses, run_dir, seconds = spawned(world)[key]
    print(f"{key}: {seconds:.1f}s in a {world}-rank job")
    return losses, _router_stats(run_dir)


def check(name, result, reference):
    losses, stats = result
    ref_losses, ref_stats = reference
    loss_diff = 0.0
    for rank_losses in losses:
        assert len(rank_losses) == STEPS
        loss_diff = max(loss_diff, *(abs(a - b) for a, b in zip(rank_losses, ref_losses)))
    stat_diff = {k: max(abs(s[k] - r[k]) for s, r in zip(stats, ref_stats)) for k in STATS}
    print(f"{name}: max |loss - single| {loss_diff:.2e}, router stats "
          + " ".join(f"{k.removeprefix('moe_')} {v:.1e}" for k, v in stat_diff.items()))
    assert loss_diff <= TOL, f"{name}: max |loss - single| = {loss_diff:.2e}"
    for k, v in stat_diff.items():
        got, want = [s[k] for s in stats], [r[k] for r in ref_stats]
        assert v <= TOL, f"{name}: max |{k} - single| = {v:.2e} ({got} vs {want})"


def test_reference_routes_and_balances(reference):
    """The reference itself is a MoE run: balancing losses recorded each step, nothing dropped."""
    losses, stats = reference
    assert len(losses) == STEPS and all(s["moe_aux_loss"] >= 1.0 - 1e-6 for s in stats)  # aux >= 1 (1 = even)
    assert all(s["moe_load_worst"] >= s["moe_load_mean"] >= 1.0 for s in stats)
    assert all(s["moe_drop_rate"] == 0 for s in stats)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_single_process(layout, reference, spawned):
    check(layout, run(layout, spawned), reference)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_memory_policies_match_single_process(policy, reference, spawned):
    check(f"head2-ctx2 {policy}", run(f"head2-ctx2 {policy}", spawned), reference)


POOLED = [*MOE, "--model.moe.aux_loss_scope=pooled", "--model.moe.aux_loss=0.5"]


@pytest.fixture(scope="module")
def second_job(tmp_path_factory):
    """{key: (losses of every rank, run directory)} of the 4-rank job after the layouts' one: head2-ctx2 again
    (first, in a fresh process, as test_two_runs_give_the_same_bits needs), then the pooled run (one job
    start fewer than a job each)."""
    base = tmp_path_factory.mktemp("moe-second")
    args = LAYOUTS["head2-ctx2"][1]
    runs = {"second": [*MOE, *args], "pooled": [*POOLED, *args]}
    start = time.perf_counter()
    results = run_spawned_many(LAYOUTS["head2-ctx2"][0], [(key, _train_losses, (a, str(base / key)))
                                                           for key, a in runs.items()])
    print(f"head2-ctx2 again and pooled: {time.perf_counter() - start:.1f}s")
    return {key: (losses, base / key) for key, losses in results.items()}


def test_pooled_aux_loss_matches_single_process(tmp_path, second_job):
    """moe.aux_loss_scope = pooled (transformers' balancing loss: the layers pooled before the product)
    under head 2 x ctx 2: each rank's share is still exact.
    A weight of 0.5, not debug-moe's 0.01: a wrong share moves the step-2 loss well past the tolerance."""
    reference = _single(POOLED, tmp_path / "single")
    losses, run_dir = second_job["pooled"]
    check("head2-ctx2 pooled", (losses, _router_stats(run_dir)), reference)


def test_two_runs_give_the_same_bits(spawned, second_job):
    """head2-ctx2 of the 4-rank job (the first there: a fresh process) against another job's (its first too)."""
    first = run("head2-ctx2", spawned)
    losses, run_dir = second_job["second"]
    second = (losses, _router_stats(run_dir))
    assert first[0] == second[0]  # every rank's losses, exactly
    assert first[1] == second[1]  # and the router statistics
