"""The scratch directories of export and GGUF import (durable.scratch_dir): a run killed outright (SIGKILL,
the OOM killer) left its partial copy, up to the model's size, in a hidden `.OUT.exporting-*` directory
beside OUT for good. The next run on the same host removes those whose process is gone, and keeps a live
process's (another export into the same place) and another host's (a shared file system)."""

import os
import shutil
import subprocess
import sys

import pytest

from longctx.durable import _host_tag, scratch_dir


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_runs_scratch_is_removed_and_others_are_kept(tmp_path):
    out = tmp_path / "model[hf]"  # (glob characters in the name: matched as they are)
    host = _host_tag()  # (this host and PID namespace)
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
    host = _host_tag()
    stale = [tmp_path / f".hf.{verb}-{host}-{_dead_pid()}-xyz" for verb in ("exporting", "replaced")]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    out = tmp_path / "hf"
    export_hf(step, out)
    export_hf(step, out)  # (over an export: the old one goes through a "replaced" scratch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]


def test_a_host_whose_name_extends_this_ones_keeps_its_scratch(tmp_path):
    """A shared file system: this host "node", another "node-2" (or "node-<digits>"): the glob of node's prefix
    also matched the other's `.OUT.exporting-node-2-PID-xxxx`, and "2" was taken for a PID, absent here: the
    other host's live export was removed under it."""
    out = tmp_path / "hf"
    dead = _dead_pid()
    theirs = tmp_path / f".hf.exporting-{_host_tag()}-{dead}-4242-abcdefgh"  # (host "THIS-<dead>", PID 4242)
    theirs.mkdir()
    scratch_dir(out, "exporting")
    assert theirs.is_dir()


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid") or os.geteuid() != 0
                    or not shutil.which("unshare"), reason="needs Linux PID namespaces (unshare, root)")
def test_another_pid_namespaces_live_scratch_is_kept(tmp_path):
    """Containers sharing the host's name and the output volume (Docker --network host, hostNetwork pods): a
    PID of one namespace does not exist in another, so a live export's scratch was removed by the other's."""
    live = scratch_dir(tmp_path / "hf", "exporting")
    (live / "model.safetensors").write_bytes(b"partial")
    code = ("from pathlib import Path; from longctx.durable import scratch_dir; "
            f"scratch_dir(Path({str(tmp_path / 'hf')!r}), 'exporting')")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                          env=dict(os.environ), capture_output=True, text=True, timeout=120)
    if done.returncode and "Operation not permitted" in done.stderr:
        pytest.skip("unshare --pid is not permitted here")
    assert done.returncode == 0, done.stderr
    assert live.is_dir() and (live / "model.safetensors").exists()
