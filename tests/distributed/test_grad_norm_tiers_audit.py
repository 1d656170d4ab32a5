"""Audit of the gradient norm and clipping under every parallel layout and model-state tier (step/gradients.py,
step/host_optimizer.py, train/co2.py) against a one-process reference: a world-1 run's fp32 gradients of the
same data, their total L2 norm accumulated here in float64.

Each run records, at every step, the gradients before clipping (full tensors, gathered from the shards), the
gradient norm the step returned (and the metrics file's), and the gradients the optimizer then applied. Checked:
- the reported norm is the float64 norm of the run's own gradients, and the applied gradients are those scaled
  by min(1, clip / (norm + 1e-6)) (clipping bites: clip is a fraction of the norm);
- the gradients themselves are the one-process run's (each expert, router and shared expert once; replicated
  weights' gradients reduced over head x ctx, not double counted), so the norm is the true global one;
- a non-finite gradient made on one rank, landing in one shard, is seen by every rank: the step is skipped
  on all of them (weights unchanged everywhere), never applied on some.
Runs are tiny (2 layers, dim 32, seq 64) and take 1-2 steps."""

import json
import math

import pytest
import torch

from longctx.job.spawn import run_spawned_many

CLIP = 0.05  # well under the debug model's first gradient norms (~1-3): clipping bites at every step
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=60",
        "--train.seq_len=64", "--train.warmup_steps=1", "--model.layers=2", "--model.dim=32", "--model.ffn_dim=64",
        "--model.heads=4", "--model.kv_heads=2", "--metrics.log_interval=1", "--checkpoint.final=false",
        "--train.global_batch=4", f"--train.grad_clip={CLIP}"]
# routers, routed experts (4, top 2) and a shared expert in both layers, balancing losses on
MOE = ["--model.preset=debug-moe", "--model.moe.experts=4", "--model.moe.expert_dim=32", "--model.moe.dense_layers=",
       "--model.moe.shared_experts=1", "--model.moe.shared_dim=32"]
TIED = ["--model.tie_embeddings=true"]
ACCUM = ["--train.grad_accum=2"]
QGZ = ["--parallel.zero_pp=qgz", "--parallel.ranks_per_node=1", "--parallel.zero_pp_block=64"]

# name: (world, the model's arguments (the reference's too), the layout's and tier's)
RUNS = {
    "fsdp2": (2, [], []),
    "fsdp2 accum": (2, [], ACCUM),
    "fsdp2 tied": (2, TIED, []),
    "fsdp2 host_optimizer accum": (2, [], [*ACCUM, "--memory.model_states=host_optimizer"]),
    "fsdp2 host accum": (2, [], [*ACCUM, "--memory.model_states=host"]),
    "fsdp2 qgz": (2, [], QGZ),
    "expert2 moe": (2, MOE, ["--parallel.expert=2"]),
    "expert2 moe host_optimizer": (2, MOE, ["--parallel.expert=2", "--memory.model_states=host_optimizer"]),
    "expert2 moe host accum": (2, MOE, ["--parallel.expert=2", "--memory.model_states=host", *ACCUM]),
    "fsdp2 host_optimizer accum micro-sync": (2, [], [*ACCUM, "--memory.model_states=host_optimizer",
                                                       "--memory.grad_sync=micro_batch"]),
    "fsdp4": (4, [], []),
    "hsdp 2 head2": (4, [], ["--parallel.dp_replicate=2", "--parallel.head=2"]),
    "hsdp 2x2": (4, [], ["--parallel.dp_replicate=2"]),
    "hsdp 2x2 host_optimizer": (4, [], ["--parallel.dp_replicate=2", "--memory.model_states=host_optimizer"]),
    "hsdp 2x2 qgz": (4, [], ["--parallel.dp_replicate=2", *QGZ]),
    "head2 ctx2 tied": (4, TIED, ["--parallel.head=2", "--parallel.ctx=2"]),
    "head2 ctx2 host": (4, [], ["--parallel.head=2", "--parallel.ctx=2", "--memory.model_states=host"]),
    "expert2 ctx2 moe": (4, MOE, ["--parallel.expert=2", "--parallel.ctx=2"]),
    "expert4 hsdp moe": (4, MOE, ["--parallel.expert=4", "--parallel.dp_replicate=2"]),
    "expert2 hsdp moe host_optimizer": (4, MOE, ["--parallel.expert=2", "--parallel.dp_replicate=2",
                                                 "--memory.model_states=host_optimizer"]),
    # FlexMoE's copies of hot experts (placed again every step) and hierarchical, pipelined dispatch
    "expert4 moe replicas": (4, MOE, ["--parallel.expert=4", "--parallel.expert_replicas=1",
                                      "--parallel.expert_placement_window=1"]),
    "expert4 moe hierarchical": (4, MOE, ["--parallel.expert=4", "--parallel.expert_ranks_per_node=2",
                                          "--parallel.expert_pipeline_chunks=2"]),
}
CO2 = {  # name: (world, layout): each replica clips its own gradient; the norm reported is the largest
    "co2 2": (2, ["--parallel.dp_replicate=2", "--train.data_parallel=co2", "--train.co2_local_steps=2"]),
    "co2 2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.data_parallel=co2",
                    "--train.co2_local_steps=2"]),
    # the experts' weights are one copy over the replicas (their expert-data group spans them): synchronous
    "co2 expert2": (4, [*MOE, "--parallel.dp_replicate=2", "--parallel.expert=2", "--train.data_parallel=co2",
                        "--train.co2_local_steps=2"]),
}
INF, NAN = float("inf"), float("nan")
# name: (world, model, layout, (the rank whose backward makes it, step, value)): a non-finite gradient element in
# the last block's ffn_norm weight, made on rank 0 before any reduction; its shard is the last rank's of the group
NONFINITE = {
    "world1 host_optimizer": (1, [], ["--memory.model_states=host_optimizer"], (0, 1, NAN)),
    "fsdp2": (2, [], ACCUM, (0, 1, NAN)),
    "fsdp2 host_optimizer": (2, [], [*ACCUM, "--memory.model_states=host_optimizer"], (0, 1, INF)),
    "fsdp2 host": (2, [], ["--memory.model_states=host"], (0, 1, NAN)),
    "fsdp2 qgz": (2, [], QGZ, (0, 1, INF)),
    "expert2 moe": (2, MOE, ["--parallel.expert=2"], (0, 1, NAN)),
    "hsdp 2x2": (4, [], ["--parallel.dp_replicate=2"], (0, 1, INF)),
    "hsdp 2x2 host_optimizer": (4, [], ["--parallel.dp_replicate=2", "--memory.model_states=host_optimizer"],
                                (0, 1, NAN)),
    "head2 ctx2 host": (4, [], ["--parallel.head=2", "--parallel.ctx=2", "--memory.model_states=host"], (3, 1, NAN)),
    "co2 2x2": (4, [], CO2["co2 2x2"][1], (0, 1, NAN)),  # (replica 0's gradient alone)
}
WORLD1 = {"host_optimizer accum": ACCUM + ["--memory.model_states=host_optimizer"],
          "host_optimizer tied": TIED + ["--memory.model_states=host_optimizer"],
          "host accum": ACCUM + ["--memory.model_states=host"]}


def _full(p, g):
    """The whole gradient of parameter p (g: its DTensor gradient, or a local shard of it, or a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        return g.full_tensor().detach().double().clone()
    if isinstance(p, DTensor):
        return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()).full_tensor().detach().double().clone()
    return g.detach().double().clone()


def _grads(trainer):
    """{name: full gradient} of the step about to be clipped or applied, wherever the tier keeps it."""
    opt, model = trainer.optimizer, trainer.model
    if hasattr(opt, "masters"):  # host_optimizer: the host buffers (FSDP's shard gradients moved there first)
        opt.host_gradients()
        where = {id(p): m.grad for p, m in zip(opt.params, opt.masters)}
        return {n: _full(p, where[id(p)]) for n, p in model.named_parameters() if where.get(id(p)) is not None}
    return {n: _full(p, p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _weights(model):
    return {n: _full(p, p) for n, p in model.named_parameters()}


def _poison_hook(trainer, rank: int, step: int, value: float):
    """At `step`, on global rank `rank` only: the final norm's last weight element's gradient made `value`
    in that rank's own backward, before any reduction (FSDP's reduce-scatter then puts it in the shard of
    the last rank of the group alone: one rank's shard)."""
    import torch.distributed as dist

    state = {"step": 0, "hooked": set()}

    def poison(g):
        if state["step"] != step:
            return g
        g = g.clone()
        g.view(-1)[-1] = value
        return g

    def pre_hook(module, args):  # (FSDP has gathered the weight: the unsharded one the backward accumulates into)
        if (dist.get_rank() if dist.is_initialized() else 0) == rank and id(module.weight) not in state["hooked"]:
            state["hooked"].add(id(module.weight))
            module.weight.register_hook(poison)

    trainer.model.layers[-1].ffn_norm.register_forward_pre_hook(pre_hook)
    return state


def _probe(args, run_dir, steps=1, poison=None):
    """On each rank: per step the gradients before clipping, the norm returned, the gradients applied, and (the
    non-finite runs, `poison` given: their test alone reads them) the weights before step 1 and after each step;
    the metrics file's grad_norm; and this rank's losses. (Gathering every weight three times and pickling it in
    float64 was work no check of the other runs read.)"""
    from longctx.config import load_config
    from longctx.train import step_run
    from longctx.train import trainer as trainer_mod

    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.steps={steps}", f"--train.run_dir={run_dir}"])
    trainer = trainer_mod.Trainer(cfg, log=lambda *a, **k: None)
    out = {"raw": [], "applied": [], "norm": [], "own_norm": [], "applied_flag": [], "after": [], "before": {}}
    state = _poison_hook(trainer, *poison) if poison else None
    clip, guarded, step_fn = step_run.clip_step_gradients, step_run.guarded_step, trainer.step

    def clip_recorded(model, optimizer, max_norm):
        out["raw"].append(_grads(trainer))
        norm = clip(model, optimizer, max_norm)
        out["own_norm"].append(float(norm))  # (before co2's agreement over the replicas)
        return norm

    def guarded_recorded(optimizer, apply):
        out["applied"].append(_grads(trainer))
        out["applied_flag"].append(bool(apply))
        guarded(optimizer, apply)

    def step_recorded(step):
        if state is not None:
            state["step"] = step
        if step == 1 and poison:
            out["before"] = _weights(trainer.model)
        loss, norm, lr = step_fn(step)
        out["norm"].append(float(norm))
        if hasattr(trainer.optimizer, "finish_update"):
            trainer.optimizer.finish_update()
        if poison:
            out["after"].append(_weights(trainer.model))
        return loss, norm, lr

    step_run.clip_step_gradients, step_run.guarded_step, trainer.step = clip_recorded, guarded_recorded, \
        step_recorded
    try:
        out["losses"] = trainer.run().losses
    finally:
        step_run.clip_step_gradients, step_run.guarded_step = clip, guarded
    metrics = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")] if _is_main() else []
    out["logged"] = [r["grad_norm"] for r in metrics if r.get("kind") == "train"]
    # (numpy arrays: by value; job/spawn.py now pickles a rank's tensors by value too)
    for key in ("raw", "applied", "after"):
        out[key] = [{n: g.numpy() for n, g in d.items()} for d in out[key]]
    out["before"] = {n: g.numpy() for n, g in out["before"].items()}
    from longctx.job.launch import finish_distributed

    finish_distributed()  # (the one-rank group a world-1 host run made, as `longctx train` ends it; spawn's: not ours)
    return out


def _is_main():
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _norm64(grads: dict) -> float:
    return math.sqrt(sum(float((torch.as_tensor(g).double() ** 2).sum()) for g in grads.values()))


STEPS = 2


def _model_of(name: str) -> str:
    if "moe" in name:  # (the balancing losses are a mean over the micro-batches: docs/moe.md)
        return "moe accum" if "accum" in name else "moe"
    return "tied" if "tied" in name else "dense"


MODELS = {"dense": [], "tied": TIED, "moe": MOE, "moe accum": [*MOE, *ACCUM]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gnorm")
    out = {f"ref {m}": _probe(args, f"{base}/ref-{m}", STEPS) for m, args in MODELS.items()}
    out.update({f"world1 {n}": _probe(args, f"{base}/w1-{i}", STEPS) for i, (n, args) in enumerate(WORLD1.items())})
    for world in (2, 4):
        jobs = [(n, _probe, ([*m, *lay], f"{base}/{i}", STEPS)) for i, (n, (w, m, lay)) in enumerate(RUNS.items())
                if w == world]
        jobs += [(n, _probe, (lay, f"{base}/c{i}", STEPS)) for i, (n, (w, lay)) in enumerate(CO2.items()) if w == world]
        jobs += [(f"nonfinite {n}", _probe, ([*m, *lay], f"{base}/n{i}", STEPS, poison))
                 for i, (n, (w, m, lay, poison)) in enumerate(NONFINITE.items()) if w == world]
        out.update(run_spawned_many(world, jobs))
    out.update({f"nonfinite {n}": _probe([*m, *lay], f"{base}/n1-{n}", STEPS, poison)
                for n, (w, m, lay, poison) in NONFINITE.items() if w == 1})
    return out


def _close(a: dict, b: dict, rel: float) -> float:
    """max over tensors of |a - b| / the largest |b| of all: the relative gap of two gradient sets."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(float(abs(torch.as_tensor(g)).max()) for g in b.values())
    gap = max(float(abs(torch.as_tensor(a[k]) - torch.as_tensor(b[k])).max()) for k in b) / scale
    assert gap <= rel, f"gradients differ by {gap:.2e} of their largest element"
    return gap


def _check_own_norm_and_clip(rank: dict, step: int):
    """The norm returned is the float64 norm of the rank's gradients; the applied ones are them clipped to it."""
    raw, applied, norm = rank["raw"][step], rank["applied"][step], rank["own_norm"][step]
    own = _norm64(raw)
    assert norm == pytest.approx(own, rel=1e-5)
    coef = min(1.0, CLIP / (own + 1e-6))
    assert coef < 0.5  # clipping bites
    _close(applied, {k: torch.as_tensor(g) * coef for k, g in raw.items()}, 1e-5)
    return own


@pytest.mark.parametrize("name", [*RUNS, *(f"world1 {n}" for n in WORLD1), *(f"ref {m}" for m in MODELS)])
def test_reported_norm_and_clipped_update_equal_the_one_process_reference(runs, name):
    ref = runs[f"ref {_model_of(name)}"]
    ranks = runs[name] if isinstance(runs[name], list) else [runs[name]]
    for step in range(STEPS):
        ref_norm = _norm64(ref["raw"][step])
        for rank in ranks:
            own = _check_own_norm_and_clip(rank, step)
            assert rank["norm"][step] == rank["own_norm"][step]
            # (qgz: an int8 reduce-scatter, a block's error up to 1/254 of its largest element per sum; step 2
            # after one AdamW update, which its normalisation makes sign-like for the smallest gradients)
            norm_tol, grad_tol = ((2e-3, 1e-2) if "qgz" in name else (1e-4, 5e-4))
            assert own == pytest.approx(ref_norm, rel=norm_tol)
            _close(rank["raw"][step], ref["raw"][step], grad_tol * (1 + 4 * step))
    logged = ranks[0]["logged"]
    assert logged == pytest.approx([r for r in ranks[0]["norm"]], rel=1e-7)


@pytest.mark.parametrize("name", [n for n in CO2 if "expert" not in n])
def test_co2_each_replica_clips_its_own_gradient_and_the_largest_norm_is_reported(runs, name):
    ranks, ref = runs[name], runs["ref dense"]
    per = len(ranks) // 2
    replicas = [ranks[0], ranks[per]]
    for i, rank in enumerate(ranks):  # a replica's ranks see its gradient alike
        assert _norm64(rank["raw"][0]) == pytest.approx(_norm64(replicas[i // per]["raw"][0]), rel=1e-12)
    own = [_check_own_norm_and_clip(r, 0) for r in replicas]
    assert own[0] != pytest.approx(own[1], rel=1e-3)  # (the replicas' data differ)
    for rank in ranks:
        assert rank["norm"][0] == pytest.approx(max(own), rel=1e-6)
    # a replica's gradient is R x its share: their mean is the global gradient
    mean = {k: (torch.as_tensor(replicas[0]["raw"][0][k]) + torch.as_tensor(replicas[1]["raw"][0][k])) / 2
            for k in ref["raw"][0]}
    _close(mean, ref["raw"][0], 5e-4)


@pytest.mark.parametrize("name", list(NONFINITE))
def test_a_non_finite_gradient_in_one_shard_skips_the_step_on_every_rank(runs, name):
    import numpy as np

    ranks = runs[f"nonfinite {name}"]
    ranks = ranks if isinstance(ranks, list) else [ranks]
    for rank in ranks:
        assert not math.isfinite(rank["norm"][0]), rank["norm"]
        assert rank["applied_flag"] == [False, True]
        assert math.isfinite(rank["losses"][0]) and math.isfinite(rank["norm"][1])  # (the loss saw nothing)
        for k, w in rank["before"].items():  # step 1 not applied, step 2 applied, on every rank
            assert np.array_equal(rank["after"][0][k], w), k
        assert any(not np.array_equal(rank["after"][1][k], w) for k, w in rank["before"].items())
    for rank in ranks[1:]:
        for k, w in ranks[0]["after"][1].items():
            if "co2" not in name:  # (co2's replicas differ by design)
                assert np.array_equal(rank["after"][1][k], w), k


def test_co2_clips_the_synchronous_expert_weights_by_one_coefficient(runs):
    """co2 with expert parallelism: the experts' gradients are the global ones (their FSDP group spans the
    replicas) and each expert weight is one tensor sharded over both replicas, so its clipped gradient must be
    the global gradient times ONE coefficient, the reported (largest) norm's: each shard clipped by its own
    replica's coefficient scaled the halves of every expert matrix 29% apart (0.036 and 0.047 here)."""
    ranks, ref = runs["co2 expert2"], runs["ref moe"]
    reported = ranks[0]["norm"][0]
    assert max(r["own_norm"][0] for r in ranks) == pytest.approx(reported, rel=1e-7)
    assert min(r["own_norm"][0] for r in ranks) < 0.9 * reported  # (the replicas' coefficients differ)
    agreed = min(1.0, CLIP / (reported + 1e-6))
    for rank in ranks:
        raw, applied = rank["raw"][0], rank["applied"][0]
        experts = {k for k in raw if ".experts." in k}
        assert len(experts) == 6
        _close({k: raw[k] for k in experts}, {k: ref["raw"][0][k] for k in experts}, 5e-4)  # the global gradient
        _close({k: applied[k] for k in experts}, {k: torch.as_tensor(raw[k]) * agreed for k in experts}, 1e-5)
        own = min(1.0, CLIP / (rank["own_norm"][0] + 1e-6))  # the replica's own weights: its own coefficient
        _close({k: applied[k] for k in raw if k not in experts},
               {k: torch.as_tensor(raw[k]) * own for k in raw if k not in experts}, 1e-5)
