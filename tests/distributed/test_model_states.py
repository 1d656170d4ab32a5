"""memory.model_states = host (FSDP2's CPU offload: fp32 weights, gradients and AdamW moments in host
memory) and host_optimizer (the weights on the device, their master copy, gradients and moments in
host memory: step/host_optimizer.py) against `device`, step by step (issue 49): at world 1 (host:
a one-rank FSDP job; host_optimizer: the plain model, gradients taken by hooks, also under
gradient accumulation), under head 2 x ctx 2, and for debug-moe under expert 2 x ctx 2; and a
checkpoint saved under one tier resumed under another, against the uninterrupted run. On CPU host
and device are one memory, so the copies cost nothing, but the code paths are the tiers' own: the
losses must be the same."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

STEPS = 6  # warm-up 2: the resumes (from step STEPS / 2 = 3) start past it, with 3 AdamW steps to compare
TIERS = ("device", "host_optimizer", "host")
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
        "--train.seq_len=256", "--train.warmup_steps=2", f"--train.steps={STEPS}"]
TOLERANCE = 1e-6


def _losses(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


# the world-1 runs save every STEPS / 2: each is the first half of the resumes from its tier (one
# uninterrupted run that saves, not a second one)
SAVE = ["--checkpoint.interval", str(STEPS // 2)]


def _resumed(then_tier, saved_dir, run_dir):
    """The middle checkpoint of the run in `saved_dir` (STEPS steps, saved every STEPS / 2) resumed under
    `then_tier` up to STEPS (the same schedule as one run: train.steps is STEPS in both)."""
    middle = f"{saved_dir}/checkpoints/step-{STEPS // 2:08d}"
    return _losses([*SAVE, f"--memory.model_states={then_tier}", f"--checkpoint.resume={middle}"], run_dir)


def _offloaded(tier, run_dir):
    """(every parameter an FSDP shard, every FSDP unit offloaded to the host) of the model a run builds."""
    from torch.distributed.tensor import DTensor

    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, f"--memory.model_states={tier}", f"--train.run_dir={run_dir}"])
    model = Trainer(cfg, log=lambda *a, **k: None).model
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    offloaded = [p.offload_to_cpu for u in units for g in [u._get_fsdp_state()._fsdp_param_group] if g is not None
                 for p in g.fsdp_params]
    return all(isinstance(p, DTensor) for p in model.parameters()), bool(offloaded) and all(offloaded)


def _after_backward(run_dir):
    """Under host_optimizer at world 1, after one micro-batch's backward: (every weight's device
    gradient freed, every gradient in the optimizer's host buffers, the buffers equal to the
    device tier's gradients of the same batch)."""
    import torch

    from longctx.train.trainer import Trainer

    grads = {}
    for tier in ("device", "host_optimizer"):
        cfg = load_config("configs/debug.toml", [*BASE, f"--memory.model_states={tier}",
                                                 f"--train.run_dir={run_dir}-{tier}"])
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        torch.manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 64))
        trainer.model(tokens, None, None, labels=tokens, loss_reduction="sum").backward()
        if tier == "device":
            grads[tier] = [p.grad.clone() for p in trainer.optimizer.param_groups[0]["params"]]
        else:
            freed = all(p.grad is None for p in trainer.model.parameters())
            grads[tier] = [m.grad for m in trainer.optimizer.masters[:len(grads["device"])]]
    same = all(torch.equal(a, b) for a, b in zip(grads["device"], grads["host_optimizer"]))
    return freed, same


def _metrics_fields(run_dir):
    """The host update's fields on each metrics line of a 3-step host_optimizer run."""
    import json
    from pathlib import Path

    cfg = load_config("configs/debug.toml", [*BASE, "--train.steps=3", "--metrics.log_interval=1",
                                             "--memory.model_states=host_optimizer", f"--train.run_dir={run_dir}"])
    train(cfg, log=lambda *a, **k: None)
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x.get("host_step_s"), x.get("host_exposed_s")) for x in lines if "loss" in x]


def _jobs(base, layouts, tiers=TIERS, save=()):
    jobs = []
    for name, args in layouts.items():
        for tier in tiers:
            run_dir = f"{base}/{name}-{tier}"
            jobs.append((f"{name} {tier}", _losses, ([*save, *args, f"--memory.model_states={tier}"], run_dir)))
    return jobs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    base = tmp_path_factory.mktemp("states1")
    jobs = _jobs(base, {"world1": []}, save=SAVE)  # (saved in {base}/world1-{tier}: resumed below)
    jobs += [("host built", _offloaded, ("host", f"{base}/built-host")),
             ("device built", _offloaded, ("device", f"{base}/built-device")),
             ("host -> device", _resumed, ("device", f"{base}/world1-host", f"{base}/resume-a")),
             ("device -> host", _resumed, ("host", f"{base}/world1-device", f"{base}/resume-b")),
             ("host_optimizer -> device", _resumed, ("device", f"{base}/world1-host_optimizer", f"{base}/resume-c")),
             ("device -> host_optimizer", _resumed, ("host_optimizer", f"{base}/world1-device", f"{base}/resume-d")),
             ("host_optimizer after backward", _after_backward, (f"{base}/after-backward",)),
             ("host_optimizer fields", _metrics_fields, (f"{base}/fields",))]
    jobs += _jobs(base, {"accum2": ["--train.grad_accum=2", "--train.global_batch=4"]}, ("device", "host_optimizer"))
    return run_spawned_many(1, jobs)


@pytest.fixture(scope="module")
def two_and_four_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("states24")
    return {**run_spawned_many(4, _jobs(base, {"head2-ctx2": ["--parallel.head=2", "--parallel.ctx=2"]})),
            **run_spawned_many(2, _jobs(base, {"moe expert2-ctx2": ["--model.preset=debug-moe", "--parallel.expert=2",
                                                                     "--parallel.ctx=2"]}))}


def _close(a, b):
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


def test_host_states_are_fsdp_shards_offloaded_even_at_world_1(one_rank):
    assert one_rank["host built"] == [(True, True)]
    assert one_rank["device built"] == [(False, False)]  # (world 1, device: the plain model, no FSDP)


@pytest.mark.parametrize("tier", ["host", "host_optimizer"])
def test_host_states_train_as_device_states_at_world_1(one_rank, tier):
    (device,), (host,) = one_rank["world1 device"], one_rank[f"world1 {tier}"]
    assert len(device) == STEPS and _close(device, host) <= TOLERANCE


def test_host_optimizer_accumulates_micro_batches_as_the_device_does(one_rank):
    (device,), (host,) = one_rank["accum2 device"], one_rank["accum2 host_optimizer"]
    assert len(device) == STEPS and _close(device, host) <= TOLERANCE


def test_host_optimizer_takes_every_gradient_off_the_device_during_backward(one_rank):
    assert one_rank["host_optimizer after backward"] == [(True, True)]


def test_host_optimizer_puts_its_update_time_on_the_metrics_line(one_rank):
    (lines,) = one_rank["host_optimizer fields"]
    assert [step for step, _, _ in lines] == [1, 2, 3]
    assert lines[0][1:] == (None, None)  # no update before the first forward
    # (no bound of the wait by the update's time: a forward wakes a moment after the update's last unit is
    # ready, which on a loaded machine can be long; tests/unit/test_host_update_time_race.py checks the time)
    assert all(0 < took and 0 <= waited for _, took, waited in lines[1:])


@pytest.mark.parametrize("first", ["host -> device", "device -> host", "host_optimizer -> device",
                                   "device -> host_optimizer"])
def test_a_checkpoint_resumes_under_the_other_tier(one_rank, first):
    (uninterrupted,) = one_rank["world1 device"]
    (resumed,) = one_rank[first]
    assert len(resumed) == STEPS // 2 and _close(resumed, uninterrupted[STEPS // 2:]) <= 1e-5


@pytest.mark.parametrize("tier", ["host", "host_optimizer"])
@pytest.mark.parametrize("layout", ["head2-ctx2", "moe expert2-ctx2"])
def test_host_states_train_as_device_states_under_layouts(two_and_four_ranks, layout, tier):
    device, host = two_and_four_ranks[f"{layout} device"], two_and_four_ranks[f"{layout} {tier}"]
    for rank_device, rank_host in zip(device, host):
        assert len(rank_device) == STEPS and _close(rank_device, rank_host) <= TOLERANCE, layout
