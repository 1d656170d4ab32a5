"""A resume whose run's config.toml is not found (config/resume_moved.py).

A run trains steps 1-2 under settings of its own (train.lr, train.global_batch, train.seq_len, a tiny model, a
checkpoint.dir outside its run directory as on a shared filesystem, a metrics.file inside it), then its run directory
is deleted (local scratch wiped; or the checkpoints were copied to another machine). Resumed from a checkpoint, the
config was built on the defaults plus the command line with no word: another lr, batch, seq_len and model. The
checkpoint's recorded config (manifest "config") is now the base, said so, with the old run's own paths replaced
by the new run's; a checkpoint that records none still runs the defaults, said before any work.
"""

import shutil

import pytest

from longctx.cli import main
from longctx.config import load_config
from longctx.config.layout import resolve_layout
from longctx.config.resume import load_run_config
from longctx.config.schema import Config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer
from manifest_edits import rewrite_manifest

QUIET = lambda *a, **k: None  # noqa: E731
# the run's own settings, none of them a default (Config() below checks that)
OWN = {"lr": 1e-4, "global_batch": 2, "seq_len": 32}
BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--train.eval_interval=0",
        "--train.warmup_steps=1", "--checkpoint.interval=1", "--checkpoint.keep=5",
        *(f"--train.{k}={v}" for k, v in OWN.items())]
STEP_2 = "step-00000002"


@pytest.fixture(scope="module")
def gone(tmp_path_factory):
    """(the deleted run directory, the checkpoints it left on the 'shared' filesystem, the root of both)."""
    root = tmp_path_factory.mktemp("moved")
    run, shared = root / "scratch" / "run", root / "shared" / "ckpts"
    Trainer(load_config(None, [*BASE, "--train.steps=2", f"--train.run_dir={run}", f"--checkpoint.dir={shared}",
                               f"--metrics.file={run / 'own.jsonl'}"]), log=QUIET).run()
    assert (run / "config.toml").is_file() and (shared / STEP_2).is_dir()
    shutil.rmtree(run)
    return run, shared, root


def _resume(checkpoint, *extra):
    return load_run_config(None, [f"--checkpoint.resume={checkpoint}", "--train.steps=3", *extra], False)


def test_the_defaults_differ_from_the_runs_settings():
    """(else the tests below could not tell the recorded config from the defaults)"""
    assert all(getattr(Config().train, k) != v for k, v in OWN.items()) and Config().model.dim != 32


def test_a_resume_without_config_toml_runs_the_config_its_checkpoint_recorded(gone):
    run, shared, root = gone
    cfg, resumed = _resume(shared / STEP_2, f"--train.run_dir={root / 'run2'}")
    assert {k: getattr(cfg.train, k) for k in OWN} == OWN, cfg.train
    assert (cfg.model.dim, cfg.model.layers, cfg.data.max_docs, cfg.checkpoint.interval) == (32, 1, 40, 1)
    assert resumed is not None
    said = resumed.describe()
    assert said.startswith(f"resume: {shared / STEP_2} with the config it recorded (the run's config.toml was not "
                           f"found: looked in {root / 'run2' / 'config.toml'}"), said
    assert f"{run} (the run directory its manifest names)" in said
    assert "train.steps 2 -> 3" in said and "nothing changed" not in said


def test_the_old_runs_paths_are_not_followed_and_each_replaced_is_said(gone):
    run, shared, root = gone
    cfg, resumed = _resume(shared / STEP_2, f"--train.run_dir={root / 'run2'}")
    assert (cfg.train.run_dir, cfg.checkpoint.dir, cfg.metrics.file) == (str(root / "run2"), "", "")
    said = resumed.describe()
    assert f"checkpoint.dir '{shared}' -> ''" in said and f"metrics.file '{run / 'own.jsonl'}' -> ''" in said
    assert f"train.run_dir '{run}' -> '{root / 'run2'}'" in said
    # the command line's own, where it gives them: `auto` in the shared checkpoint directory saves on there
    cfg, resumed = load_run_config(None, ["--checkpoint.resume=auto", f"--checkpoint.dir={shared}",
                                          f"--train.run_dir={root / 'run3'}", "--train.steps=3"], False)
    assert cfg.checkpoint.dir == str(shared) and cfg.train.lr == OWN["lr"]
    assert "checkpoint.dir" not in ", ".join(resumed.changes)


def test_the_resume_trains_on_in_its_own_run_directory(gone, tmp_path):
    run, shared, _ = gone
    moved = tmp_path / "moved"  # (the checkpoint copied to another place, as to another machine)
    shutil.copytree(shared / STEP_2, moved / STEP_2)
    cfg, _ = _resume(moved / STEP_2, f"--train.run_dir={tmp_path / 'run2'}")
    Trainer(cfg, log=QUIET).run()
    assert (tmp_path / "run2" / "checkpoints" / "step-00000003").is_dir()
    assert "lr = 0.0001" in (tmp_path / "run2" / "config.toml").read_text()
    assert not run.exists() and not (shared / "step-00000003").exists()  # (nothing written to the old run's places)


def test_a_model_change_is_still_refused_unless_asked(gone):
    _, shared, root = gone
    with pytest.raises(ConfigError) as e:
        _resume(shared / STEP_2, f"--train.run_dir={root / 'run2'}", "--model.norm_eps=1e-06")
    message = str(e.value)
    assert f"this resume of {shared / STEP_2} would change the model: model.norm_eps 1e-05 -> 1e-06" in message
    assert f"--model.init_from {shared / STEP_2}" in message
    cfg, resumed = _resume(shared / STEP_2, f"--train.run_dir={root / 'run2'}", "--model.norm_eps=1e-06",
                           "--checkpoint.allow_changes=true")
    assert cfg.model.norm_eps == 1e-6 and "model.norm_eps 1e-05 -> 1e-06" in resumed.describe()


def _without_record(shared, tmp_path, config=None):
    """The checkpoint copied, its manifest's record of the config dropped (or replaced by `config`)."""
    copy = tmp_path / "old" / STEP_2
    shutil.copytree(shared / STEP_2, copy)
    def edit(manifest):
        manifest.pop("config")
        if config is not None:
            manifest["config"] = config

    rewrite_manifest(copy, edit)
    return copy


def test_a_checkpoint_without_a_record_runs_the_defaults_and_says_so(gone, tmp_path, capsys):
    _, shared, _ = gone
    copy = _without_record(shared, tmp_path)
    args = [f"--checkpoint.resume={copy}", f"--train.run_dir={tmp_path / 'run2'}", "--train.steps=3"]
    cfg, resumed = load_run_config(None, args, False)
    assert resumed is None and cfg.train.lr == Config().train.lr  # (as before: the defaults)
    line = resolve_layout(None, args, 1).unfound
    assert line.startswith(f"resume: {copy} with the defaults and the command line: the run's config.toml was not "
                           f"found (looked in {tmp_path / 'run2' / 'config.toml'}"), line
    assert "records no config" in line and "with --config" in line
    assert main(["train", *args, "--nproc", "1", "--print-config"]) == 0  # (said by the command, before any work)
    assert line in capsys.readouterr().err


def test_the_command_says_the_recorded_base(gone, tmp_path, capsys):
    _, shared, _ = gone
    args = [f"--checkpoint.resume={shared / STEP_2}", f"--train.run_dir={tmp_path / 'run2'}", "--train.steps=3"]
    assert main(["train", *args, "--nproc", "1", "--print-config"]) == 0
    out = capsys.readouterr()
    assert "with the config it recorded" in out.err and "lr = 0.0001" in out.out


def test_a_record_that_no_longer_loads_is_refused_with_the_way_on(gone, tmp_path):
    _, shared, _ = gone
    copy = _without_record(shared, tmp_path, config="[train]\nlr = 0.0001\nno_such_key = 1\n")
    with pytest.raises(ConfigError, match="no_such_key") as e:
        _resume(copy)
    assert f"the config {copy} recorded" in str(e.value) and str(copy.parent / "config.toml") in str(e.value)
