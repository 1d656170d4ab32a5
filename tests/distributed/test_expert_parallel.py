"""Expert parallelism (parallel.expert, parallel/expert/install.py) against one process: per-step losses and
router statistics under folded layouts and memory policies, the expert all-to-all bytes against
their closed form from the routed counts, and resumes under another expert degree (fp32, gloo).

Starting ranks costs seconds per job, so every configuration of one world size runs in one spawned
job (`spawned(world)`, run_spawned_many: one after another on one process group, each with its own
run directory); the tests read their configuration's results from it. The resumes run in a second
job, after the first halves."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_training_parity import BASE, NO_SAVE

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job import comm
from longctx.job.spawn import run_spawned_many
from longctx.job.traffic import library_traffic
from longctx.parallel.context.shares import to_device
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer, train

# steps per run: 4 in the suite (a wrong split shows at step 1, a wrong gradient at step 2); the issue's
# 10-step figures: LONGCTX_MOE_PARITY_STEPS=10 pytest ...
STEPS = int(os.environ.get("LONGCTX_MOE_PARITY_STEPS", "4"))
MOE = [*BASE, "--model.preset=debug-moe", "--metrics.log_interval=1"]
RUN = [*MOE, *NO_SAVE, f"--train.steps={STEPS}"]  # the parity runs (no test reads their checkpoints)
STATS = ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst")
TOL = 1e-4

FLEXMOE = ["--parallel.expert_replicas=1", "--parallel.expert_placement_window=2"]
LAYOUTS = {  # world, args
    "expert4-head2-ctx2": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"]),
    # FSMoE's schedule (parallel/expert/pipeline.py): the same layout, each layer in 3 overlapped chunks
    "expert4-head2-ctx2-pipeline3": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2",
                                         "--parallel.expert_pipeline_chunks=3"]),
    # hierarchical dispatch (parallel/expert/hierarchy.py): the group as 2 nodes of 2 ranks
    "expert4-head2-ctx2-hier2": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2",
                                     "--parallel.expert_ranks_per_node=2"]),
    # FlexMoE (parallel/expert/placement.py): copies of hot experts from step 3 on (placed from steps 1-2)
    "expert4-head2-ctx2-flexmoe": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2", *FLEXMOE]),
    # gradient buckets (parallel/fsdp/grad_buckets.py): the 4 blocks in 2 FSDP units, one reduce-scatter each
    "expert4-head2-ctx2-buckets2": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2",
                                        "--parallel.grad_bucket_blocks=2"]),
    "expert2-dp2-ctx2": (4, ["--parallel.expert=2", "--parallel.ctx=2"]),
    "expert4-ctx4-window2": (4, ["--parallel.expert=4", "--parallel.ctx=4", "--parallel.window=2"]),
    "expert8-dp2-head2-ctx2": (8, ["--parallel.expert=8", "--parallel.head=2", "--parallel.ctx=2"]),
}
POLICIES = {
    "selective": ["--memory.recompute=selective"],
    "full": ["--memory.recompute=full"],
    "offload0.5": ["--memory.recompute=selective", "--memory.offload_fraction=0.5"],
    "full-offload1": ["--memory.recompute=full", "--memory.offload_fraction=1.0"],
    "attention_chunk": ["--memory.recompute=full", "--memory.attention_chunk=128"],
    "block_chunk": ["--memory.recompute=selective", "--memory.block_chunk=128"],
}


def _train(args, run_dir):
    """The run's losses; its expert placement lines (FlexMoE) go to RUN_DIR/placement.log."""
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    lines = []
    losses = train(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a)))).losses
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(run_dir) / "placement.log").write_text("".join(f"{x}\n" for x in lines if "expert placement" in x))
    return losses


def _stats(run_dir, steps):
    lines = {r["step"]: r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "moe_aux_loss" in r}
    return [{k: lines[s][k] for k in STATS} for s in steps]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    losses = _train(RUN, run_dir)
    return losses, _stats(run_dir, range(1, STEPS + 1))


def _check(name, key, reference, spawned):
    world = WORLD_OF[key]
    results, seconds, base = spawned(world)
    per_rank, run_dir = results[key], _run_dir(base, key)
    ref_losses, ref_stats = reference
    loss_diff = max(abs(a - b) for losses in per_rank for a, b in zip(losses, ref_losses, strict=True))
    stats = _stats(run_dir, range(1, STEPS + 1))
    stat_diff = max(abs(s[k] - r[k]) for s, r in zip(stats, ref_stats) for k in STATS)
    print(f"{name}: max |loss - single| {loss_diff:.2e}, router stats {stat_diff:.2e} "
          f"({seconds[key]:.0f}s in a {world}-rank job)")
    assert loss_diff <= TOL and stat_diff <= TOL, (name, loss_diff, stat_diff)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layouts_match_one_process(layout, reference, spawned):
    _check(layout, f"layout {layout}", reference, spawned)


def test_flexmoe_places_copies_mid_run_and_trains_as_the_plain_run(spawned):
    results, _, base = spawned(4)
    logged = (_run_dir(base, "layout expert4-head2-ctx2-flexmoe") / "placement.log").read_text().splitlines()
    # placed before steps 3, 5, ... (each from the 2 steps before); the copies serve step 3 on
    assert len(logged) == (STEPS - 1) // 2 and " 0 copies" not in logged[0], logged
    plain, placed = results["layout expert4-head2-ctx2"], results["layout expert4-head2-ctx2-flexmoe"]
    diff = max(abs(a - b) for p, q in zip(plain, placed) for a, b in zip(p, q, strict=True))
    print(f"flexmoe vs plain expert parallel, {STEPS} steps: max |loss diff| {diff:.2e}; {logged[0]}")
    assert diff <= TOL


def test_gradient_buckets_train_as_the_plain_run_with_fewer_reduce_scatters(spawned):
    results, _, base = spawned(4)
    plain, bucketed = results["layout expert4-head2-ctx2"], results["layout expert4-head2-ctx2-buckets2"]
    diff = max(abs(a - b) for p, q in zip(plain, bucketed) for a, b in zip(p, q, strict=True))
    figures = {}
    for key in ("layout expert4-head2-ctx2", "layout expert4-head2-ctx2-buckets2"):
        rows = [r for r in read_jsonl(_run_dir(base, key) / "metrics.jsonl") if r.get("kind") == "train"]
        figures[key] = (rows[-1]["grad_reduce_calls"], rows[-1]["grad_reduce_exposed_s"])
    print(f"gradient buckets of 2 blocks vs 1, {STEPS} steps: max |loss diff| {diff:.2e}; (reduce-scatters, "
          f"exposed s) per step: {figures}")
    assert diff <= TOL
    # 4 blocks' units + the root (the expert units' group is one rank: nothing to reduce) -> 2 + the root
    assert figures["layout expert4-head2-ctx2"][0] == 5 and figures["layout expert4-head2-ctx2-buckets2"][0] == 3
    assert all(exposed > 0 for _, exposed in figures.values())


def test_the_pipelined_schedule_trains_as_the_plain_expert_parallel_run(spawned):
    results, _, _ = spawned(4)
    plain, pipelined = results["layout expert4-head2-ctx2"], results["layout expert4-head2-ctx2-pipeline3"]
    diff = max(abs(a - b) for p, q in zip(plain, pipelined) for a, b in zip(p, q, strict=True))
    print(f"pipelined (3 chunks) vs plain expert parallel, {STEPS} steps: max |loss diff| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("policy", list(POLICIES))
def test_expert_parallel_under_every_memory_policy(policy, reference, spawned):
    _check(f"expert2-ctx2 {policy}", f"policy {policy}", reference, spawned)


# ----------------------------------------------------------------------------------------------
# bytes: the counters against the closed form from the routed counts


def _bytes_of_one_step(args, run_dir):
    cfg = load_config("configs/debug.toml", [*MOE, "--train.steps=1", *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    from longctx.models.moe import moe_layers

    calls = []  # (counts [E], a forward (not a recomputation, which runs inside backward))
    for layer in moe_layers(trainer.model):
        layer.experts.register_forward_hook(
            lambda mod, inputs, out: calls.append((inputs[1].clone(), torch._C._current_graph_task_id() == -1)))
    comm.reset_counters()
    trainer.step(1)
    sent = dict(comm.counters().get("expert", {}))
    ep, rank = cfg.parallel.expert, dist.get_rank()
    me = rank % ep  # an expert group is `expert` adjacent ranks
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [c for c, _ in calls])
    group = range(rank - me, rank - me + ep)
    row = cfg.model.dim * 4  # fp32 rows
    expected = 0
    for i, (counts, first) in enumerate(calls):
        per_owner = counts.view(ep, -1).sum(1)
        out_rows = int(per_owner.sum() - per_owner[me])  # my tokens other ranks run
        in_rows = sum(int(every[r][i].view(ep, -1)[me].sum()) for r in group if r != rank)  # theirs I run
        # forward: dispatch out, combine back in; each backward once more (a recomputation re-runs the forward)
        expected += (out_rows + in_rows) * row * (2 if first else 1)
    counts_bytes = len(calls) * cfg.model.moe_experts * 8 * (ep - 1) // ep
    trainer.sampler.close()
    return sent.get("expert", 0), expected, sent.get("expert_counts", 0), counts_bytes, len(calls)


BYTES = {
    "expert4-head2-ctx2": ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"],
    "expert2-dp2-ctx2-full": ["--parallel.expert=2", "--parallel.ctx=2", "--memory.recompute=full"],
}


@pytest.mark.parametrize("layout", list(BYTES))
def test_expert_bytes_equal_the_closed_form(layout, spawned):
    for sent, expected, counts_sent, counts_expected, calls in spawned(4)[0][f"bytes {layout}"]:
        assert calls > 0 and expected > 0
        assert sent == expected, (sent, expected)
        assert counts_sent == counts_expected, (counts_sent, counts_expected)


# ----------------------------------------------------------------------------------------------
# resume under another expert degree


RESUME = [*MOE, "--train.steps=6", "--checkpoint.interval=3", "--parallel.head=2", "--parallel.ctx=2"]


def _resume(args, run_dir, checkpoint):
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}", f"--checkpoint.resume={checkpoint}",
                                             "--checkpoint.allow_changes=true"])
    return train(cfg, log=lambda *a, **k: None).losses


RESUMES = [(4, 2), (2, 4), (4, 1), ("4+copies", 4)]  # expert degree before, after
EXPERT_ARGS = {4: ["--parallel.expert=4"], 2: ["--parallel.expert=2"], 1: ["--parallel.expert=1"],
               "4+copies": ["--parallel.expert=4", *FLEXMOE]}  # FlexMoE's placement active from step 3


@pytest.fixture(scope="module")
def resumed(spawned):
    """{(before, after): (rank 0's losses uninterrupted, rank 0's losses of steps 4-6 resumed)}: the
    uninterrupted runs (one per degree before) ran in spawned(4); every resume in one more job."""
    results, _, base = spawned(4)
    jobs = []
    for before, after in RESUMES:
        first = _run_dir(base, f"resume from expert{before}")
        second = base / f"resume-expert{before}-to-expert{after}"
        shutil.copytree(first, second, ignore=shutil.ignore_patterns("step-00000006"))
        jobs.append(((before, after), _resume, ([*RESUME, *EXPERT_ARGS[after]], str(second),
                                                str(second / "checkpoints" / "step-00000003"))))
    out = run_spawned_many(4, jobs)
    return {(b, a): (results[f"resume from expert{b}"][0], out[(b, a)][0]) for b, a in RESUMES}


@pytest.mark.parametrize("before,after", RESUMES)
def test_resume_under_another_expert_degree(before, after, resumed):
    losses, resumed_losses = resumed[(before, after)]
    diff = max(abs(a - b) for a, b in zip(resumed_losses, losses[3:], strict=True))
    print(f"expert {before} -> {after}: steps 4-6 max |loss - uninterrupted| {diff:.2e}")
    assert diff <= 1e-5


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("args,message", [
    (["--parallel.expert=3"], "must divide model.moe.experts (8)"),
    (["--model.preset=debug", "--parallel.expert=2"], "but the model has none"),
    (["--parallel.expert=0"], "must be a positive degree"),
])
def test_bad_expert_degrees_are_one_clear_error(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/debug.toml", [*MOE, *args])


def test_expert_degree_must_divide_the_world():
    from longctx.job.dims import ParallelDims

    with pytest.raises(ConfigError, match="must divide the world size"):
        ParallelDims(dp_shard=-1, world_size=6, expert=4)


def test_expert_weights_are_sharded_not_copied(spawned):
    """What a rank holds of the expert weights, at rest (its FSDP shard) and while a layer runs (FSDP's
    unsharded weights): at expert 4 the forward holds a quarter of the experts; at rest the shards
    over the 4 ranks add up to the model's experts exactly once either way."""
    results = spawned(4)[0]
    one, four = results["weights expert1"], results["weights expert4"]
    total = one[0][2]
    assert sum(rest for rest, _, _ in one) == sum(rest for rest, _, _ in four) == total
    assert all(running == total for _, running, _ in one)
    assert all(running * 4 == total for _, running, _ in four)


def _expert_elements(args, run_dir):
    cfg = load_config("configs/debug.toml", [*MOE, "--train.steps=1", *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    from longctx.models.moe import moe_layers

    layers = moe_layers(trainer.model)
    weights = lambda mod: [mod.w1, mod.w2, mod.w3]  # noqa: E731
    local = lambda w: w.to_local() if hasattr(w, "to_local") else w  # noqa: E731
    at_rest = sum(local(w).numel() for layer in layers for w in weights(layer.experts))
    total = sum(w.numel() for layer in layers for w in weights(layer.experts))  # global shapes
    running = []
    layers[0].experts.register_forward_pre_hook(
        lambda mod, args: running.append(sum(local(w).numel() for w in weights(mod))))
    trainer.step(1)
    trainer.sampler.close()
    return at_rest, running[0] * len(layers), total


def _fsdp_traffic(args, run_dir):
    """FSDP2's bytes in one micro-step (forward + backward, gradients reduced) after a warm-up step,
    against the closed form the metrics line reports."""
    from longctx.parallel.context.volumes import fsdp_bytes_per_step
    from longctx.step.loss import forward_loss_sum

    cfg = load_config("configs/debug.toml", [*MOE, "--train.steps=2", *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.step(1)
    shares = trainer.sampler.step_batches(2)
    batch = to_device(shares[0][0], trainer.device)
    with library_traffic() as traffic:
        loss = forward_loss_sum(trainer.model, batch, None) + trainer.model.router_terms().loss
        loss.backward()
    model = trainer.model
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.layers.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    expected = fsdp_bytes_per_step(total, total - blocks, trainer.rt.dims, 1, 4, expert_params=experts)
    trainer.sampler.close()
    return sum(traffic.values()), expected["fsdp"]


FSDP = {
    "expert2-dp2-ctx2": ["--parallel.expert=2", "--parallel.ctx=2"],
    "expert4-head2-ctx2": ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"],
}


@pytest.mark.parametrize("layout", list(FSDP))
def test_fsdp_bytes_under_expert_parallelism_equal_the_closed_form(layout, spawned):
    for measured, expected in spawned(4)[0][f"fsdp {layout}"]:
        assert measured == pytest.approx(expected, rel=1e-9), (measured, expected)


def _skewed(args, run_dir):
    """3 steps with every token's first choice forced to expert 0 (a selection bias of 10: the router's
    weights are unchanged), the experts' SwiGLU rows probed (every layer MoE)."""
    from test_moe_expert_chunk import _WidestMatmul

    from longctx.models.moe import moe_layers

    cfg = load_config("configs/debug.toml", [*MOE, *NO_SAVE, "--train.steps=3", "--model.moe.dense_layers=", *args,
                                             f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    for layer in moe_layers(trainer.model):
        layer.router.expert_bias[0] = 10.0
    with _WidestMatmul() as probe:
        losses = trainer.run().losses
    return losses, probe.rows, trainer.router_counts[:, 0].sum().item() / trainer.router_counts.sum().item()


SKEWED = {  # router: (world, layout)
    "softmax": (4, ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"]),
    "sigmoid": (2, ["--parallel.expert=2", "--parallel.ctx=2", "--model.moe.router=sigmoid"]),
    "dts": (2, ["--parallel.expert=2", "--parallel.ctx=2", "--model.moe.router=dts"]),
}


@pytest.mark.parametrize("router", list(SKEWED))
def test_skewed_routing_under_expert_parallelism_is_exact_and_bounded(router, spawned, tmp_path):
    """Every token's first choice is expert 0, so its rank receives far more than its share (every
    token of its expert group once; DTS-Gate at step 0 sends every token to every expert); with
    memory.expert_chunk the experts' intermediates stay at 64 rows anyway."""
    world, layout = SKEWED[router]
    router_args = [a for a in layout if a.startswith("--model.")]
    single = _skewed(["--memory.recompute=selective", *router_args], tmp_path / "single")
    per_rank = spawned(world)[0][f"skew {router}"]
    # the skew is real: half the choices on one expert (top-2; DTS at step 0: one of its 8 choices)
    assert single[2] >= (0.125 if router == "dts" else 0.5) - 1e-6
    for losses, rows, share in per_rank:
        diff = max(abs(a - b) for a, b in zip(losses, single[0], strict=True))
        print(f"skewed {router}, {layout[0]}: max |loss - single| {diff:.2e}, widest expert activation {rows} rows")
        assert diff <= TOL and rows <= 64 and share == pytest.approx(single[2])
    assert single[1] > 64  # without the chunk, one process runs them all at once


# ----------------------------------------------------------------------------------------------
# one spawned job per world size


def _jobs(world):
    """(key, function, args without the run directory) of every configuration run on `world` ranks,
    in the order the tests above come."""
    jobs = [(f"layout {name}", _train, [*RUN, *args]) for name, (w, args) in LAYOUTS.items()
            if w == world]
    if world == 2:
        jobs += [(f"policy {name}", _train, [*RUN, "--parallel.expert=2", "--parallel.ctx=2",
                                             *args]) for name, args in POLICIES.items()]
    if world == 4:
        jobs += [(f"bytes {name}", _bytes_of_one_step, args) for name, args in BYTES.items()]
        jobs += [(f"resume from expert{before}", _train, [*RESUME, *EXPERT_ARGS[before]])
                 for before in dict.fromkeys(b for b, _ in RESUMES)]  # (4 -> 2 and 4 -> 1 continue one run)
        jobs += [("weights expert1", _expert_elements, ["--parallel.ctx=4"]),
                 ("weights expert4", _expert_elements, ["--parallel.ctx=4", "--parallel.expert=4"])]
        jobs += [(f"fsdp {name}", _fsdp_traffic, args) for name, args in FSDP.items()]
    jobs += [(f"skew {router}", _skewed, [*layout, "--memory.recompute=selective", "--memory.expert_chunk=64"])
             for router, (w, layout) in SKEWED.items() if w == world]
    return jobs


WORLD_OF = {**{f"layout {name}": w for name, (w, _) in LAYOUTS.items()}, **{f"policy {name}": 2 for name in POLICIES}}


def _run_dir(base, key):
    return base / key.replace(" ", "-")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """spawned(world) -> ({key: per-rank results}, {key: rank 0's seconds}, base of the run directories):
    every configuration of that world size in one job, run on first use."""
    # _skewed's probe (tests/unit/test_moe_expert_chunk.py), importable here and in the spawned ranks
    unit = str(Path(__file__).parents[1] / "unit")
    if unit not in sys.path:
        sys.path.insert(0, unit)
    done = {}

    def get(world):
        if world not in done:
            base = tmp_path_factory.mktemp(f"expert-world{world}")
            seconds = {}
            jobs = [(key, fn, (args, str(_run_dir(base, key)))) for key, fn, args in _jobs(world)]
            done[world] = run_spawned_many(world, jobs, seconds=seconds), seconds, base
        return done[world]

    return get
