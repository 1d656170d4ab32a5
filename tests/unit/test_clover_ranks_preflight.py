"""A Clover draft trains on one rank. On data ranks alone (`--nproc 2`, no head x ctx layout, which the
config does not show) the run used to be refused only by the ranks, after launch and after the data
store was built (hours for a cold real corpus); preflight now refuses it first, before any data work."""

import random

import pytest

import longctx.train.preflight as preflight_module
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64",
         "--train.global_batch=2", "--metrics.log_interval=1", "--train.warmup_steps=1"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("clover-ranks")
    (base / "docs").mkdir()
    rng = random.Random(0)
    for i in range(40):
        (base / "docs" / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(["def", "return", "self"])
                                                                for _ in range(rng.randint(3, 30))) + "\n")
    corpus = [f"--data.corpus={base / 'docs'}", "--data.tokenizer=byte"]
    cfg = load_config(None, [*QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=1", f"--train.run_dir={base / 'target'}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return corpus, base / "target" / "checkpoints"


def test_a_clover_draft_on_data_ranks_is_refused_before_the_data(target, monkeypatch):
    corpus, checkpoints = target

    def no_data(*a, **k):
        raise AssertionError("preflight reached the data store of a run it should have refused")

    monkeypatch.setattr(preflight_module, "_check_data", no_data)
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={checkpoints}", "--draft.kind=clover"])
    with pytest.raises(ConfigError, match=r"Clover draft training runs on one rank.*got 2 ranks.*--nproc 1"):
        preflight_module.preflight(cfg, 2, log=lambda *a, **k: None)


def test_a_glide_draft_on_data_ranks_passes_the_check(target, monkeypatch):
    corpus, checkpoints = target
    reached = []
    monkeypatch.setattr(preflight_module, "_check_data", lambda *a, **k: reached.append(1))
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={checkpoints}"])
    preflight_module.preflight(cfg, 2, log=lambda *a, **k: None)
    assert reached
