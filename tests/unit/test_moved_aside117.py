"""An explicit `--checkpoint.resume <run>/checkpoints/step-N` of a step a killed re-save left moved aside (117).

A re-save of step N (a resume of an older checkpoint saving that step again) moves the complete step-N aside as
`.tmp-old-step-N-<hex>` and publishes the new one only then; a kill between leaves step-N only there. The kill is
reproduced here, not faked: a real re-save runs, and the run directory is copied at the moment its commit calls
`publish` (the old step moved aside, the new one complete but unpublished); that copy is what a SIGKILL there
leaves. Then: an explicit resume of step-N trains on exactly (bitwise) as `--checkpoint.resume auto` does, from
the `longctx train` command line too; read-only commands (verify, generate / eval, export) leave the directory as
it is and say where the step is and how to put it back (and that way works); and where a live run holds the
directory's lock (another process here), nothing in it is renamed and the refusal says why.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import longctx.checkpoint.manager as manager_module
from longctx.checkpoint.export import export_hf
from longctx.checkpoint.verify_command import verify_lines
from longctx.cli import main
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError, check_weights_flag, step_name
from longctx.errors import UserError
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2"]
STEP4 = step_name(4)


class _Killed(BaseException):
    """The kill: raised past every `except Exception` once the killed disk state is copied."""


def _run(run_dir, *args, log=None):
    cfg = load_config(None, [*BASE, f"--train.run_dir={run_dir}", *args])
    trainer = Trainer(cfg, log=(lambda *a, **k: None) if log is None else log)
    return trainer, trainer.run()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run directory as a kill mid-re-save of step 4 leaves it, and the bytes of the step-4 manifest it had."""
    base = tmp_path_factory.mktemp("moved117")
    run_dir, frozen = base / "run", base / "frozen"
    _run(run_dir, "--train.steps=4")  # step 2 and step 4
    manifest = (run_dir / "checkpoints" / STEP4 / "manifest.json").read_bytes()
    publish = manager_module.publish

    def killed_at_publish(tmp, final):  # the old step-4 is moved aside, the new one complete and not published
        if final.name == STEP4:
            shutil.copytree(run_dir, frozen)
            raise _Killed
        return publish(tmp, final)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manager_module, "publish", killed_at_publish)
        with pytest.raises(_Killed):  # another attempt from step 2: its save of step 4 is the re-save
            _run(run_dir, "--train.steps=4", f"--checkpoint.resume={run_dir / 'checkpoints' / step_name(2)}")
    shutil.rmtree(run_dir)
    os.replace(frozen, run_dir)
    root = run_dir / "checkpoints"
    assert not (root / STEP4).exists() and len(list(root.glob(f".tmp-old-{STEP4}-*"))) == 1  # (the reproduction)
    return run_dir, manifest


def _copy(killed, tmp_path, name):
    run_dir = tmp_path / name
    shutil.copytree(killed[0], run_dir)
    return run_dir


def _states(trainer):
    return get_state_dict(trainer.model, trainer.optimizer)


def _assert_bitwise(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_an_explicit_resume_of_the_moved_aside_step_trains_on_as_resume_auto(killed, tmp_path):
    auto_dir, explicit_dir = _copy(killed, tmp_path, "auto"), _copy(killed, tmp_path, "explicit")
    auto, auto_result = _run(auto_dir, "--train.steps=6", "--checkpoint.resume=auto")
    said = []
    explicit, result = _run(explicit_dir, "--train.steps=6",
                            f"--checkpoint.resume={explicit_dir / 'checkpoints' / STEP4}", log=said.append)
    assert result.first_step == auto_result.first_step == 5
    assert result.losses == auto_result.losses
    _assert_bitwise(_states(explicit), _states(auto))
    root = explicit_dir / "checkpoints"
    assert (root / STEP4 / "manifest.json").read_bytes() == killed[1]  # the very step 4 the re-save moved aside
    assert not list(root.glob(".tmp-*"))
    assert any("put back" in line and ".tmp-old-" in line for line in said), said


def test_the_train_command_resumes_the_moved_aside_step(killed, tmp_path, capsys):
    run_dir = _copy(killed, tmp_path, "cli")
    target = run_dir / "checkpoints" / STEP4
    assert main(["train", "--nproc", "1", *BASE, f"--train.run_dir={run_dir}", "--train.steps=6",
                 f"--checkpoint.resume={target}"]) == 0
    out = capsys.readouterr().out
    assert f"resumed step 4 from {target}" in out, out
    assert json.loads((run_dir / "checkpoints" / step_name(6) / "manifest.json").read_text())["parent"]["name"] == STEP4


def test_read_only_commands_name_the_moved_aside_step_and_the_way_back(killed, tmp_path):
    run_dir = _copy(killed, tmp_path, "readonly")
    root, target = run_dir / "checkpoints", run_dir / "checkpoints" / STEP4
    before = sorted(p.name for p in root.iterdir())
    (old,) = root.glob(f".tmp-old-{STEP4}-*")
    messages = []
    for read in (lambda: verify_lines(target), lambda: check_weights_flag(str(target)),
                 lambda: export_hf(target, tmp_path / "hf")):
        with pytest.raises(UserError) as e:
            read()
        messages.append(str(e.value))
    assert main(["checkpoint", "verify", str(target)]) == 1
    for message in messages:
        assert str(old) in message and "--checkpoint.resume auto" in message, message
    assert sorted(p.name for p in root.iterdir()) == before  # (read-only: nothing renamed)
    # the command the message gives, run as given, puts it back: the step verifies as the one moved aside
    command = shlex.split(messages[0][messages[0].index("mv "):])
    subprocess.run(command, check=True)
    assert verify_lines(target)[0][-1].startswith("OK: step 4")
    assert (target / "manifest.json").read_bytes() == killed[1]


def test_a_live_runs_moved_aside_step_is_never_renamed(killed, tmp_path):
    run_dir = _copy(killed, tmp_path, "live")
    root = run_dir / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    holder = subprocess.Popen(  # a live `longctx train`'s hold on its checkpoint directory (run_lock.py: flock)
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('locked', flush=True); sys.stdin.read()", str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError) as e:
            _run(run_dir, "--train.steps=6", f"--checkpoint.resume={root / STEP4}")
        message = str(e.value)
        assert "in use" in message and ".tmp-old-" in message, message
        assert sorted(p.name for p in root.iterdir()) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert sorted(p.name for p in root.iterdir()) == before
