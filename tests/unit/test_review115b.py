"""Review of the recorded-base resume (config/resume_moved.py) and the kept layout (config/resume_layout.py).

A resume whose run's config.toml is gone builds on the config its checkpoint recorded. With `auto`, that
checkpoint must be the one auto loads: the manager skips a newest checkpoint whose manifest is damaged (unreadable)
and loads the one before it, so the config must be built on that one's record, not on the defaults with no word.
"""

import json

import pytest

from longctx.config import load_config, to_dict, to_toml
from longctx.config.layout import resolve_layout
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError
from longctx.train.setup import resume_target

OWN = ["--train.lr=0.0001", "--train.global_batch=2", "--train.seq_len=32", "--model.layers=1", "--model.dim=32",
       "--model.heads=2", "--model.kv_heads=2", "--checkpoint.interval=1"]


def _shared(tmp_path):
    """A shared checkpoint.dir: step 5 intact with its recorded config, step 10 (`latest`) with a damaged manifest."""
    shared = tmp_path / "shared"
    old = load_config(None, [*OWN, f"--train.run_dir={tmp_path / 'gone'}", f"--checkpoint.dir={shared}"])
    (shared / "step-00000005").mkdir(parents=True)
    layout = {"world": 1, "dp_replicate": 1, "dp_shard": 1, "head": 1, "ctx": 1, "window": 0,
              "placement": "head-first", "expert": 1}
    (shared / "step-00000005" / "manifest.json").write_text(json.dumps(
        {"step": 5, "layout": layout, "config": to_toml(old), "run_dir": str(tmp_path / "gone"), "parent": None}))
    (shared / "step-00000010").mkdir()
    (shared / "step-00000010" / "manifest.json").write_text('{"step": 10, "lay')  # (cut short by a crash)
    (shared / "latest").write_text("step-00000010")
    return shared


def test_auto_past_a_damaged_newest_checkpoint_builds_on_the_record_auto_loads(tmp_path):
    shared = _shared(tmp_path)
    args = ["--checkpoint.resume=auto", f"--checkpoint.dir={shared}", f"--train.run_dir={tmp_path / 'run2'}",
            "--train.steps=8"]
    cfg, resumed = load_run_config(None, args, False)
    assert (cfg.train.lr, cfg.train.seq_len, cfg.model.dim) == (1e-4, 32, 32), cfg.train
    assert resumed is not None and str(shared / "step-00000005") in resumed.describe()
    # and `longctx train` says it (the line printed before any work)
    run = resolve_layout(None, args, None)
    assert run.resumed is not None and run.cfg.train.lr == 1e-4
    # the ranks (cli.py _saved_world) and preflight read the same checkpoint: the one auto loads
    assert resume_target(cfg, tmp_path / "run2") == shared / "step-00000005"


def _legacy_rollback(tmp_path, **parallel):
    """A run whose config.toml (a later 2-rank resume's: head 1 x ctx 2) differs from the layout its step 1 was
    written under on 4 ranks (head 2 x ctx 2), in a manifest of before checkpoints recorded their config, and before
    its layout named the expert degree (nor window and placement): the keys it lacks."""
    run = tmp_path / "run"
    flags = [f"--parallel.{k}={v}" for k, v in {"head": 1, "ctx": 2, **parallel}.items()]
    cfg = load_config(None, [*OWN, "--model.heads=4", "--model.kv_heads=4", "--model.moe.experts=4",
                             f"--train.run_dir={run}", *flags])
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg))
    layout = {"world": 4, "dp_replicate": 1, "dp_shard": 1, "head": 2, "ctx": 2}
    (run / "checkpoints" / "step-00000001" / "manifest.json").write_text(json.dumps({"step": 1, "layout": layout}))
    return resolve_layout(None, [f"--checkpoint.resume={run / 'checkpoints' / 'step-00000001'}"], None)


def test_a_legacy_rollback_keeps_the_layout_keys_its_manifest_does_not_record(tmp_path):
    """The kept layout is the manifest's head 2 x ctx 2 on 4 ranks; parallel.expert (and window), which it does not
    record, stay config.toml's, as before the kept layout: they were dropped to their defaults with no word."""
    run = _legacy_rollback(tmp_path, expert=2, window=2)
    assert (run.nproc, run.cfg.parallel.head, run.cfg.parallel.ctx) == (4, 2, 2)
    assert (run.cfg.parallel.expert, run.cfg.parallel.window) == (2, 2), run.resumed.describe()
    assert "parallel.expert" not in run.resumed.describe() and "parallel.window" not in run.resumed.describe()


def test_an_unrecorded_key_that_does_not_fit_the_kept_layout_runs_its_default_said(tmp_path):
    """config.toml's window 4 (its ctx 4) does not divide the kept ctx 2: the default runs, said, not a refusal of a
    window nobody gave on this command line."""
    run = _legacy_rollback(tmp_path, ctx=4, window=4)
    assert (run.nproc, run.cfg.parallel.ctx, run.cfg.parallel.window) == (4, 2, 0)
    said = run.resumed.describe()
    assert "parallel.window 4 -> 0: step 1's manifest does not record it" in said, said


def _fine_tune(tmp_path):
    """A fine-tune (model.init_from a longctx checkpoint) whose step 5 recorded its config; then the init_from
    checkpoint moved elsewhere: (the run, its step 5, the moved init_from)."""
    base, moved = tmp_path / "base" / "step-00000001", tmp_path / "moved" / "step-00000001"
    model = to_dict(load_config(None, OWN))["model"]
    base.mkdir(parents=True)
    (base / "manifest.json").write_text(json.dumps({"step": 1, "layout": {"world": 1}, "model": model}))
    run, flags = tmp_path / "run", [*OWN, f"--train.run_dir={tmp_path / 'run'}"]
    step = run / "checkpoints" / "step-00000005"
    step.mkdir(parents=True)
    layout = {"world": 1, "dp_replicate": 1, "dp_shard": 1, "head": 1, "ctx": 1}
    text = to_toml(load_config(None, [*flags, f"--model.init_from={base}"]))
    (step / "manifest.json").write_text(json.dumps({"step": 5, "layout": layout, "config": text}))
    moved.parent.mkdir()
    base.rename(moved)
    return run, step, moved


def test_a_record_whose_init_from_moved_does_not_stop_a_resume_whose_config_toml_names_the_new_place(tmp_path):
    """config.toml edited to the new place: the record (the old place) only measures the changes, said so."""
    run, step, moved = _fine_tune(tmp_path)
    (run / "config.toml").write_text(to_toml(load_config(None, [*OWN, f"--train.run_dir={run}",
                                                                f"--model.init_from={moved}"])))
    got = resolve_layout(None, [f"--checkpoint.resume={step}"], None)
    assert got.cfg.model.init_from == str(moved) and got.cfg.train.lr == 1e-4
    assert "step 5's recorded config no longer loads" in got.resumed.describe()


def test_a_recorded_base_whose_init_from_moved_is_refused_as_the_record_that_no_longer_loads(tmp_path):
    run, step, moved = _fine_tune(tmp_path)
    with pytest.raises(ConfigError, match=r"the config .*step-00000005 recorded, the base of this resume .*no longer "
                                          r"loads: model.init_from = .*base.*Write it"):
        load_run_config(None, [f"--checkpoint.resume={step}", f"--train.run_dir={tmp_path / 'run2'}"], False)
