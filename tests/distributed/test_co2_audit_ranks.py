"""train.data_parallel = co2 end to end in the Trainer (train/co2.py, step/co2.py), against a reference
written here from CO2's algorithm: 2 replicas of one rank each (2 ranks), and of two FSDP ranks each (4 ranks:
the replica's gradient averaged and its norm clipped over its own two shards), the debug model with one layer.

Each rank records the batches the Trainer hands its replica; the test then replays both replicas in one
process on plain (unsharded) models: each replica's AdamW steps on its own share of the global batch
(gradient = R x its summed loss / the global batch's labels, so that the replicas' mean is sync's
gradient; lr schedule, weight decay and gradient clipping of the replica's own gradient), and the outer
step written out from the formulas: a round every H steps sends each replica's progress since the last
round end; d steps later the mean change (outer momentum, its clip, outer lr) moves the outer model, and
each replica becomes the outer model plus its own progress since the round end shrunk by 1/(1 + lambda);
after the last step the in-flight change is merged and the replicas averaged. The Trainer's losses must
match the replay's step by step, and its final weights the replay's average. And a checkpoint holding outer
momentum and a change in flight resumes to the uninterrupted run.
"""

import pytest
import torch

from co2_reference import flat as _flat
from co2_reference import outer_change
from co2_reference import write as _write
from longctx.job.spawn import run_spawned_many

STEPS = 7
BASE = ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=4", f"--train.steps={STEPS}",
        "--train.warmup_steps=2", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=200", "--parallel.dp_replicate=2", "--train.data_parallel=co2", "--train.grad_clip=0.05"]
PLAIN = dict(H=2, d=0, alpha=1.0, beta=0.0, clip=0.0, penalty=0.0)
# rounds of 3 merged 2 steps after their end: the last step (7) falls between round end 6 and its merge, so the
# run ends merging it with the progress kept whole; the outer clip and the gradient clip both bite here
FULL = dict(H=3, d=2, alpha=0.8, beta=0.5, clip=0.05, penalty=0.5)


def _args(s: dict) -> list[str]:
    return [f"--train.co2_local_steps={s['H']}", f"--train.co2_overlap_steps={s['d']}",
            f"--train.co2_outer_lr={s['alpha']}", f"--train.co2_outer_momentum={s['beta']}",
            f"--train.co2_momentum_clip={s['clip']}", f"--train.co2_staleness_penalty={s['penalty']}"]


def _config(s: dict, run_dir: str):
    from longctx.config import load_config

    return load_config("configs/debug.toml", [*BASE, *_args(s), *s.get("extra", []), f"--train.run_dir={run_dir}"])


def _trained(s: dict, run_dir: str) -> dict:
    """On each rank: the Trainer's losses, the batches its rank got each step, the final full weights."""
    from longctx.train.trainer import Trainer

    trainer = Trainer(_config(s, run_dir), log=lambda *a, **k: None)
    seen, original = [], trainer.sampler.step_batches

    def recorded(step):
        shares = original(step)
        # (numpy arrays: by value; job/spawn.py now pickles a rank's tensors by value too)
        seen.append([(b.tokens.numpy().copy(), b.labels.numpy().copy(), b.positions.numpy().copy(),
                      None if b.doc_ids is None else b.doc_ids.numpy().copy(), valid) for b, valid in shares])
        return shares

    trainer.sampler.step_batches = recorded
    losses = trainer.run().losses
    weights = torch.cat([p.full_tensor().detach().reshape(-1) for p in trainer.model.parameters()]).numpy()
    return {"losses": losses, "batches": seen, "weights": weights}


def _local_step(model, optimizer, cfg, step: int, shares, replicas: int, valid: int) -> float:
    """One AdamW step of a replica on its shares (its micro-batches); `valid`: the step's labels over the whole
    job (every micro-batch's global batch); returns its summed loss."""
    from longctx.data.samples import Batch
    from longctx.step.gradients import clip_gradients
    from longctx.step.loss import forward_loss_sum
    from longctx.step.schedule import lr_at

    for group in optimizer.param_groups:
        group["lr"] = lr_at(step - 1, cfg)
    total = 0.0
    for *arrays, _ in shares:
        loss_sum = forward_loss_sum(model, Batch(*(None if a is None else torch.from_numpy(a) for a in arrays)), None)
        (loss_sum * replicas / valid).backward()
        total += float(loss_sum.detach())
    clip_gradients(model, cfg.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _replay(s: dict, cfg, batches: list) -> tuple[list[float], torch.Tensor]:
    """Both replicas on one process, the outer step from the formulas; returns the global losses and the
    final (averaged) weights."""
    from longctx.models.llama import build_model
    from longctx.step.optimizer import make_optimizer

    models = []
    for _ in batches:
        model = build_model(cfg.model, device="meta")
        model.to_empty(device="cpu")
        model.init_weights(cfg.train.seed)
        models.append(model)
    optimizers = [make_optimizer(m, cfg) for m in models]
    R, d = len(models), s["d"] or s["H"]
    anchor, momentum = _flat(models[0]), torch.zeros_like(_flat(models[0]))
    start = [anchor.clone() for _ in models]  # where each replica's next change is measured from
    marks, sent, sent_at, losses = None, None, None, []

    def merge(keep: float):
        nonlocal anchor, momentum, sent
        change, momentum = outer_change(sent, momentum, s["beta"], s["clip"])
        anchor = anchor - s["alpha"] * change
        for i, m in enumerate(models):
            progress = _flat(m) - marks[i]
            _write(m, anchor + keep * progress)
            start[i] = _flat(m) - progress
        sent = None

    for step in range(1, STEPS + 1):
        # the step's labels: each micro-batch's global count (a replica's shares are its ranks' micro-batches in
        # rank order, each rank's carrying the same counts), summed over the train.grad_accum micro-batches
        valid = sum(share[4] for share in batches[0][step - 1][:cfg.train.grad_accum])
        losses.append(sum(_local_step(m, o, cfg, step, b[step - 1], R, valid)
                          for m, o, b in zip(models, optimizers, batches)) / valid)
        if sent is not None and step == sent_at + d:
            merge(1.0 / (1.0 + s["penalty"]))
        if step % s["H"] == 0:
            if sent is not None:  # (d = H: merged just above; never reached)
                merge(1.0 / (1.0 + s["penalty"]))
            marks = [_flat(m) for m in models]
            sent = [a - x for a, x in zip(start, marks)]
            start, sent_at = [x.clone() for x in marks], step
    if sent is not None:
        merge(1.0)
    return losses, sum(_flat(m) for m in models) / R


# accum: 2 micro-batches a step, each replica's gradient summed over them and normalised by the step's labels (both
# micro-batches' global batches), FSDP's gradients reduced after each micro-batch (memory.grad_sync)
ACCUM = dict(FULL, extra=["--train.grad_accum=2", "--train.global_batch=8", "--memory.grad_sync=micro_batch"])


REPLAYED = [("plain", PLAIN, 2), ("full", FULL, 4), ("accum", ACCUM, 4)]


def _replayed_settings(settings: dict, world: int) -> dict:
    if world == 4:  # (2 replicas of 2 FSDP ranks)
        return dict(settings, extra=[*settings.get("extra", []), "--parallel.dp_shard=2"])
    return settings


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """spawned(world) -> ({key: per-rank results}, run directory): every run of this module on `world` ranks in
    one job, run on first use (the 2-rank runs of the debug model under co2 paid the ranks' start and their
    first step's set-up in three jobs); the runs a resume reads come before it."""
    done = {}

    def get(world):
        if world not in done:
            d = tmp_path_factory.mktemp(f"co2-world{world}")
            jobs = [(name, _trained, (_replayed_settings(s, w), str(d / name)))
                    for name, s, w in REPLAYED if w == world]
            if world == 2:
                jobs += _resume_jobs(d) + _lengthened_jobs(d)
            done[world] = (run_spawned_many(world, jobs), d)
        return done[world]

    return get


@pytest.mark.parametrize("name,settings,world", REPLAYED)
def test_trainer_co2_matches_a_replay_of_the_algorithm(tmp_path, name, settings, world, spawned):
    settings = _replayed_settings(settings, world)
    ranks = spawned(world)[0][name]
    per = world // 2
    # each replica's step: its ranks' shares together
    replicas = [[[share for rank in ranks[r * per:(r + 1) * per] for share in rank["batches"][step]]
                 for step in range(STEPS)] for r in range(2)]
    # the replicas (and the ranks) read disjoint samples: no row of one rank's batch is in another's
    rows = [[t for t, *_ in step] for rank in ranks for step in rank["batches"]]
    for step in range(STEPS):
        mine = [rows[r * STEPS + step] for r in range(world)]
        for i in range(world):
            for j in range(i + 1, world):
                assert not any((x == y).all() for a in mine[i] for b in mine[j] for x in a for y in b)
    cfg = _config(settings, str(tmp_path / "replay"))
    losses, weights = _replay(settings, cfg, replicas)
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for r in ranks:
        assert float((torch.from_numpy(r["weights"]) - weights).abs().max()) < 1e-5


def _losses_and_weights(s: dict, run_dir: str, extra: list[str]) -> tuple[list[float], object]:
    from longctx.train.trainer import train

    cfg = _config(dict(s, extra=[*s.get("extra", []), *extra]), run_dir)
    losses = train(cfg, log=lambda *a, **k: None).losses
    state = torch.load(f"{run_dir}/checkpoints/step-{cfg.train.steps:08d}/local-rank0.pt", weights_only=True)
    return losses, state["co2"]["weights"].numpy()


def _resume_jobs(d) -> list:
    # 10 steps of FULL (H 3, merged 2 steps after): round ends 3, 6, 9, merges 5, 8; the checkpoint at step 7
    # holds a non-zero outer momentum (merge 5) and round 6's change in flight, merged at step 8 after the resume
    longer = ["--train.steps=10", "--checkpoint.interval=7", "--checkpoint.final=true"]
    whole, resumed = str(d / "whole"), str(d / "resumed")
    return [("whole", _losses_and_weights, (FULL, whole, longer)),
            ("resumed", _losses_and_weights, (FULL, resumed,
                                              [*longer, f"--checkpoint.resume={whole}/checkpoints/step-00000007"]))]


def test_a_checkpoint_with_outer_momentum_and_a_change_in_flight_resumes_exactly(spawned):
    out, d = spawned(2)
    whole = str(d / "whole")
    (losses, weights), (again, weights_again) = out["whole"][0], out["resumed"][0]
    assert len(again) == 3 and again == pytest.approx(losses[7:], rel=1e-6, abs=1e-6)
    assert float(abs(weights - weights_again).max()) < 1e-6
    _saved_state_is_the_costed_host_copy(f"{whole}/checkpoints/step-00000007/local-rank0.pt", whole)


def _saved_state_is_the_costed_host_copy(path: str, run_dir: str) -> None:
    """The rank's CO2 state a save wrote (momentum on, a change in flight) is in host memory, and its bytes are
    what the host budget counts for it (costs/model_states.py co2_checkpoint_bytes; the AdamW step counts,
    one scalar per tensor, aside)."""
    from longctx.costs.model_states import co2_checkpoint_bytes
    from longctx.costs.shape import MeshShape

    state = torch.load(path, weights_only=True)["co2"]
    tensors = [t for k, t in state.items() if isinstance(t, torch.Tensor)]
    tensors += [t for moments in state["optimizer"] for t in moments.values() if t.dim() > 0]
    assert all(t.device.type == "cpu" for t in tensors) and len(tensors) == 5 + 2 * len(state["optimizer"])
    shape = MeshShape(dp_replicate=2, data_parallel="co2", local_steps=FULL["H"])
    costed = co2_checkpoint_bytes(_config(FULL, run_dir).model, shape, outer_momentum=True)
    assert sum(t.numel() * t.element_size() for t in tensors) == costed


def _said_on_resume(s: dict, run_dir: str, extra: list[str]) -> list[str]:
    from longctx.train.trainer import train

    lines: list[str] = []
    train(_config(dict(s, extra=extra), run_dir), log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return [x for x in lines if x.startswith("co2: ")]


def _lengthened_jobs(d) -> list:
    # the last step's checkpoint holds the replicas' average with the outer momentum reset (final_average): a run
    # lengthened from it trains another trajectory than the uninterrupted longer run (docs/parallelism.md), said
    # once; from a checkpoint before the last step (the interval's) it goes on exactly and says nothing
    short = str(d / "short")
    runs = [("short", _said_on_resume, (FULL, short, ["--train.steps=4", "--checkpoint.interval=3",
                                                      "--checkpoint.final=true"]))]
    for name, step in (("from last", 4), ("from interval", 3)):
        runs.append((name, _said_on_resume, (FULL, str(d / name), [
            "--train.steps=5", f"--checkpoint.resume={short}/checkpoints/step-{step:08d}"])))
    return runs


def test_a_lengthened_run_resumed_from_its_last_step_says_it_goes_on_from_the_average(spawned):
    out = spawned(2)[0]
    assert out["short"][0] == [] and out["from interval"][0] == []
    (note,) = out["from last"][0]
    assert "step-00000004 is its run's last step (4)" in note and "averaged" in note and "momentum" in note
    assert "checkpoint.interval" in note
