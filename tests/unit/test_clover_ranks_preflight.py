"""A Clover draft trains on one rank. On data ranks alone (`--nproc 2`, no head x ctx layout, which the
config does not show) the run used to be refused only by the ranks, after launch and after the data
store was built (hours for a cold real corpus); preflight now refuses it first, before any data work."""

import pytest

import longctx.train.preflight as preflight_module
from longctx.config import load_config
from longctx.errors import ConfigError
from probes import DRAFT_QUIET, tiny_target_run

QUIET = DRAFT_QUIET


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target_run(tmp_path_factory.mktemp("clover-ranks"))


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
