"""The scratch directories of export and GGUF import (durable.scratch_dir): a run killed outright (SIGKILL,
the OOM killer) left its partial copy, up to the model's size, in a hidden `.OUT.exporting-*` directory
beside OUT for good. The next run on the same host removes those whose process is gone, and keeps a live
process's (another export into the same place) and another host's (a shared file system)."""

import os
import socket
import subprocess
import sys

import pytest

from longctx.durable import scratch_dir


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_runs_scratch_is_removed_and_others_are_kept(tmp_path):
    out = tmp_path / "model[hf]"  # (glob characters in the name: matched as they are)
    host = socket.gethostname()
    dead = tmp_path / f".{out.name}.exporting-{host}-{_dead_pid()}-abc"
    live = tmp_path / f".{out.name}.exporting-{host}-{os.getppid()}-def"
    other_host = tmp_path / f".{out.name}.exporting-another-host-{_dead_pid()}-ghi"
    other_verb = tmp_path / f".{out.name}.importing-{host}-{_dead_pid()}-jkl"
    for d in (dead, live, other_host, other_verb):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    work = scratch_dir(out, "exporting")
    assert work.is_dir() and work.name.startswith(f".{out.name}.exporting-{host}-{os.getpid()}-")
    assert not dead.exists()
    assert live.is_dir() and other_host.is_dir() and other_verb.is_dir()


def test_export_and_its_replacement_leave_no_scratch_after_a_killed_one(tmp_path):
    """The export goes through it: a killed export's scratch is gone after the next one, which leaves none."""
    pytest.importorskip("transformers")
    from test_export_audit import checkpoint

    from longctx.checkpoint.export import export_hf

    step = checkpoint(tmp_path, "byte")
    host = socket.gethostname()
    stale = [tmp_path / f".hf.{verb}-{host}-{_dead_pid()}-xyz" for verb in ("exporting", "replaced")]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    out = tmp_path / "hf"
    export_hf(step, out)
    export_hf(step, out)  # (over an export: the old one goes through a "replaced" scratch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]
