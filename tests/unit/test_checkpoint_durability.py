"""Checkpoints survive a power loss and resumes continue the right run (checkpoint/manager.py, durable.py,
config/resume.py, config/checkpoint_paths.py).

- Every file of a checkpoint is flushed to the disk (fsync) before the rename that publishes its
  directory; the directory's entries before it, the parent's after it; `latest` the same way. Without
  it a power loss (not a crash) can leave `latest` naming a checkpoint whose files never reached the disk.
- `--checkpoint.resume auto` falls back past a damaged `latest` only to older checkpoints: a newer one
  belongs to an attempt an explicit resume abandoned.
- `auto` with a --checkpoint.dir but no --train.run_dir (or a fresh run_dir) continues the saved run's
  config.toml, found through the directory above the checkpoints or the manifest's run_dir, instead of
  silently training on the defaults.
"""

import json
import os

import torch

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.config.checkpoint_paths import resume_candidates
from longctx.config.resume import load_run_config
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu"]


def _quiet(*_a, **_k):
    pass


def test_every_file_is_synced_before_the_checkpoint_is_published(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=2, async_save=False, rank=0, world=1, layout={}, model_cfg={},
                                log=_quiet)
    manager.run_dir = str(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    manager.save(3, model, optimizer, {"position": 0})
    monkeypatch.undo()

    final = root / "step-00000003"
    publish = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final))
    tmp = events[publish][1]
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    files = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    assert {"manifest.json", "trainer_state.json", ".metadata", "rng-rank0.pt"} <= set(files)
    renamed = {e[2]: e[1] for e in events[:publish] if e[0] == "replace"}  # the manifest is written as a temp file
    unsynced = [f for f in files if not {os.path.join(tmp, f), renamed.get(os.path.join(tmp, f))} & synced_before]
    assert not unsynced, f"files not synced before the checkpoint was published: {unsynced}"
    assert tmp in synced_before  # the directory's entries
    assert ("fsync", str(root)) in events[publish + 1:]
    pointer = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest"))
    assert pointer > publish and ("fsync", events[pointer][1]) in events[:pointer]
    assert ("fsync", str(root)) in events[pointer + 1:]
    assert (root / "latest").read_text().strip() == final.name
    assert json.loads((final / "manifest.json").read_text())["run_dir"] == str(tmp_path / "run")


def _checkpoint(root, step):
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def test_auto_falls_back_only_to_checkpoints_older_than_latest(tmp_path):
    # steps 10 and 20 saved; an explicit resume of 10 went on and saved 15 (latest): 20 is the abandoned attempt's
    old, abandoned, own = (_checkpoint(tmp_path, s) for s in (10, 20, 15))
    (tmp_path / "latest").write_text(own.name + "\n")
    assert resume_candidates(tmp_path) == [own, old]
    (tmp_path / "latest").unlink()  # no pointer: the newest complete one, then older ones
    assert resume_candidates(tmp_path) == [abandoned, own, old]


def test_auto_resume_with_only_a_checkpoint_dir_continues_the_saved_run(tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "elsewhere" / "ckpts"  # checkpoints outside the run directory
    first = [*BASE, f"--train.run_dir={run}", f"--checkpoint.dir={ckpts}", "--checkpoint.interval=2",
             "--train.lr=0.0123"]
    Trainer(load_config(None, [*first, "--train.steps=2"]), log=_quiet).run()
    for again in ([f"--checkpoint.dir={ckpts}"],  # no run_dir: found through the manifest's run_dir
                  [f"--checkpoint.dir={ckpts}", f"--train.run_dir={tmp_path / 'fresh'}"]):  # a new run_dir
        cfg, resumed = load_run_config(None, ["--checkpoint.resume=auto", "--train.steps=4", *again], False)
        assert resumed is not None and resumed.run_dir == run.resolve(), again
        assert cfg.train.lr == 0.0123 and cfg.train.seq_len == 64 and cfg.checkpoint.interval == 2
        assert resumed.changes == ["train.steps 2 -> 4"]
    # an explicit checkpoint path into a fresh run directory continues its run's config too
    cfg, resumed = load_run_config(None, [f"--checkpoint.resume={ckpts / 'step-00000002'}",
                                          f"--train.run_dir={tmp_path / 'fresh'}"], False)
    assert resumed.run_dir == run.resolve() and cfg.train.lr == 0.0123 and cfg.train.run_dir == str(tmp_path / "fresh")


def test_a_failed_pointer_write_leaves_no_temporary_file_and_old_ones_are_swept(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    import pytest

    from longctx.durable import write_text_durably

    (tmp_path / "latest").write_text("step-00000002\n")
    real = Path.write_text

    def full_disk(self, text, *a, **k):
        real(self, text[:3], *a, **k)  # part of it reached the disk, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_text_durably(tmp_path / "latest", "step-00000004\n")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert (tmp_path / "latest").read_text() == "step-00000002\n"  # the old pointer, whole
    # one a killed process left (SIGKILL between write and rename) is swept when a run opens the directory
    (tmp_path / ".latest.tmp-12345").write_text("step-0")
    CheckpointManager(tmp_path, keep=2, async_save=False, rank=0, world=1, layout={}, model_cfg={}, log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_pruning_keeps_this_runs_history_not_an_abandoned_attempts(tmp_path):
    """A resume of step 4 with steps 6, 8, 10 of an abandoned attempt in the directory: keep = 2 counted
    those, so the first save (step 6) deleted steps 2 and 4, the run's own, and kept the abandoned 8 and
    10. Now the newer ones are left as they are and not counted: step 4 and the new 6 are kept (the
    trajectory of the new 6: its parent 4, and 4's parent 2)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())

    def manager(keep):
        return CheckpointManager(tmp_path, keep=keep, async_save=False, rank=0, world=1, layout={}, model_cfg={},
                                 log=_quiet)

    def names():
        return sorted(p.name for p in tmp_path.iterdir())

    first = manager(keep=0)  # (the abandoned attempt keeps everything)
    for step in (2, 4, 6, 8, 10):
        first.save(step, model, optimizer, {"position": step})
    stale = (tmp_path / "step-00000008" / "manifest.json").read_text()
    again = manager(keep=2)  # resumed from step 4: its load names step 4 the parent of its next save
    again.parent = {"name": "step-00000004",
                    "checksum": json.loads((tmp_path / "step-00000004" / "manifest.json").read_text())["checksum"]}
    again.save(6, model, optimizer, {"position": 6})
    assert names() == ["latest", "step-00000004", "step-00000006", "step-00000008", "step-00000010"]
    assert (tmp_path / "step-00000008" / "manifest.json").read_text() == stale  # (untouched)
    again.save(8, model, optimizer, {"position": 8})  # the abandoned 8 replaced, 4 pruned
    assert names() == ["latest", "step-00000006", "step-00000008", "step-00000010"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000008"
