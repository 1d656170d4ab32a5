"""A randomized audit of train.data_parallel = co2 in the Trainer over 4 gloo ranks (train/co2.py, step/co2.py):
seeded draws (tests/co2fuzz120_reference.py draw_case) of the outer lr, outer momentum and its clip, the staleness
penalty, local steps H and the merge's overlap d (staleness 1 at d = H), synchronous steps first, gradient
accumulation (reduced per step or per micro-batch), gradient clipping, weight decay, the lr schedule (WSD too), bf16
autocast, sequence loss weighting, train.stages, evaluation during training, FSDP inside a replica or none (4
replicas of one rank), and ZeRO++ inside each replica where co2 allows it (hpz over the replica; Frontier's third
level, hpz over 1 rank in nodes of 2, with qwz and qgz; qwz and qgz alone; exact one-element blocks).

Each run's step-by-step losses and final weights are compared with a one-process emulation written from CO2's
formulas (co2fuzz120_reference.py emulate) on the very batches each rank was handed; and each run is resumed from a
checkpoint at a drawn step (inside a round, between a round end and its merge, or in the synchronous steps), which
must go on to the uninterrupted run's losses and weights. 10 cases in one 4-rank job: 74-112 s on 2 shared cores.
"""

import pytest
import torch

from co2fuzz120_reference import case_args, draw_case, emulate
from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.slow

SEEDS = tuple(range(10))
BASE = ["--model.layers=1", "--train.seq_len=64", "--metrics.plots=false",
        "--metrics.progress=false", "--data.max_docs=200", "--checkpoint.final=false"]


def _config(case: dict, run_dir: str, extra: list[str]):
    from longctx.config import load_config

    return load_config("configs/debug.toml", [*BASE, *case_args(case), *extra, f"--train.run_dir={run_dir}"])


def _saves(case: dict) -> list[str]:
    # (every save kept: a later one must not prune the step the resume reads)
    return [f"--checkpoint.interval={case['resume_at']}", "--checkpoint.keep=20",
            f"--checkpoint.async={str(case['async_save']).lower()}"]


def _trained(case: dict, run_dir: str, resume: str = "") -> dict:
    """On each rank: the Trainer's losses, the batches this rank was handed each step, the final full weights."""
    from longctx.train.trainer import Trainer

    extra = [*_saves(case), *([f"--checkpoint.resume={resume}"] if resume else [])]
    trainer = Trainer(_config(case, run_dir, extra), log=lambda *a, **k: None)
    seen, original = [], trainer.sampler.step_batches

    def recorded(step):
        shares = original(step)
        seen.append([(*(None if t is None else t.numpy().copy() for t in (b.tokens, b.labels, b.positions, b.doc_ids,
                                                                          b.real, b.label_weights)), valid)
                     for b, valid in shares])
        return shares

    trainer.sampler.step_batches = recorded
    losses = trainer.run().losses
    # (read through the state dict: FSDP's pre-hook puts the sharded parameters back in place, which an evaluation's
    # forward under hpz leaves as its post-forward copies, plain tensors)
    state = trainer.model.state_dict()
    weights = torch.cat([state[name].full_tensor().detach().reshape(-1)
                         for name, _ in trainer.model.named_parameters()]).numpy()
    return {"losses": losses, "batches": seen, "weights": weights}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("co2fuzz")
    jobs = []
    for seed in SEEDS:
        case = draw_case(seed)
        whole = d / f"case{seed}"
        saved = whole / "checkpoints" / f"step-{case['resume_at']:08d}"
        jobs += [(f"whole {seed}", _trained, (case, str(whole))),
                 (f"resumed {seed}", _trained, (case, str(d / f"resumed{seed}"), str(saved)))]
    return run_spawned_many(4, jobs), d


def _replicas(case: dict, ranks: list[dict]) -> list:
    """shares[r][s]: replica r's micro-batches of step s + 1, its ranks' in rank order."""
    per = 4 // case["rep"]
    return [[[share for rank in ranks[r * per:(r + 1) * per] for share in rank["batches"][s]]
             for s in range(case["steps"])] for r in range(case["rep"])]


def _tolerances(case: dict) -> tuple[float, float]:
    """(losses: relative error; final weights: relative norm of the difference). fp32: the sums' order only (AdamW
    makes a few near-zero gradients' entries move apart by up to 1e-3, 3e-5 of the weights' norm); bf16 autocast:
    a rounding of an activation flipped by such a difference moves a loss by up to 3e-4 of itself."""
    return (3e-3, 5e-3) if case["dtype"] == "bf16" else (1e-5, 2e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_co2_run_matches_the_emulation_and_resumes_exactly(runs, seed, tmp_path):
    out, _ = runs
    case = draw_case(seed)
    ranks, again = out[f"whole {seed}"], out[f"resumed {seed}"]
    losses, weights = emulate(case, _config(case, str(tmp_path / "emulated"), []), _replicas(case, ranks))
    loss_tol, weight_tol = _tolerances(case)
    got = ranks[0]["losses"]
    assert len(got) == case["steps"], case
    assert max(abs(a - b) / abs(b) for a, b in zip(got, losses)) < loss_tol, (case, got, losses)
    for rank in ranks:  # (every rank holds the one averaged model)
        assert float((torch.from_numpy(rank["weights"]).double() - weights).norm() / weights.norm()) < weight_tol, case
    # resumed from step resume_at (its outer state: the momentum, a change in flight, the round's progress) it goes
    # on as the uninterrupted run, to the bit on this CPU (1e-6 allowed)
    k = case["resume_at"]
    resumed = again[0]["losses"]
    assert len(resumed) == case["steps"] - k, case
    assert max(abs(a - b) for a, b in zip(resumed, got[k:])) < 1e-6, (case, resumed, got[k:])
    assert float(abs(again[0]["weights"] - ranks[0]["weights"]).max()) < 1e-6, case
