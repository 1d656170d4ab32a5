"""A GliDe draft run resumes only against the target weights it was trained against.

configs/glide.toml's recipe names the target as a run's checkpoints directory (`--draft.target
runs/glide-target/checkpoints`), which means that run's latest step. When the target run trains on
(a new latest), a resumed draft run used to load its checkpoint and go on distilling the new weights
without a word: the draft's first steps learned one target, the rest another, and its new
checkpoints record only the new target (so decoding accepts it). The resume is refused now, before
anything is loaded; pointed at the very step it trained against, the draft resumes exactly."""

import random

import pytest

from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.train.trainer import Trainer

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=128",
         "--train.global_batch=2", "--metrics.log_interval=1", "--train.warmup_steps=1"]
TARGET = ["--model.layers=2", "--model.dim=64", "--model.ffn_dim=128", "--checkpoint.interval=2",
          "--checkpoint.keep=3"]


def _corpus(d) -> list[str]:
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(200):
        (d / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + "\n")
    return [f"--data.corpus={d}", "--data.tokenizer=byte"]


def _run(args):
    return Trainer(load_config(None, [*QUIET, *args]), log=lambda *a, **k: None).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("draft-target")
    (base / "docs").mkdir()
    corpus = _corpus(base / "docs")
    target = base / "target"
    _run([*corpus, *TARGET, "--train.steps=2", f"--train.run_dir={target}"])
    draft = [*corpus, f"--draft.target={target / 'checkpoints'}", "--draft.layers=1", "--train.steps=4"]
    full = _run([*draft, f"--train.run_dir={base / 'full'}"])
    _run([*draft, "--checkpoint.interval=2", f"--train.run_dir={base / 'part'}"])
    # the target run trains on: its checkpoints directory's latest is now step 4
    _run([*corpus, *TARGET, "--train.steps=4", "--checkpoint.resume=auto", f"--train.run_dir={target}"])
    return base, corpus, full.losses


def test_a_draft_resumed_against_moved_on_target_weights_is_refused(runs):
    base, corpus, _ = runs
    with pytest.raises(CheckpointError, match="trained against the target weights"):
        _run([*corpus, f"--draft.target={base / 'target' / 'checkpoints'}", "--draft.layers=1", "--train.steps=4",
              f"--checkpoint.resume={base / 'part' / 'checkpoints' / 'step-00000002'}",
              f"--checkpoint.dir={base / 'b'}", f"--train.run_dir={base / 'part'}"])


def test_preflight_refuses_it_before_launch(runs):
    from longctx.train.preflight import _check_resume

    base, corpus, _ = runs
    step = base / "part" / "checkpoints" / "step-00000002"
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={base / 'target' / 'checkpoints'}", "--draft.layers=1",
                             "--train.steps=4", f"--checkpoint.resume={step}", f"--checkpoint.dir={base / 'd'}",
                             f"--train.run_dir={base / 'part'}"])
    with pytest.raises(CheckpointError, match="trained against the target weights"):
        _check_resume(cfg)


def test_a_draft_resumed_against_its_own_target_step_continues_exactly(runs):
    base, corpus, full = runs
    resumed = _run([*corpus, f"--draft.target={base / 'target' / 'checkpoints' / 'step-00000002'}",
                    "--draft.layers=1", "--train.steps=4",
                    f"--checkpoint.resume={base / 'part' / 'checkpoints' / 'step-00000002'}",
                    f"--checkpoint.dir={base / 'c'}", f"--train.run_dir={base / 'part'}"])
    assert resumed.first_step == 3 and len(resumed.losses) == 2
    assert max(abs(a - b) for a, b in zip(resumed.losses, full[2:])) < 1e-5
