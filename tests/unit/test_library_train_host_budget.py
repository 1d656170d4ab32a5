"""The library's train(cfg), called from a plain Python process, refuses a run that would not fit in the free
host memory before any work, as `longctx train`'s preflight does (issue 49 item 3): it used to build the model and
start, and the OOM killer would end it. LONGCTX_HOST_MEMORY_BYTES stands in for the free memory."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.train import trainer
from longctx.train.host_budget import BUDGET_ENV


def _cfg(tmp_path):
    return load_config("configs/debug.toml", ["--train.steps=1", "--train.eval_interval=0", "--metrics.plots=false",
                                              "--metrics.progress=false", "--data.max_docs=200",
                                              f"--train.run_dir={tmp_path}/run"])


def test_a_run_over_the_host_budget_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, str(1 << 20))  # 1 MiB free
    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: pytest.fail("work started: the Trainer was built"))
    with pytest.raises(ConfigError, match=r"needs .* of host memory .* refused before any work"):
        trainer.train(_cfg(tmp_path))
    assert not (tmp_path / "run").exists()


def test_under_a_launcher_or_after_the_preflight_the_ranks_do_not_check_again(tmp_path, monkeypatch):
    """Ranks of one node check nothing: each would read the free memory while the others fill it (the launcher's
    preflight counted them all); `longctx train` in one process passes preflighted."""
    monkeypatch.setenv(BUDGET_ENV, str(1 << 20))

    class Ran(Exception):  # the Trainer was reached: no refusal
        pass

    def fake(*a, **k):
        raise Ran

    monkeypatch.setattr(trainer, "Trainer", fake)
    with pytest.raises(Ran):
        trainer.train(_cfg(tmp_path), preflighted=True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(Ran):
        trainer.train(_cfg(tmp_path))
