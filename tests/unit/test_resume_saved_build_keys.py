"""A run started before data.max_docs, data.workers, ... beside data.path were refused (config/inert_options.py)
recorded them in its config.toml, where they were ignored. Its resume failed on its own saved config (no flag can
drop a key from it): the keys the run ignored are dropped from the saved config; given now, they are refused."""

import pytest

from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(f'[data]\npath = "{tmp_path}/store"\nworkers = 4\nmax_docs = 400\n'
                                     '[train]\nseq_len = 128\n[model]\npreset = "debug"\n')
    return run


def test_an_older_runs_ignored_build_keys_do_not_stop_its_resume(old_run):
    cfg, resumed = load_run_config(None, [f"--train.run_dir={old_run}", "--checkpoint.resume=auto"], False)
    assert cfg.data.path.endswith("store") and cfg.data.workers == 1 and cfg.data.max_docs == 0
    assert resumed.changes == []


def test_a_build_key_given_on_the_resume_is_still_refused(old_run):
    with pytest.raises(ConfigError, match="data.max_docs = 7 would be ignored"):
        load_run_config(None, [f"--train.run_dir={old_run}", "--checkpoint.resume=auto", "--data.max_docs=7"], False)
