"""memory.model_states = host_optimizer where its update meets the rest of a run: the AdamW update of step
N runs on a worker thread while the loop goes on, so every reader of the weights or the optimizer state
must wait for it. Here each unit's update is slowed (SLOW seconds) so that the seams meet it in flight
(a probe records that each kind did): the in-training evaluation right after a step, a sync and an async
checkpoint save at an interval step and at the end, a rollback's load after a non-finite step
(LONGCTX_FAULT), a skipped step, a save on SIGTERM, and the model the run ends with (no save after the last
step), under clipping and gradient accumulation. Each is checked against the same run with the states on
the device (test_model_states.py checks the losses of plain runs and world-1 resumes across tiers):
losses, eval losses, every tensor of both checkpoints (weights, moments, step counts) and the final
weights; and the SIGTERM checkpoint resumed under ctx 2 and head 2 x ctx 2 against the uninterrupted
device run."""

import os
import signal

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

SLOW = 0.05  # seconds added to each unit's host update: longer than a tiny step's forward, so it is in flight
BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--metrics.plots=false",
        "--metrics.progress=false", "--train.device=cpu", "--train.warmup_steps=2"]
RUNS = {  # name: (args, LONGCTX_FAULT, step after which SIGTERM is sent)
    "journey": (["--train.steps=6", "--train.eval_interval=2", "--checkpoint.interval=3", "--checkpoint.async=true",
                 "--train.grad_clip=0.05", "--train.grad_accum=2", "--train.global_batch=4"], "", None),
    "rollback": (["--train.steps=7", "--train.eval_interval=0", "--checkpoint.interval=2",
                  "--train.on_nonfinite=rollback"], "nonfinite@5", None),
    # no save at the end either: only the run's end waits for the last update before the model is handed back
    "skip": (["--train.steps=5", "--train.eval_interval=0", "--train.on_nonfinite=skip", "--checkpoint.final=false"],
             "nonfinite@3", None),
    "stop": (["--train.steps=6", "--train.eval_interval=0", "--checkpoint.interval=100", "--checkpoint.async=true"],
             "", 3),
}
LOSS_TOLERANCE = 1e-6  # test_model_states.py's (the device tier's foreach AdamW against the fused one)
STATE_TOLERANCE = 1e-5  # a missed or half-applied update moves weights and moments by ~1e-3 (lr 3e-3)


def _slowed():
    import time

    from longctx.step.host_optimizer import HostOptimizer

    update_unit = HostOptimizer._update_unit
    if getattr(update_unit, "slowed", False):  # (the jobs of one spawned process share the class)
        return

    def slow(self, k, found_inf):
        time.sleep(SLOW)
        return update_unit(self, k, found_inf)

    slow.slowed = True
    HostOptimizer._update_unit = slow


def _tensors(path) -> dict:
    """Every tensor of a checkpoint (model and optimizer state) by its flattened key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), f"{path}.pt")
    out = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(x, torch.Tensor):
            out[prefix] = x.double()

    walk("", torch.load(f"{path}.pt", weights_only=False))
    return out


def _run(name, tier, run_dir):
    """(losses, eval losses, {checkpoint: tensors}, final weights, seams the update was in flight at)."""
    from pathlib import Path

    from longctx.errors import Preempted
    from longctx.train.trainer import Trainer

    args, fault, stop_at = RUNS[name]
    os.environ["LONGCTX_FAULT"] = fault
    if tier == "host_optimizer":
        _slowed()
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--memory.model_states={tier}",
                                             f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    in_flight = []
    busy = getattr(trainer.optimizer, "_updates", None)
    step, evaluate = trainer.step, trainer.evaluate

    def stepping(s):
        out = step(s)
        if s == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    def probe(what, fn):
        def probed(*a, **k):
            in_flight.append((what, busy is not None and busy.busy()))
            return fn(*a, **k)
        return probed

    trainer.step, trainer.evaluate = stepping, probe("eval", evaluate)
    if trainer.ckpt is not None:
        trainer.ckpt.save, trainer.ckpt.load = probe("save", trainer.ckpt.save), probe("load", trainer.ckpt.load)
    try:
        result = trainer.run()
        losses, evals = result.losses, result.eval_losses
    except Preempted:
        losses, evals = None, {}
    finally:
        os.environ["LONGCTX_FAULT"] = ""
    # the parameters themselves, not state_dict() (which waits for the update): what a caller of the model reads
    final = {k: v.detach().clone().double() for k, v in trainer.model.named_parameters()}
    saved = {p.name: _tensors(p) for p in sorted(Path(run_dir, "checkpoints").glob("step-*")) if p.is_dir()}
    return losses, evals, saved, final, in_flight


def _resumed(layout, tier, checkpoint, run_dir):
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", [*BASE, *RUNS["stop"][0], *layout, f"--memory.model_states={tier}",
                                             f"--checkpoint.resume={checkpoint}", f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def _uninterrupted(run_dir):
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", [*BASE, *RUNS["stop"][0], f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostjourney")
    jobs = [(f"{name} {tier}", _run, (name, tier, f"{base}/{name}-{tier}"))
            for name in RUNS for tier in ("device", "host_optimizer")]
    out = run_spawned_many(1, [*jobs, ("uninterrupted", _uninterrupted, (f"{base}/uninterrupted",))])
    stopped = f"{base}/stop-host_optimizer/checkpoints/step-00000003"
    out.update(run_spawned_many(2, [("ctx2", _resumed, (["--parallel.ctx=2"], "host_optimizer", stopped,
                                                        f"{base}/ctx2"))]))
    out.update(run_spawned_many(4, [("head2-ctx2", _resumed, (["--parallel.head=2", "--parallel.ctx=2"], "device",
                                                              stopped, f"{base}/h2c2"))]))
    return {k: v[0] for k, v in out.items()}


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _same_losses(a, b):
    assert len(a) == len(b) > 0
    assert [x != x for x in a] == [y != y for y in b]  # the same steps non-finite
    return max(abs(x - y) for x, y in zip(a, b) if x == x)


@pytest.mark.parametrize("name", list(RUNS))
def test_host_optimizer_runs_as_the_device_tier_where_its_update_is_in_flight(runs, name):
    device, host = runs[f"{name} device"], runs[f"{name} host_optimizer"]
    if name != "stop":
        assert _same_losses(device[0], host[0]) <= LOSS_TOLERANCE
    assert device[1].keys() == host[1].keys()
    assert all(abs(device[1][s] - host[1][s]) <= LOSS_TOLERANCE for s in device[1])  # eval losses
    assert device[2].keys() == host[2].keys() and bool(device[2]) == (name != "skip")  # each tensor the same
    for step in device[2]:
        assert _largest_difference(device[2][step], host[2][step]) <= STATE_TOLERANCE, step
    assert _largest_difference(device[3], host[3]) <= STATE_TOLERANCE  # the model the run ends with


def test_the_seams_met_the_update_in_flight(runs):
    """The slowed update is what the comparisons above stress: each kind of reader met one in flight."""
    met = {what for name in RUNS for what, busy in runs[f"{name} host_optimizer"][4] if busy}
    assert met == {"eval", "save", "load"}  # (load: the rollback's, right after the bad step)
    assert runs["journey host_optimizer"][1].keys() == {2, 4, 6}
    assert sorted(runs["journey host_optimizer"][2]) == ["step-00000003", "step-00000006"]


@pytest.mark.parametrize("layout", ["ctx2", "head2-ctx2"])
def test_a_checkpoint_saved_on_sigterm_resumes_exactly_under_other_layouts(runs, layout):
    assert runs["stop host_optimizer"][0] is None and "step-00000003" in runs["stop host_optimizer"][2]
    resumed, uninterrupted = runs[layout], runs["uninterrupted"]
    assert len(resumed) == 3 and _same_losses(resumed, uninterrupted[3:]) <= 1e-5
