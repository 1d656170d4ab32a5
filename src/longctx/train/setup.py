"""What a training run sets up before its first step: its place in the job, run directory, data and
checkpoints (the model: model.py).

Each function does one thing and is called once by the Trainer (trainer.py); they are apart from
the loop so that the loop reads as the steps of training.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
from datetime import datetime
from pathlib import Path

from ..checkpoint.manager import CheckpointManager, resolve_checkpoint
from ..checkpoint.verify_command import layout_text
from ..config import Config, to_dict, to_toml
from ..config.data_mix import first_store, is_mix, parse_weights, store_paths
from ..config.data_rules import parse_synthetic
from ..config.resume import checkpoint_root, manifest_run_dir
from ..config.tokenizer import stored_identity, tokenizer_identity, unknown_tokenizer
from ..data.default_store import default_store
from ..data.loader import PackedSamples
from ..data.store import SPLITS, read_manifest, response_only_documents, text_prefix
from ..data.store_mix import StoreMix, check_same_kind, mix_line
from ..data.store_template import check_store_template, unchecked_note
from ..data.synthetic import SyntheticMixture
from ..data.tokenizer import load_tokenizer
from ..durable import write_text_durably
from ..errors import ConfigError, DataError
from ..job.runtime import Runtime, on_main
from .metrics import json_record
from .moved_aside import put_back_resumed
from .run_lock import RunLock
from .stages import holdout_grid, stage_config


def check_packages(cfg: Config) -> None:
    """The optional packages the config asks for are installed."""

    if cfg.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.tensorboard=true needs the tensorboard package: pip install tensorboard.")
    # (the plots are drawn at the run's end: without matplotlib a finished run stopped there on a traceback)
    if cfg.metrics.plots and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("metrics.plots=true needs the matplotlib package: pip install matplotlib, or pass "
                          "--metrics.plots false (`longctx report RUN_DIR` draws them later).")

RUN_FILES = ("config.toml", "metrics.jsonl")  # what makes a directory hold a run


def resume_target(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint `--checkpoint.resume` names (None: start at step 1). Its verification comes
    later, on every rank; a PATH that holds no complete checkpoint is an error here."""

    return resolve_checkpoint(cfg.checkpoint.resume, checkpoint_root(cfg, run_dir))


def check_run_dir(cfg: Config, target: Path | None = None) -> None:
    """Refuse a train.run_dir that already holds a run (its config.toml, metrics.jsonl, plots)
    unless this job continues it from its own checkpoints: anything else would overwrite its config,
    append a second step 1 to its metrics and redraw its plots over the old ones. `target`: the
    checkpoint to resume, when the caller has resolved it already."""
    if not cfg.train.run_dir:
        return  # runs/<time>-<preset>/ is new each time
    run_dir = Path(cfg.train.run_dir)
    used = [f for f in RUN_FILES if (run_dir / f).exists()]
    if not used:
        return
    root = checkpoint_root(cfg, run_dir)
    target = target or resume_target(cfg, run_dir)
    if target is not None and ({root.resolve(), run_dir.resolve()} & set(target.resolve().parents)):
        return  # a checkpoint of this run: its checkpoint directory, or inside the run directory
    if target is not None and (named := manifest_run_dir(target)) and named.resolve() == run_dir.resolve():
        return  # this run's, saved in an earlier --checkpoint.dir (moved to another disk when one filled)
    if cfg.checkpoint.resume == "none":
        why = "and this job does not resume it (--checkpoint.resume none)"
    elif target is None:
        why = f"and --checkpoint.resume {cfg.checkpoint.resume} found no checkpoint to continue it from in {root}"
    else:
        why = f"and --checkpoint.resume names a checkpoint of another run ({target})"
    raise ConfigError(
        f"train.run_dir {run_dir} already holds a run ({', '.join(used)}) {why}. Nothing was changed. To start "
        f"a new run, give another --train.run_dir (or none: a new runs/<time>-<preset>/ is made); to continue "
        f"this one, --checkpoint.resume auto needs a checkpoint in {root}; to start over in it, delete it first.")


def make_run_dir(cfg: Config, lock: RunLock | None = None, log=print) -> Path:
    """The run directory, made; `lock`: held by this run from here on, with the checkpoint directory of a run that
    saves or resumes, made now too (run_lock.py: before a start sweeps leftovers or moves metrics, another live
    run's refused; its checkpoint manager would make it anyway). First, the step an explicit --checkpoint.resume
    names put back where a killed re-save left it moved aside (moved_aside.py), before anything resolves it."""
    put_back_resumed(cfg.checkpoint.resume, log)
    if cfg.train.run_dir:
        check_run_dir(cfg)
        path = Path(cfg.train.run_dir)
    else:
        name = cfg.model.family if cfg.model.preset == "hf" else cfg.model.preset
        path = Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"
        n = 1
        while path.exists():
            path = path.with_name(f"{path.name}-{n}")
            n += 1
    path.mkdir(parents=True, exist_ok=True)
    if lock is not None:
        lock.take(path, "train.run_dir")
        root = checkpoint_root(cfg, path)
        with contextlib.suppress(OSError):  # (one that cannot be made: the checkpoint manager says why, as before)
            if cfg.checkpoint.saves_or_resumes:
                root.mkdir(parents=True, exist_ok=True)
        if root.is_dir():
            lock.take(root, "checkpoint.dir")
    return path


def continue_run_files(run_dir: Path, cfg: Config, start_step: int, log, metrics: Path | None = None) -> None:
    """Write the run's config.toml, keeping what a resumed run already holds: an earlier config
    that differs is kept as config.before-step{N}.toml, and metrics of steps after the resumed one
    (the attempt that went on past the checkpoint) move to metrics.after-step{N}.jsonl beside the
    metrics file, so the metrics and plots read as one run with nothing lost. `metrics`: the file the
    run logs to (metrics.file; default <run_dir>/metrics.jsonl): the one whose later steps move."""
    config, text = run_dir / "config.toml", to_toml(cfg)
    # (each written whole or not at all: a full disk, or a kill, mid-write left config.toml cut short or gone,
    # and the next resume, finding no saved config or part of one, ran on the defaults for what was lost)
    if start_step and config.exists() and (before := config.read_text()) != text:
        write_text_durably(run_dir / f"config.before-step{start_step}.toml", before)
    write_text_durably(config, text)
    metrics = Path(metrics) if metrics is not None else run_dir / "metrics.jsonl"
    if not start_step or not metrics.exists():
        return
    kept, later, saved = [], [], metrics.read_text()
    for line in saved.splitlines(keepends=True):
        (later if line.strip() and _record_step(line) > start_step else kept).append(line.rstrip("\n") + "\n")
    if not later:  # (a last line without its newline gets one: the resumed run's first record starts a line)
        if saved and not saved.endswith("\n"):
            write_text_durably(metrics, "".join(kept))
        return
    moved = metrics.with_name(f"{metrics.stem}.after-step{start_step}{metrics.suffix}")
    with moved.open("a") as f:
        f.writelines(later)
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics)
    log(f"run: {len(later)} metrics records of steps after {start_step} (the earlier attempt past the checkpoint) "
        f"moved to {moved.name}")


def _record_step(line: str) -> float:
    """The step of a metrics line; a line cut short by a kill or a full disk (no JSON object) is the earlier
    attempt's last, after every step (moved aside with the later records, not read as one)."""
    record = json_record(line)
    return math.inf if record is None else record.get("step", 0)


def store_path(cfg: Config, log, rt: Runtime | None, announce_cached: bool = True) -> str:
    """data.path, or the store built (once, then cached) from data.corpus. With several ranks,
    rank 0 builds and the others wait for it."""
    if cfg.data.path:
        return cfg.data.path
    check_tokenizer_known(cfg)

    # every stage's store holds out the same text (default_store: one grid), or a later stage would
    # evaluate on text an earlier one trained on
    return str(on_main(rt, lambda: default_store(cfg.data, cfg.train.seq_len, cfg.metrics.progress, log,
                                                 announce_cached=announce_cached, holdout_tokens=holdout_grid(cfg)),
                       "building the data store"))


def build_later_stores(cfg: Config, stages, start_step: int, log, rt: Runtime | None) -> None:
    """The default stores of the stages a run enters after the one it starts in (data.corpus at each stage's
    length), built now, at set-up, as `longctx train --nproc`'s preflight builds them: built when its stage began,
    rank 0's build ran under the hang watchdog while the other ranks waited for it in a broadcast, and one that
    took longer than parallel.timeout_s ended the job as hung (exit 86), hours into training. Only built: each is
    opened when its stage begins."""
    if cfg.data.path:
        return
    for stage in stages:
        if stage.first_step > start_step + 1:  # (the one the run starts in is built as it is entered)
            store_path(stage_config(cfg, stage), log, rt, announce_cached=False)


def run_tokenizer(cfg: Config) -> str:
    """What the run's token ids mean (recorded in each checkpoint's manifest): the resolved
    data.tokenizer, or, left `auto` for a data.path store, that store's own."""
    if cfg.data.tokenizer != "auto" or not cfg.data.path:
        return cfg.data.tokenizer
    return read_manifest(first_store(cfg.data.path))["tokenizer"]["spec"]  # (a mix's stores share it: check_mix)


def run_tokenizer_identity(cfg: Config, spec: str | None) -> str | None:
    """The content of the run's tokenizer `spec` (run_tokenizer; config/tokenizer.py tokenizer_identity, the
    sha256 data stores record), taken as the run starts and recorded beside it in each checkpoint's manifest:
    what names the tokenizer when its file has moved, or has been edited, by the time the weights are used.
    A data.path store's own record when the run takes the store's tokenizer (its file may have moved since the
    store was built); None when nothing names one."""
    if cfg.data.tokenizer == "auto" and cfg.data.path:
        return stored_identity(read_manifest(first_store(cfg.data.path))["tokenizer"])
    try:
        return tokenizer_identity(spec) if spec and spec != "auto" else None
    except ConfigError:  # (a file gone: building the data says so with its fix)
        return None


def run_text_prefix(cfg: Config) -> list[int]:
    """The special tokens the run's documents begin with (e.g. BOS; recorded in each checkpoint's
    manifest): its data.path store's, else those the default store's tokenizer puts before a text."""
    if cfg.data.path:
        return text_prefix(read_manifest(first_store(cfg.data.path)))
    spec = run_tokenizer(cfg)  # (`auto` here: the weights name none, which building the data reports)
    return [] if spec == "auto" else load_tokenizer(spec).text_prefix()


def check_tokenizer_known(cfg: Config) -> None:
    """data.tokenizer is still `auto` only when the weights of model.init_from name no tokenizer."""
    if cfg.data.tokenizer == "auto":
        raise unknown_tokenizer(cfg.model.init_from)


def _check_store(cfg: Config, path: str, manifest: dict) -> None:
    tok, seq = manifest["tokenizer"], cfg.train.seq_len
    if manifest["seq_len"] != seq:
        raise ConfigError(
            f"the data store {path} holds samples of {manifest['seq_len']} tokens but train.seq_len is {seq}; "
            f"set train.seq_len={manifest['seq_len']} or build a store with --seq-len {seq}."
        )
    if tok["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer of {path} ({tok['spec']}) has {tok['vocab_size']} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok['vocab_size']}."
        )
    want = cfg.data.tokenizer
    if want == "auto" and cfg.model.init_from:
        check_tokenizer_known(cfg)
    if want not in ("auto", tok["spec"]):
        if stored_identity(tok) != tokenizer_identity(want):
            whose = (f"the tokenizer of model.init_from = {cfg.model.init_from!r}" if cfg.model.init_from
                     else "data.tokenizer")
            fix = ("build a store with the model's tokenizer (longctx data build --tokenizer "
                   f"{want}), or drop data.path to build one from data.corpus" if cfg.model.init_from else
                   "drop data.tokenizer (the store's tokenizer is used)")
            raise ConfigError(f"the data store {path} was tokenized with {tok['spec']} but the run's tokenizer is "
                              f"{want} ({whose}); training would read token ids the model does not mean. To fix: "
                              f"{fix}.")
    # (after the tokenizer: a store of another tokenizer is that, not one of another template)
    check_store_template(path, tok.get("chat_template"), tok["spec"] if want == "auto" else want)


def eval_split_problem(cfg: Config, path, manifest: dict) -> str | None:
    """Why this run cannot evaluate (None: it can, or evaluation is off): an eval split smaller than
    one global batch, empty included, turns evaluation off with this message; never a silent skip,
    never a stop over a side metric. (Evaluation reads whole global batches, so its loss does not
    depend on grad_accum or the layout.)"""
    n, batch = manifest["totals"]["eval_samples"], cfg.train.global_batch
    if not cfg.train.eval_interval or n >= batch:
        return None
    fix = "build the store with a larger --eval-fraction" if cfg.data.path else "raise data.eval_fraction"
    return (f"evaluation is off: the eval split of {path} has {n} samples, fewer than one global batch of {batch} "
            f"(train.global_batch); to evaluate, {fix} or lower train.global_batch; set train.eval_interval=0 to "
            f"not be told.")


def check_store(cfg: Config, path) -> dict:
    """The store's manifest, once it is known to fit this run (seq_len, tokenizer, vocabulary)."""
    manifest = read_manifest(path)
    _check_store(cfg, str(path), manifest)
    return manifest


def _missing_prefix(manifest: dict) -> str:
    """A store written before documents began with their tokenizer's special tokens, for a tokenizer
    that puts some before a text (e.g. Llama's BOS): what the run trains on unlike the model's pretraining."""
    tok = manifest["tokenizer"]
    if "text_prefix" in tok or tok["name"] == "byte":
        return ""
    try:
        prefix = load_tokenizer(tok["spec"]).text_prefix()
    except DataError:  # (its file is gone: the tokenizer checks say so where it matters)
        return ""
    return (f"its documents were built without the {prefix} their tokenizer puts before every text (e.g. BOS), "
            f"which a pretrained model saw before each document; rebuild it with `longctx data build` to train "
            f"with them" if prefix else "")


def build_data(cfg: Config, log=print, rt: Runtime | None = None):
    """Train and eval samples of the run's store (eval is None when evaluation is off or empty)."""
    if is_mix(cfg):
        return build_mix(cfg, log)
    t0 = time.perf_counter()
    path = store_path(cfg, log, rt)
    manifest = check_store(cfg, path)
    train = PackedSamples(path, "train", cfg.data.doc_mask)
    if len(train) == 0:
        raise DataError(f"the data store {path} has no training samples; build it from more documents.")
    pairs = sum(response_only_documents(p) for p in manifest["parts"])  # (instruction data)
    trained = f", {pairs:,} trained on their responses only: {int(train.label_counts.sum()):,} labels" if pairs else ""
    mixture = parse_synthetic(cfg.data.synthetic)
    if mixture:
        train = SyntheticMixture(train, *mixture, cfg.train.seed, load_tokenizer(manifest["tokenizer"]["spec"]))
        log(f"data: {int(train.synthetic.sum()):,} of {len(train):,} training samples are {mixture[0]} sequences "
            f"(data.synthetic = {cfg.data.synthetic})")
    for note in (_missing_prefix(manifest), unchecked_note(manifest)):
        if note:
            log(f"data: {path}: {note}")
    problem = eval_split_problem(cfg, path, manifest)
    evals = None
    if problem:
        log(f"data: {problem}")
    elif cfg.train.eval_interval:
        evals = PackedSamples(path, "eval", cfg.data.doc_mask)
    t, tok = manifest["totals"], manifest["tokenizer"]
    fill = manifest["packing"]["train"]["fill_rate"]
    # (a document the holdout cuts in two is in both splits)
    in_split = {s: sum(p["splits"].get(s, {}).get("documents", 0) for p in manifest["parts"]) for s in SPLITS}
    log(f"data: {path} -> {t['documents']:,} documents (train tokens from {in_split['train']:,}, eval from "
        f"{in_split['eval']:,}; {t['duplicates_removed']:,} duplicates removed{trained}), "
        f"{train.num_tokens:,} train tokens in {len(train):,} samples of {cfg.train.seq_len} ({manifest['strategy']}, "
        f"fill {fill:.3f}), {t['eval_samples']:,} eval samples{'' if evals is not None else ' (not evaluated)'} "
        f"({tok['name']} tokenizer, "
        f"{time.perf_counter() - t0:.1f}s)")
    return train, evals


def open_checkpointing(cfg: Config, run_dir: Path, rt: Runtime, model, optimizer, sampler, log,
                       tokenizer: str | None = None):
    """The checkpoint manager (None when neither saving nor resuming) and the step to continue after."""
    ck = cfg.checkpoint
    if not ck.saves_or_resumes:
        return None, 0

    root = checkpoint_root(cfg, run_dir)
    layout = {"world": rt.world, **{k: getattr(rt.dims, k) for k in
                                    ("dp_replicate", "dp_shard", "head", "ctx", "window", "placement", "expert")}}
    manager = CheckpointManager(root, keep=ck.keep, async_save=ck.async_save, rank=rt.rank, world=rt.world,
                                layout=layout, model_cfg=to_dict(cfg)["model"], log=log,
                                tokenizer=tokenizer, draft=getattr(model, "checkpoint_record", None),
                                tokenizer_identity=run_tokenizer_identity(cfg, tokenizer))
    manager.run_dir = str(run_dir.resolve())
    manager.config = to_toml(cfg)  # (config.toml's text: a rollback past a resume that edited it compares with this)
    # the grid its default-corpus stores hold out on (store_path): `longctx eval` reads that corpus on it
    manager.holdout_tokens = 0 if cfg.data.path else holdout_grid(cfg)
    manager.text_prefix = run_text_prefix(cfg)  # what generate and eval begin a prompt with
    # verified on every rank before anything is loaded: `auto` skips damaged checkpoints (and says so)
    found = manager.resume_point(ck.resume)
    if found is None:
        if ck.resume != "none":
            log(f"checkpoint: nothing to resume in {root}; starting at step 1")
        return manager, 0
    path, manifest = found
    state = manager.load(path, model, optimizer, manifest)  # (a progress phase: a large model's states are minutes)
    sampler.load_state_dict(state["sampler"])
    # (both layouts whole, the expert degree too: a resume under another one reshards the experts)
    log(f"checkpoint: resumed step {state['step']} from {path} (written by {layout_text(state['manifest']['layout'])}; "
        f"now {layout_text(layout)})")
    if state["step"] >= cfg.train.steps:
        log(f"checkpoint: step {state['step']} is already >= train.steps={cfg.train.steps}; nothing to train")
    return manager, int(state["step"])


def check_mix(cfg: Config) -> list[dict]:
    """The manifests of a mix's stores (data.path naming several), once each fits the run (check_store), they
    agree with each other (tokenizer, text prefix: data/store_mix.py) and each one weighed has training samples."""
    paths = store_paths(cfg.data.path)
    manifests = [read_manifest(p) for p in paths]
    check_same_kind(paths, manifests)  # (first: a store unlike the others is that, not unlike the run's tokenizer)
    for path, manifest in zip(paths, manifests):
        _check_store(cfg, path, manifest)
    weights = parse_weights(cfg.data.weights) or [1.0] * len(paths)
    for path, manifest, weight in zip(paths, manifests, weights):
        if weight > 0 and not manifest["totals"].get("train_samples", 0):
            why = ("its weight in data.weights cannot be drawn" if cfg.data.weights.strip() else
                   "it would never be read (data.weights is '': each store is weighed by its training samples)")
            raise DataError(f"the data store {path} of the mix has no training samples, so {why}; build it from more "
                            f"documents, or drop it from data.path.")
    return manifests


def mix_eval_problem(cfg: Config, mix: StoreMix, manifests: list[dict]) -> str | None:
    """Why a mix cannot evaluate (eval_split_problem's rule for one store): a store weighed in the mix whose
    eval split is empty (the eval blend has the training blend's weights), or a blend of fewer samples than
    one global batch."""
    if not cfg.train.eval_interval:
        return None
    empty = [name for name, w, m in zip(mix.names, mix.weights, manifests) if w > 0 and not m["totals"]["eval_samples"]]
    if empty:
        return (f"evaluation is off: the eval split of {', '.join(empty)} is empty, and the eval blend has the "
                f"weights of the training one; build those stores with --eval-fraction > 0, or set "
                f"train.eval_interval=0 to not be told.")
    # (a store of weight 0 is never drawn: its eval samples would only make the weighed stores' repeat)
    weighed = [(path, m) for path, w, m in zip(mix.paths, mix.weights, manifests) if w > 0]
    total = {"eval_samples": sum(m["totals"]["eval_samples"] for _, m in weighed)}
    return eval_split_problem(cfg, ",".join(path for path, _ in weighed), {"totals": total})


def build_mix(cfg: Config, log=print):
    """Train and eval samples of a weighted mix of stores (data/store_mix.py StoreMix): the eval split is the
    same blend (same weights and seed) over the stores' eval splits."""
    t0 = time.perf_counter()
    manifests = check_mix(cfg)
    paths, weights = store_paths(cfg.data.path), parse_weights(cfg.data.weights) or None
    split = lambda name, weights: StoreMix([PackedSamples(p, name, cfg.data.doc_mask) for p in paths],  # noqa: E731
                                           paths, weights, cfg.train.seed)
    train = split("train", weights)
    for path, manifest in zip(paths, manifests):
        for note in (_missing_prefix(manifest), unchecked_note(manifest)):
            if note:
                log(f"data: {path}: {note}")
    problem = mix_eval_problem(cfg, train, manifests)
    if problem:
        log(f"data: {problem}")
    # the training blend's weights, also where they are the stores' training samples (data.weights = ''): weighed
    # by their eval splits' sizes instead, stores built with other eval fractions would blend otherwise
    evals = split("eval", list(train.weights)) if cfg.train.eval_interval and not problem else None
    log(f"data: {len(paths)} stores ({', '.join(paths)}) -> {train.num_tokens:,} train tokens in {len(train):,} "
        f"samples of {cfg.train.seq_len}, {0 if evals is None else evals.weighed_samples:,} eval samples"
        f"{'' if evals is not None else ' (not evaluated)'} ({time.perf_counter() - t0:.1f}s)")
    log(f"data: {mix_line(train, cfg.train.steps * cfg.train.global_batch)}")
    return train, evals
