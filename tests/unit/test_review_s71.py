"""Review of session 71's changes: a data build refused by another build's lock, a default store's stale
partials on a host whose name another host's extends, and a resume that names another model preset."""

import fcntl
import os
import socket
import subprocess
import sys

import pytest

from longctx.config.load import load_config, to_dict, to_toml
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError, DataError


class _OsWithAHolder:
    """`os` for durable.py (pipeline.py's lock: lock_directory), but another build takes the lock of the directory
    the first time this one opens it: both found --out missing, so both count it as created by them."""

    def __init__(self):
        self.held: list[int] = []

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, *args):
        if not self.held:
            fd = os.open(path, flags, *args)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held.append(fd)
        return os.open(path, flags, *args)


def test_a_build_refused_by_the_lock_leaves_the_holders_new_out(tmp_path, monkeypatch):
    from longctx import durable
    from longctx.data.builder import pipeline

    out = tmp_path / "new" / "store"
    holder = _OsWithAHolder()
    monkeypatch.setattr(durable, "os", holder)
    try:
        with pytest.raises(DataError, match="another `longctx data build`"):
            with pipeline._exclusive(out):
                pass
        # the holder's --out, still empty (its build has not written yet), is not the refused build's to remove
        assert out.is_dir()
    finally:
        for fd in holder.held:
            os.close(fd)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_default_store_build_keeps_another_hosts_partial_whose_name_extends_this_hosts(tmp_path, monkeypatch):
    from longctx.data import default_store as ds

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    parent = tmp_path / "cache" / "data"
    parent.mkdir(parents=True)
    pid = _dead_pid()  # (gone here; on host node1-2 a build of that pid may well be running)
    theirs = parent / f".tmp-corpus-64-concat-0123456789abcdef@node1-2-{pid}"
    mine = parent / f".tmp-corpus-64-concat-0123456789abcdef@node1-{pid}"
    theirs.mkdir()
    mine.mkdir()

    def stop(*_a, **_k):
        raise RuntimeError("stop before building")

    monkeypatch.setattr(ds, "build_store", stop)
    cfg = load_config(None, [f"--data.corpus={corpus}", "--data.tokenizer=byte"])
    with pytest.raises(RuntimeError, match="stop before building"):
        ds.default_store(cfg.data, 64, log=lambda *_: None)
    assert not mine.exists()  # this host's, its process gone: removed
    assert theirs.is_dir()  # node1-2's: its pid says nothing on node1


def test_a_resume_naming_another_preset_builds_that_preset_when_changes_are_allowed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, ["--model.preset=debug", "--model.layers=2",
                                                                f"--train.run_dir={run}"])))
    # debug -> debug-moe changes the weights (experts), which no flag makes the checkpoint load into
    # (config/weight_shapes.py): refused at once, naming that alone, the saved run's own 2 layers kept
    with pytest.raises(ConfigError, match=r"shapes of the model's weights \(model\.moe\.experts 0 -> 8\)"):
        load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", "--model.preset=debug-moe",
                               "--checkpoint.allow_changes=true"], False)
    # a preset of the same weights (debug's own shapes given through debug-moe's preset, dense): built as asked
    same = ["--model.moe.experts=0", f"--model.ffn_dim={load_config(None, ['--model.preset=debug']).model.ffn_dim}",
            "--model.layers=2"]
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto",
                                          "--model.preset=debug-moe", *same, "--checkpoint.allow_changes=true"], False)
    # the reference: debug-moe with the saved run's own change (2 layers) on top
    expected = to_dict(load_config(None, ["--model.preset=debug-moe", *same]))["model"]
    got = to_dict(cfg)["model"]
    assert {k: (got[k], v) for k, v in expected.items() if got[k] != v} == {}
    assert "model.preset 'debug' -> 'debug-moe'" in resumed.describe()
