"""Saving and resuming training state, under any layout.

Layout independence comes from PyTorch Distributed Checkpoint: model and optimizer states are saved by
fully-qualified parameter name with their global shapes (`get_state_dict`), whatever the sharding, and loaded into
whatever sharding the resumed job has (`set_state_dict`). The data position is the sampler's global cursor, which
does not depend on the number of ranks, and the learning-rate schedule is a function of the step; the spike check's
window (train/guard.py) is saved beside the data position. Each rank's random generators are saved too
(`rng-rank{r}.pt`, checkpoint/rng_states.py). The optimizer's hyper-parameters are the resumed run's config's, not
the saver's. Under co2 the replicas' weights and moments differ: DCP, which keeps one copy of a replicated tensor,
is told to keep the lowest rank's, so that the checkpoint holds replica 0's whole state (dp_replicate is the mesh's
outer dim, job/dims.py), not its default, each tensor from whichever rank had written least: a mix no rank held.

Crash safety: every save is written into a hidden temporary directory. When its own files are on disk, each rank
hashes them (the DCP shards `__{rank}_*.distcp` and its RNG file; rank 0 also the job-wide .metadata and
trainer_state.json) and leaves the checksums there; after a barrier rank 0 merges them into the manifest, renames
the directory to `step-NNNNNNNN`, and only then points `latest` at it and prunes old checkpoints. A crash at any
moment leaves the previous complete checkpoint and `latest` untouched.

Async saves (`--checkpoint.async`): the states are staged into host memory (the only part the training loop waits
for); DCP writes them in a background thread, and another background thread on each rank hashes that rank's files
and (rank 0) commits. At most one save is in flight: a new save first waits for the last.

Resuming verifies before it loads: the ranks split the checkpoint's files between them, each checks its share's
checksums, and one all-reduce makes every rank agree on the verdict. A damaged checkpoint is never loaded; `auto`
falls back to the newest intact one and says why.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)

from ..config.checkpoint_paths import (
    LATEST,
    complete_checkpoints,
    latest_checkpoint,
    resolve_checkpoint,
    resume_candidates,
    step_name,
)
from ..durable import publish, write_text_durably
from ..faults import planned
from ..job import comm, watchdog
from ..job.launch import new_gloo_group
from ..progress import phase
from .background import Worker, host_copies, reusable_stager, silence_single_process_save
from .counted_read import read_counted
from .failures import SAVE_ERRORS, save_failed, state_bytes
from .manifest import (
    CHECKSUM_MISMATCH,
    MANIFEST,
    CheckpointError,
    DamagedManifest,
    check_draft_matches,
    check_model_matches,
    check_weights_fit,
    checkpoint_files,
    collect_hashes_parts,
    damage_report,
    file_problem,
    hash_files,
    owner_rank,
    rank_bytes,
    read_manifest,
    unlisted_problems,
    verification_shares,
    verify,
    write_hashes_part,
    write_manifest,
)
from .retention import moved_aside_name, prune, sweep_leftovers
from .rng_states import _rng_state, local_state_file, restore_rng, rng_file

TRAINER_STATE = "trainer_state.json"


class CheckpointManager:
    def __init__(self, root: Path, *, keep: int, async_save: bool, rank: int, world: int, layout: dict,
                 model_cfg: dict, log=print, create: bool = True, tokenizer: str | None = None,
                 draft: dict | None = None, tokenizer_identity: str | None = None):
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self.tokenizer, self.tokenizer_identity = tokenizer, tokenizer_identity  # in the manifest: what eval reads
        self.draft = draft  # a GliDe draft run's record (train/glide.py), in the manifest; None for a model
        # the positions the weights have trained on so far (the trainer raises it as stages start; 0 = unknown),
        # in the manifest: what `longctx generate` trusts the model with (config/positions.py)
        self.trained_positions = 0
        self.holdout_tokens = 0  # the eval-split grid of the run's default-corpus store (manifest.py), 0: not one
        self.text_prefix: list[int] = []  # the special tokens its documents begin with (manifest.py)
        self.run_dir: str | None = None  # the run directory (absolute), in the manifest: where resumes find its config
        self.config: str | None = None  # the run's config.toml text, in the manifest: what its weights trained under
        self.rank, self.world, self.layout, self.model_cfg, self.log = rank, world, layout, model_cfg, log
        # DCP's writes, the hashing barrier and the verdicts' all-reduces: a group apart from the training loop's
        self.group = new_gloo_group() if world > 1 else None
        self._mesh = None  # the same group as a 1-D mesh: what comm's collectives take
        if self.group is not None:
            from torch.distributed.device_mesh import DeviceMesh  # (only with several ranks)

            self._mesh = DeviceMesh.from_group(self.group, "cpu", mesh_dim_names=("checkpoint",))
        self._stager = None  # host staging buffers, allocated at the first async save and reused
        # state that is this rank's own and no layout-free tensor can hold (train.data_parallel = co2's
        # replicas): a callable returning a dict, captured at each save into `local-rank{r}.pt`
        self.rank_state = None
        # the trainer's own state beside step and data position (the spike check's window, FlexMoE's placements):
        # name -> a callable returning a JSON-able dict, saved under that name in trainer_state.json
        self.extra_state: dict[str, Callable[[], dict]] = {}
        self.resumed_from: tuple[Path, dict] | None = None  # (path, manifest) of the last load
        # the checkpoint this run saved or loaded last ({"name", "checksum"}): the next one's parent (manifest.py)
        self.parent: dict | None = None
        self.resumed_state: dict | None = None  # its trainer state (trainer_state.json and the manifest)
        # async saves: where each rank hashes its files and rank 0 commits, off the training loop
        self._worker = Worker("checkpoint-finish") if async_save else None
        self._finishing: Future | None = None  # the async save in flight
        self.last_save_blocking_s = 0.0
        self.saves = 0  # saves started by this manager (LONGCTX_FAULT=enospc@N fails the N-th)
        self._enospc = planned("enospc")
        if rank == 0 and create:  # (create=False: a reader of checkpoints that writes none)
            self.root.mkdir(parents=True, exist_ok=True)
            sweep_leftovers(self.root)  # (retention.py: what killed saves, commits and prunes left)
        if self._mesh is not None and create:  # every rank lists the checkpoints only after rank 0's restore
            comm.barrier(self._mesh)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, model, optimizer, sampler_state: dict) -> None:
        """Save; returns once the states are written (sync) or staged in host memory (async).
        `last_save_blocking_s` is the time the caller waited, all of it."""
        self.wait()  # at most one save in flight
        t0 = time.perf_counter()
        self.saves += 1
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        own_bytes = state_bytes(state)
        tmp = self._temporary_directory(step, own_bytes)
        watchdog.watch_writes(functools.partial(rank_bytes, tmp, self.rank))  # (a slow disk is not a hang)
        # captured now (the generators move on with training), written with the rest off the loop
        trainer_state = {"step": step, "sampler": sampler_state, **{k: f() for k, f in self.extra_state.items()}}
        own_files = functools.partial(self._write_own_files, tmp, _rng_state(), json.dumps(trainer_state), self.saves,
                                      None if self.rank_state is None else self.rank_state())
        # the manifest's record of this step, as it is now: an async commit runs while the loop goes on, and the
        # first step of a new stage raises trained_positions before it (the step saved never trained there)
        record = self._manifest_record()
        kwargs = dict(checkpoint_id=str(tmp), process_group=self.group, no_dist=self.world == 1)
        if self.rank_state is not None:  # the replicas differ (co2): all of replica 0's, not a mix (docstring)
            kwargs["planner"] = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        if self.async_save:
            if self._stager is None:
                self._stager = reusable_stager()
            if self._stager is not None:
                kwargs["async_stager"] = self._stager
            else:  # (older torch stages host tensors by reference)
                state = host_copies(state)
            if kwargs["no_dist"]:  # (its write warns in DCP's thread, after any context around this call)
                silence_single_process_save()
            future = dcp.async_save(state, **kwargs)
            if hasattr(future, "upload_completion"):  # AsyncSaveResponse (newer torch)
                future = future.upload_completion
            self._finishing = self._worker.submit(self._finish, step, tmp, own_files, own_bytes, future.result, record)
        else:
            def write():
                with _single_process(kwargs["no_dist"]):
                    dcp.save(state, **kwargs)

            self._finish(step, tmp, own_files, own_bytes, write, record)
        self.last_save_blocking_s = time.perf_counter() - t0

    def _manifest_record(self) -> dict:
        return {"trained_positions": self.trained_positions, "run_dir": self.run_dir,
                "holdout_tokens": self.holdout_tokens, "text_prefix": self.text_prefix, "parent": self.parent,
                "config": self.config}

    def _temporary_directory(self, step: int, own_bytes: float) -> Path:
        """A fresh hidden directory for this save, the same on every rank. A full disk already there fails the
        save as any failed save does (save_failed), on every rank alike: a rank that went on alone into DCP's
        collective writes would wait for the one that failed (which, under on_save_error = warn, trains on)."""
        name = f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}" if self.rank == 0 else None
        if self.world > 1:
            name = comm.broadcast_object_in_group(name, self.group)
        tmp, error = self.root / name, None
        try:
            tmp.mkdir(parents=True, exist_ok=True)  # by every rank: each writes its RNG file there
        except OSError as e:
            error = e
        failed, needed = float(error is not None), own_bytes
        if self._mesh is not None:  # (one CPU all-reduce, as _finish's: did any rank fail, and the job's bytes)
            flags = comm.all_reduce_in_group(torch.tensor([failed, needed], dtype=torch.float64), self.group)
            failed, needed = float(flags[0]), float(flags[1])
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise save_failed(self.root, step, needed, error, self.own_newest()) from error
        return tmp

    def _write_own_files(self, tmp: Path, rng: dict, trainer_state: str, ordinal: int = 0,
                         rank_state: dict | None = None) -> None:
        """This rank's RNG state (and its own state, if any); rank 0 also the trainer state (step and
        data position are job-wide)."""
        if ordinal in self._enospc:  # LONGCTX_FAULT=enospc@N (a testing aid): the disk is full
            raise OSError(errno.ENOSPC, f"No space left on device (LONGCTX_FAULT=enospc@{ordinal})")
        torch.save(rng, tmp / rng_file(self.rank))
        if rank_state is not None:
            torch.save(rank_state, tmp / local_state_file(self.rank))
        if self.rank == 0:
            (tmp / TRAINER_STATE).write_text(trainer_state)

    def _finish(self, step: int, tmp: Path, own_files, own_bytes: float = 0.0, written=lambda: None,
                record: dict | None = None) -> None:
        """Write this rank's own files (`own_files()`), and once DCP's are written too (`written()`
        returns) hash them (every rank in parallel, each over the bytes it wrote); then rank 0 commits
        when every rank's checksums are there. If any rank failed (a full disk, an unwritable
        directory), every rank learns it, the temporary directory is removed, nothing is committed
        (`latest` keeps pointing at the previous checkpoint) and each rank raises a CheckpointError
        that says how much space the save needed."""
        error = None
        try:
            written()  # first: DCP's writes are collective (a rank that skipped them would hang the others)
            own_files()
            own = hash_files(tmp, [rel for rel in checkpoint_files(tmp) if owner_rank(Path(rel).name) == self.rank],
                             sync=True)
            if self.rank != 0:  # rank 0 keeps its own in memory
                write_hashes_part(tmp, self.rank, own)
        except SAVE_ERRORS as e:  # agreed on below, so that no rank waits for this one forever (DCP's own too)
            error = e
        failed, needed = float(error is not None), own_bytes
        if self._mesh is not None:  # one CPU all-reduce: did any rank fail, and the job's bytes
            flags = comm.all_reduce_in_group(torch.tensor([failed, needed], dtype=torch.float64), self.group)
            failed, needed = float(flags[0]), float(flags[1])
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise save_failed(self.root, step, needed, error, self.own_newest())
        commit_error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, {**own, **collect_hashes_parts(tmp, range(1, self.world))}, record)
            except Exception as e:  # (a full disk at the manifest): said to every rank, lest they train on alone
                commit_error = e
                shutil.rmtree(tmp, ignore_errors=True)
        if self._mesh is not None:
            flags = comm.all_reduce_in_group(torch.tensor([float(commit_error is not None)], dtype=torch.float64),
                                             self.group)
            if float(flags[0]) and commit_error is None:
                commit_error = OSError("rank 0 could not commit it")
        if commit_error is not None:
            raise save_failed(self.root, step, needed, commit_error, self.own_newest())
        if self.rank != 0:  # committed: every rank's own newest (a rollback's candidate: rollback.py), not rank 0's
            self.parent = {"name": step_name(step), "checksum": None}  # (only rank 0's manifests name a parent)

    def _commit(self, step: int, tmp: Path, hashes: dict[str, dict], record: dict | None = None) -> None:
        record = record or self._manifest_record()
        written = write_manifest(tmp, step=step, layout=self.layout, model=self.model_cfg, hashes=hashes,
                       tokenizer=self.tokenizer, tokenizer_identity=self.tokenizer_identity, draft=self.draft, **record)
        final = self.root / step_name(step)
        # durably (durable.py): every rank synced its files (_finish), so after a power loss `latest` never
        # names a checkpoint whose files did not reach the disk
        trash = None
        if final.exists():  # a re-run of the same step: replace it only now that the new one is complete
            trash = moved_aside_name(final)
            os.replace(final, trash)
        try:
            publish(tmp, final)
            write_text_durably(self.root / LATEST, final.name + "\n")
        except BaseException:  # all or nothing: the new directory back to `tmp` (removed by the caller), the old
            if final.exists() and not tmp.exists():  # one of this step back in place, `latest` as it was
                os.replace(final, tmp)
            if trash is not None:
                os.replace(trash, final)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self.parent = {"name": final.name, "checksum": written["checksum"]}
        prune(self.root, self.keep, keep_also=final)  # (retention.py)
        self.log(f"checkpoint: saved step {step} to {final}")

    def own_newest(self) -> Path | None:
        """The checkpoint this run committed or loaded last (None: it has none yet): what it continues from, which
        `latest` does not name after a resume of an older checkpoint (or one elsewhere) until the run commits."""
        if self.parent is not None:
            return self.root / self.parent["name"]
        return None if self.resumed_from is None else self.resumed_from[0]

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, hashed and committed."""
        if self._finishing is None:
            return
        finishing = self._finishing
        try:
            finishing.result()
        except BaseException as e:
            if not finishing.done():  # the wait itself interrupted (Ctrl-C): the save is still in flight, and is
                raise  # waited for again on the way out (train/saves.py finish_in_flight), not forgotten
            self._finishing = None
            if isinstance(e, CheckpointError) or not isinstance(e, Exception):
                raise
            raise CheckpointError(f"the background checkpoint save failed: {e}") from e
        self._finishing = None

    # ------------------------------------------------------------------ verifying
    def find_damage(self, path: Path, progress=None) -> tuple[dict | None, dict[str, str]]:
        """(manifest, {file: what is wrong}); the same on every rank. Each rank checks its share of the
        files (presence, size, sha256) and one all-reduce of per-file codes combines the verdicts.
        The manifest itself is read by every rank (a shared file system, as DCP needs anyway).
        A progress phase counts the MB checksummed of this rank's share (`progress`, the caller's, or its own)."""
        if progress is not None:
            return self._find_damage(path, progress)
        share = " (this rank's share)" if self.world > 1 else ""  # (an 8B model's checksums are minutes)
        with phase(f"checkpoint: verifying the checksums of {path}{share}", done_line=False) as progress:
            return self._find_damage(path, progress)

    def _find_damage(self, path: Path, progress) -> tuple[dict | None, dict[str, str]]:
        try:
            manifest = read_manifest(path)
        except DamagedManifest as e:
            return None, {MANIFEST: e.problem}
        entries = manifest["files"]
        shares = verification_shares(entries, self.world)
        progress.expect(sum(e["bytes"] for i, e in enumerate(entries) if shares[i] == self.rank) / 1e6, "MB")
        mine = {i: file_problem(path, e, progress=progress) for i, e in enumerate(entries) if shares[i] == self.rank}
        # per file: 0 intact, 1 missing or wrong size, 2 checksum mismatch (max over ranks = any rank's finding)
        codes = torch.tensor([0 if mine.get(i) is None else 2 if mine[i] == CHECKSUM_MISMATCH else 1
                              for i in range(len(entries))], dtype=torch.int32)
        if self._mesh is not None and len(entries):
            codes = comm.all_reduce(codes, self._mesh, op=dist.ReduceOp.MAX, label="checkpoint verify")
        problems = {}
        for i, code in enumerate(codes.tolist()):
            if code:
                problems[entries[i]["path"]] = mine.get(i) or (
                    CHECKSUM_MISMATCH if code == 2 else
                    file_problem(path, entries[i], checksums=False) or "is missing or has another size on another rank")
        problems.update(unlisted_problems(path, manifest))  # (every rank lists the same directory)
        return manifest, problems

    def verified_manifest(self, path: Path, spec: str | None = None) -> dict:
        """The manifest of `path` once every rank agrees it is intact; else a CheckpointError on every rank."""
        manifest, problems = self.find_damage(path)
        if problems:
            where = f"--checkpoint.resume {spec}: " if spec else ""
            raise CheckpointError(
                f"{where}checkpoint {path} is damaged: {damage_report(problems)}. Nothing was loaded. Resume from "
                f"an intact checkpoint (`longctx checkpoint verify PATH` checks one), or use --checkpoint.resume "
                f"auto with --checkpoint.dir set to its directory: auto skips damaged checkpoints.")
        return manifest

    def resume_point(self, spec: str) -> tuple[Path, dict] | None:
        """The checkpoint `--checkpoint.resume spec` names, verified, and its manifest (None: start
        afresh). An explicit path must be intact; `auto` skips damaged checkpoints, saying so, and
        stops only when none of them is intact."""
        if spec == "none":
            return None
        if spec != "auto":
            path = resolve_checkpoint(spec, self.root)
            return path, self.verified_manifest(path, spec)
        damaged = {}
        for path in resume_candidates(self.root):
            manifest, problems = self.find_damage(path)
            if not problems:
                if damaged:
                    self.log(f"checkpoint: resuming from {path.name}, the newest intact checkpoint in {self.root}")
                return path, manifest
            damaged[path.name] = damage_report(problems)
            self.log(f"checkpoint: {path} is damaged ({damaged[path.name]}); not loading it, trying the previous "
                     f"complete checkpoint")
        if damaged:
            found = "; ".join(f"{name}: {report}" for name, report in damaged.items())
            raise CheckpointError(
                f"--checkpoint.resume auto: no complete checkpoint in {self.root} is intact ({found}). Nothing was "
                f"loaded. Restore the directory from a copy, resume from an intact "
                f"checkpoint elsewhere with --checkpoint.resume PATH, or start afresh with --checkpoint.resume none "
                f"and another --checkpoint.dir.")
        return None

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, model, optimizer, manifest: dict | None = None) -> dict:
        """Restore model, optimizer and RNG from `path` into the current layout; returns the trainer state.
        `manifest` is one `resume_point` verified already; without it the checkpoint is verified here. The read is
        a progress phase counting this rank's MB (counted_read.py)."""
        if manifest is None:
            manifest = self.verified_manifest(path)
        check_model_matches(manifest, self.model_cfg, path)
        d = self.draft or {}
        check_draft_matches(manifest, d.get("layers"), path, d.get("kind", "glide"), d.get("vocab", 0),
                            (d.get("target") or {}).get("identity"))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        check_weights_fit(path, model_sd)
        state = {"model": model_sd, "optim": optim_sd}
        # the state (moments, step counts) is the checkpoint's; every group's hyper-parameters are this run's
        # (its config's betas, eps, weight_decay, which a resume may change and announces; how it computes the
        # step, fused or foreach, a property of its device and memory.model_states): the checkpoint's groups
        # would bring the saver's. (lr: the trainer sets the schedule's every step.)
        own_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        with _single_process(self.world == 1):
            read_counted(state, path, process_group=self.group, no_dist=self.world == 1)
        # (not redundant after the read into the live tensors: the host optimizer's own load_state_dict takes its
        # masters from the loaded weights again, else its next step writes stale ones; test_state_load116.py)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, own in zip(optimizer.param_groups, own_groups):
            params = group["params"]
            group.clear()
            group.update(params=params, **own)
        restore_rng(path, manifest, self.rank, self.world)  # (rng_states.py)
        self.resumed_from = (path, manifest)
        here = path.resolve().parent == self.root.resolve()  # (one loaded from elsewhere starts a trajectory here)
        self.parent = {"name": path.name, "checksum": manifest.get("checksum")} if here else None
        trainer = json.loads((path / TRAINER_STATE).read_text())
        trainer["manifest"] = manifest
        self.resumed_state = trainer
        return trainer

    def load_rank_state(self, path: Path, manifest: dict) -> dict | None:
        """This rank's own state saved in `path` (rank_state), or None when the checkpoint has none or was
        written under another layout (its ranks are not this job's)."""
        own = path / local_state_file(self.rank)
        saved = {"expert": 1, **manifest["layout"]}  # (written before the layout named its expert degree: 1)
        if saved != {"expert": 1, **self.layout} or not own.is_file():
            return None
        return torch.load(own, weights_only=True)


@contextmanager
def _single_process(no_dist: bool):
    """Around a DCP call made with no_dist=True: PyTorch warns that it is "assuming the intent is to
    load (save) in a single process" even when that intent is passed (no_dist=True), on every load of
    a single-process run. Only that warning, only around our call that states the intent, is silenced."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (load|save) "
                                r"in a single process", category=UserWarning)
        yield


__all__ = ["CheckpointManager", "CheckpointError", "complete_checkpoints", "latest_checkpoint", "read_manifest",
           "resolve_checkpoint", "resume_candidates", "verify"]
