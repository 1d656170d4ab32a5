"""Everything `longctx train` can check before it starts a process, checked once, here.

Found after launch, a mistake is printed by every rank, glued into the others' output and wrapped
in the launcher's lines, and only after the time it takes to start them. So before any rank starts,
the launcher checks the device (with train.compile, that torch.compile can build kernels on it), the layout,
the paths (data store, Hugging Face weights, checkpoint to resume, run directory; no file where a directory the
run writes should be, no other run's checkpoints in its checkpoint directory), what the data store holds against
the run (sample length, tokenizer against the model's vocabulary, eval split), and optional packages; it also
builds or finds the cached default store and the CPU peak that MFU divides by, so no rank does either while the
others wait.
Before the data (cheap checks first) it refuses a run whose ranks on this node would not fit in
the free host memory (`check_host_memory`), as the OOM killer would refuse it later.
The ranks repeat the checks that guard their own work (a job started by torchrun directly has no
launcher of ours), which then pass.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.identity import weights_identity
from ..checkpoint.manifest import check_draft_matches, check_model_matches, read_manifest
from ..config import Config, to_dict
from ..config.checkpoint_paths import complete_checkpoints
from ..config.data_mix import is_mix
from ..config.data_rules import parse_synthetic
from ..config.draft_rules import clover_ranks_problem
from ..config.hf import hf_dir
from ..config.hf_export import ROPE_SCALING_READS
from ..config.resume import checkpoint_root
from ..costs.peaks import machine_cpu_peak, precision_name
from ..data.default_store import default_store
from ..data.synthetic import check_room
from ..data.tokenizer import load_tokenizer
from ..durable import file_in_the_way
from ..errors import ConfigError, DataError
from ..faults import planned
from ..job.checks import check_layout, ranks_per_node
from ..job.devices import resolve_device, resolve_dtype
from ..models.compile import check_compiler
from ..models.hf_files import weight_files
from .host_budget import check_host_memory
from .setup import (
    check_mix,
    check_packages,
    check_run_dir,
    check_store,
    check_tokenizer_known,
    resume_target,
)
from .stages import holdout_grid, stage_config, stages_of


def preflight(cfg: Config, nproc: int, log=print) -> None:
    """Raise the first UserError a run of `cfg` on `nproc` ranks would meet at start-up."""
    device_type = _device_type(cfg)  # first: train.device=cuda on a machine without one fails before any data work
    if cfg.train.compile:  # (no C++ compiler / Triton: one line naming the setting, not inductor's in the first step)
        check_compiler(device_type)
    dims = check_layout(cfg, nproc)
    planned("hang", 0, dims.world_size)  # (LONGCTX_FAULT's hang of a rank the job lacks: refused before its start)
    clover = clover_ranks_problem(cfg, dims.world_size)  # (data ranks: refused here, before the data store)
    if clover:
        raise ConfigError(clover)
    check_packages(cfg)
    if cfg.model.init_from.startswith("hf:"):  # missing or partial shards (a checkpoint is checked at load)
        weight_files(hf_dir(cfg.model.init_from))
    _check_resume(cfg)
    _check_output_paths(cfg)
    # the launcher starts every one of the nproc ranks on this machine (torchrun --standalone), whatever
    # parallel.ranks_per_node says the job's nodes are (hpz / qgz emulate nodes on one machine with it)
    ranks_per_node(cfg, nproc)  # (checked: it must divide the job)
    check_host_memory(cfg, dims, nproc, device_type, new_processes=nproc > 1)  # (ranks to start: relaunch)

    for stage in stages_of(cfg):  # every stage's store (built here once, cached) fits the run
        _check_data(stage_config(cfg, stage), log)
    if device_type == "cpu" and not cfg.metrics.peak_tflops:
        dtype = resolve_dtype(cfg.train.dtype, resolve_device(cfg.train.device))  # (the precision MFU divides by)
        peak, path, measured = machine_cpu_peak(dtype)
        if measured:
            log(f"metrics: calibrated this machine's CPU {precision_name(dtype)} GEMM peak once: "
                f"{peak / 1e12:.3f} TFLOP/s (cached in {path}; MFU divides by it)")


def _device_type(cfg: Config) -> str:
    return resolve_device(cfg.train.device).type


def _check_resume(cfg: Config) -> None:
    """The checkpoint to resume exists and is of this model; the run directory is not another run's."""
    run_dir = Path(cfg.train.run_dir) if cfg.train.run_dir else None
    if run_dir is None and cfg.checkpoint.resume != "none" and not cfg.checkpoint.dir:
        # a new runs/<time>-<preset>/ holds no checkpoint: `auto` would silently start at step 1
        if cfg.checkpoint.resume == "auto":
            raise ConfigError("--checkpoint.resume auto needs the run to continue: give its --train.run_dir (or "
                              "--checkpoint.dir); without one, each run gets a new directory with no checkpoints.")
    target = resume_target(cfg, run_dir or Path("."))
    if target is not None:
        manifest = read_manifest(target)
        check_model_matches(manifest, to_dict(cfg)["model"], target)
        if not cfg.checkpoint.allow_changes:
            _check_rope_matches(manifest["model"], to_dict(cfg)["model"], target)
        check_draft_matches(manifest, cfg.draft.layers if cfg.draft.target else None, target, cfg.draft.kind,
                            cfg.draft.vocab, weights_identity(cfg.draft.target) if cfg.draft.target else None)
    check_run_dir(cfg, target)
    _check_checkpoint_dir(cfg, target, run_dir)


def _check_rope_matches(saved: dict, given: dict, target: Path) -> None:
    """The RoPE a checkpoint trained with is the run's: a resume whose run directory (config.toml, which
    config/resume.py compares) is gone builds its config from the defaults and the command line, and the shape
    check passes a yarn-extended checkpoint continued under plain RoPE without a word."""
    kind = saved.get("rope_scaling")
    keys = ["rope_theta", "rope_scaling"] + [f"rope_{k}" for k in ROPE_SCALING_READS.get(kind, {})]
    diff = [(k, saved[k], given.get(k)) for k in keys if k in saved and saved[k] != given.get(k)]
    if kind != given.get("rope_scaling"):  # (another scaling's own keys: only the scaling is said)
        diff = [d for d in diff if d[0] in ("rope_theta", "rope_scaling")]
    if diff:
        said = ", ".join(f"model.{k} {a!r} in the checkpoint vs {b!r} configured" for k, a, b in diff)
        flags = " ".join(f"--model.{k}={str(saved[k]).lower() if isinstance(saved[k], bool) else saved[k]}"
                         for k in keys if k in saved and saved[k] != given.get(k))
        raise ConfigError(f"checkpoint {target} trained with another RoPE ({said}); resuming would continue it "
                          f"under the configured one (the command line over its run's config.toml, or over the "
                          f"defaults where that is gone) without a word. Resume with the checkpoint's settings "
                          f"({flags}), or add --checkpoint.allow_changes true to change them.")


def _check_checkpoint_dir(cfg: Config, target: Path | None, run_dir: Path | None) -> None:
    """A run that saves into a checkpoint directory holding another run's checkpoints (a shared
    --checkpoint.dir, a run directory's checkpoints/ without its config.toml) would replace their step
    directories of the same numbers, prune the older ones (checkpoint.keep) and move `latest` to its own:
    refused unless this job continues one of them."""
    ck = cfg.checkpoint
    if (not ck.interval and not ck.final) or (run_dir is None and not ck.dir):
        return  # (nothing is saved; or a new runs/<time>-<preset>/checkpoints/)
    root = checkpoint_root(cfg, run_dir or Path("."))
    found = complete_checkpoints(root)
    if not found or (target is not None and root.resolve() in target.resolve().parents):
        return
    resumes = f"it resumes {target}, elsewhere" if target is not None else f"--checkpoint.resume {ck.resume}"
    raise ConfigError(
        f"the checkpoint directory {root} already holds {len(found)} checkpoint(s) of another run (the newest "
        f"{found[-1].name}), which this job does not continue ({resumes}): its saves would replace their step "
        f"directories of the same numbers, delete the older ones (checkpoint.keep) and move `latest`. Nothing was "
        f"changed. Give another --checkpoint.dir, continue them with --checkpoint.resume auto, or delete them first.")


def _check_output_paths(cfg: Config) -> None:
    """The directories the run writes into can be made: a file where one of them (or a parent) should be
    failed with a raw FileExistsError once the model was built (checkpoint.dir: at the first save, after a
    step's work), and a directory as metrics.file with an IsADirectoryError."""
    t, ck, mt = cfg.train, cfg.checkpoint, cfg.metrics
    run_dir = Path(t.run_dir) if t.run_dir else Path("runs")  # ('': a new runs/<time>-<preset>/ under it)
    checkpoints = Path(ck.dir) if ck.dir else run_dir / "checkpoints"
    wanted = [("train.run_dir", t.run_dir or "runs", run_dir),
              ("checkpoint.dir", ck.dir or "<run_dir>/checkpoints", checkpoints),
              ("metrics.file", mt.file, Path(mt.file).parent if mt.file else None)]
    for key, given, directory in wanted:
        blocker = file_in_the_way(directory) if directory is not None else None
        if blocker is not None:
            raise ConfigError(f"{key} {given}: the run writes into the directory {directory}, but {blocker} is a "
                              f"file. Pass another {key}, or move the file away.")
    if mt.file and Path(mt.file).is_dir():
        raise ConfigError(f"metrics.file {mt.file} is a directory; it names the JSONL file the metrics go to (e.g. "
                          f"{Path(mt.file) / 'metrics.jsonl'}), or '' for <run_dir>/metrics.jsonl.")


def _check_data(cfg: Config, log) -> None:
    """The store exists and fits the run; the default store is built (or found in the cache) here."""
    if is_mix(cfg):
        check_mix(cfg)  # every store fits the run and the mix's other stores
        return
    if cfg.data.path:
        path = cfg.data.path
    else:
        check_tokenizer_known(cfg)

        # before tokenizing a corpus with it: the model must have a row for each of its tokens
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer {cfg.data.tokenizer} has {vocab} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; add --model.vocab_size {vocab} (or more, e.g. a multiple of 64).")
        path = default_store(cfg.data, cfg.train.seq_len, cfg.metrics.progress, log, announce_cached=False,
                             holdout_tokens=holdout_grid(cfg))  # (the store the run reads: setup.py)
    manifest = check_store(cfg, path)  # (an eval split too small is not an error: rank 0 says so at start)
    mixture = parse_synthetic(cfg.data.synthetic)
    if mixture:
        check_room(mixture[0], cfg.train.seq_len, load_tokenizer(manifest["tokenizer"]["spec"]),
                   "train.stages length" if cfg.train.stages else "train.seq_len")
    if not manifest["totals"].get("train_samples", 1):
        raise DataError(f"the data store {path} has no training samples; build it from more documents.")
