"""GliDe draft training (train/glide.py) under head x ctx layouts against one process, fp32 on gloo:
the draft's per-step losses over 10 steps agree within 1e-4 on packed short documents (document
masks on, boundaries inside every rank's piece):
- loss ce under head 2 x ctx 2 (4 ranks: the target's captured K/V all-gathered over both degrees,
  FSDP over the four), with recompute none and with selective;
- loss kd under ctx 2 (2 ranks).
The target is a tiny model trained a few steps in one process and saved through the normal
checkpoint path; every run of one world size goes in one spawned job."""

import random

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

STEPS = 10
TINY = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=128",
        "--train.global_batch=4", "--train.warmup_steps=2"]

JOBS = {  # key: (world, extra args)
    "head2-ctx2 ce": (4, ["--parallel.head=2", "--parallel.ctx=2"]),
    "head2-ctx2 ce selective": (4, ["--parallel.head=2", "--parallel.ctx=2", "--memory.recompute=selective"]),
    "ctx2 kd": (2, ["--parallel.ctx=2", "--draft.loss=kd", "--draft.kd_temperature=2.0"]),
}


def _losses(args, run_dir):
    cfg = load_config(None, [*args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the args every draft run shares, the target's checkpoint directory)."""
    root = tmp_path_factory.mktemp("glide")
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(300):  # 20-300 bytes each: every 128-token window packs several
        (docs / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 50))) + "\n")
    data = [f"--data.corpus={docs}", "--data.tokenizer=byte"]
    target = root / "target"
    # (init_std 0.1, which the draft inherits: its cross-attention then weighs enough in the loss from
    # the first steps that a wrong mask shows, e.g. key positions off by one: a 1.5e-3 gap)
    _losses([*TINY, *data, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128", "--model.init_std=0.1",
             "--train.steps=15", "--checkpoint.interval=15"], target)
    draft = [*TINY, *data, f"--draft.target={target / 'checkpoints'}", f"--train.steps={STEPS}", "--draft.block=3"]
    return draft, root


@pytest.fixture(scope="module")
def spawned(setup):
    draft, root = setup
    done = {}

    def get(world):
        if world not in done:
            jobs = [(key, _losses, ([*draft, *args], str(root / key.replace(" ", "-"))))
                    for key, (w, args) in JOBS.items() if w == world]
            done[world] = run_spawned_many(world, jobs)
        return done[world]

    return get


@pytest.fixture(scope="module")
def single(setup):
    draft, root = setup
    done = {}

    def get(loss):
        if loss not in done:
            args = ["--draft.loss=kd", "--draft.kd_temperature=2.0"] if loss == "kd" else []
            done[loss] = _losses([*draft, *args], root / f"single-{loss}")
        return done[loss]

    return get


@pytest.mark.parametrize("key", list(JOBS))
def test_draft_losses_match_one_process(key, single, spawned):
    world = JOBS[key][0]
    reference = single("kd" if "kd" in key else "ce")
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for rank_losses in spawned(world)[key]:
        assert len(rank_losses) == STEPS
        gap = max(abs(a - b) for a, b in zip(rank_losses, reference))
        print(f"{key}: max |loss - one process| over {STEPS} steps = {gap:.2e}")
        assert gap <= 1e-4, f"{key}: {rank_losses} vs {reference}"
