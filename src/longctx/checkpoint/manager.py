"""Saving and resuming training state, under any layout.

Layout independence comes from PyTorch Distributed Checkpoint: model and optimizer states are
saved by fully-qualified parameter name with their global shapes (`get_state_dict`), whatever the
sharding, and loaded into whatever sharding the resumed job has (`set_state_dict`). The data
position is the sampler's global cursor, which does not depend on the number of ranks, and the
learning-rate schedule is a function of the step.

Crash safety: every save is written into a hidden temporary directory; when all files are on
disk, rank 0 writes the manifest (with checksums) into it, renames it to `step-NNNNNNNN`, and only
then points `latest` at it and prunes old checkpoints. A crash at any moment leaves the previous
complete checkpoint and `latest` untouched.

Async saves (`--checkpoint.async`): the states are staged into host memory (the only part the
training loop waits for), written by DCP in a background thread, and committed by rank 0 in
another background thread. At most one save is in flight: a new save first waits for the last.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..parallel import comm
from ..parallel.launch import new_gloo_group
from .manifest import CheckpointError, check_model_matches, read_manifest, verify, write_manifest

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """step-* directories that hold a manifest, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, if it is complete (else the newest complete one)."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "manifest.json").is_file():
            return candidate
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(spec: str, root: Path) -> Path | None:
    """'auto' -> latest complete checkpoint under root (None if there is none); a path -> that checkpoint
    (a checkpoints directory means its latest)."""
    if spec == "none":
        return None
    if spec == "auto":
        return latest_checkpoint(root)
    path = Path(spec)
    if (path / "manifest.json").is_file():
        return path
    if path.is_dir() and latest_checkpoint(path) is not None:
        return latest_checkpoint(path)
    raise CheckpointError(f"--checkpoint.resume {spec}: no complete checkpoint there (a step-* directory with "
                          f"manifest.json, or a directory holding them).")


def _reusable_stager():
    """A DCP stager that copies into host buffers it keeps for the next save (pinned on CUDA)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: DCP's own default staging
        return None
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, root: Path, *, keep: int, async_save: bool, rank: int, world: int, layout: dict,
                 model_cfg: dict, log=print):
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self.rank, self.world, self.layout, self.model_cfg, self.log = rank, world, layout, model_cfg, log
        # DCP's background writes run collectives; they get their own group so they never interleave
        # with the training loop's collectives on the default group.
        self.group = new_gloo_group() if world > 1 else None
        self._future = None
        self._stager = None  # host staging buffers, allocated at the first async save and reused
        self._commit_thread: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self.last_save_blocking_s = 0.0
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):  # leftovers of saves that never completed
                shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, model, optimizer, sampler_state: dict) -> None:
        self.wait()  # at most one save in flight
        t0 = time.perf_counter()
        tmp_name = f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}" if self.rank == 0 else None
        if self.world > 1:
            tmp_name = comm.broadcast_object_in_group(tmp_name, self.group)
        tmp = self.root / tmp_name
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        kwargs = dict(checkpoint_id=str(tmp), process_group=self.group, no_dist=self.world == 1)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, "sampler": sampler_state}))
            torch.save(_rng_state(), tmp / "rng.pt")
        if self.async_save:
            if self._stager is None:
                self._stager = _reusable_stager()
            if self._stager is not None:
                kwargs["async_stager"] = self._stager
            self._future = dcp.async_save(state, **kwargs)
            if hasattr(self._future, "upload_completion"):  # AsyncSaveResponse (newer torch)
                self._future = self._future.upload_completion
        else:
            dcp.save(state, **kwargs)
        self.last_save_blocking_s = time.perf_counter() - t0
        if self.rank == 0:
            if self.async_save:
                self._commit_thread = threading.Thread(target=self._commit_after_write, args=(step, tmp),
                                                       daemon=True)
                self._commit_thread.start()
            else:
                self._commit(step, tmp)

    def _commit_after_write(self, step: int, tmp: Path) -> None:
        try:
            self._future.result()
            self._commit(step, tmp)
        except BaseException as e:  # surfaced by wait()
            self._commit_error = e

    def _commit(self, step: int, tmp: Path) -> None:
        write_manifest(tmp, step=step, layout=self.layout, model=self.model_cfg)
        final = self.root / step_name(step)
        if final.exists():  # a re-run of the same step: replace it only now that the new one is complete
            trash = self.root / f".tmp-old-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        pointer_tmp = self.root / (LATEST + ".tmp")
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, self.root / LATEST)
        self._prune(keep_also=final)
        self.log(f"checkpoint: saved step {step} to {final}")

    def _prune(self, keep_also: Path) -> None:
        found = complete_checkpoints(self.root)
        for old in found[:-self.keep] if self.keep else []:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        if self._future is not None:
            self._future.result()
            self._future = None
        if self._commit_thread is not None:
            self._commit_thread.join()
            self._commit_thread = None
        if self._commit_error is not None:
            err, self._commit_error = self._commit_error, None
            raise CheckpointError(f"the background checkpoint save failed: {err}") from err

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, model, optimizer) -> dict:
        """Restore model, optimizer and RNG from `path` into the current layout; returns the trainer state."""
        manifest = verify(path, checksums=False)  # sizes and presence; `longctx checkpoint verify` does checksums
        check_model_matches(manifest, self.model_cfg, path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), process_group=self.group, no_dist=self.world == 1)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        trainer = json.loads((path / TRAINER_STATE).read_text())
        trainer["manifest"] = manifest
        return trainer


def load_model_weights(path: Path, model) -> dict:
    """Only the model weights of a checkpoint, into a single-process model (for export)."""
    manifest = verify(path, checksums=True)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return manifest


__all__ = ["CheckpointManager", "CheckpointError", "complete_checkpoints", "latest_checkpoint", "load_model_weights",
           "read_manifest", "resolve_checkpoint", "verify"]
