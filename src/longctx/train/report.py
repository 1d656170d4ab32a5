"""PNG plots of a run from its metrics JSONL: loss (train and eval), throughput (tokens/s with its
MFU scale) over memory, and for MoE models the expert load and router losses (expert_load.png) and
each expert's share of its layer's choices over the steps (expert_heatmap.png). token_log_axis: a
log-scaled token axis labelled at a few powers of 2 (1K, 64K, 1M), for plots over positions. What a run says
when it starts and ends: run_lines.py."""

from __future__ import annotations

from pathlib import Path

from ..config.checkpoint_paths import manifest_or_empty, step_name
from ..errors import UserError
from ..strict_json import number
from .metric_runs import continued, split_runs
from .metrics import read_jsonl
from .stage_marks import mark_stages, stage_starts


def _plot_store_evals(ax, evals: list[dict]) -> None:
    """A mix's eval loss of each store (the record's by_store), a dashed line each beside the blend's."""
    names = list(dict.fromkeys(name for r in evals for name in r.get("by_store") or {}))
    for name in names:
        points = [(r["step"], number(r["by_store"][name])) for r in evals if name in (r.get("by_store") or {})]
        ax.plot([s for s, _ in points], [x for _, x in points], label=f"eval: {name}", marker=".", linestyle="--")


def write_plots(run_dir: str | Path, metrics_path: str | Path | None = None, say=print) -> list[Path]:
    """The run's plots, written into `run_dir` (loss, throughput, and a MoE model's expert load): their paths.
    `metrics_path`: the file the run logged to (the trainer's; by default the one run_dir's config.toml names)."""
    import matplotlib  # (lazy: ~100 MB and a second to load, only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    runs = _run_records(run_dir, metrics_path, say)
    _, train, evals = runs[-1]  # (the run written last: the plots are its, the others' curves drawn beside)
    written = [_loss_plot(run_dir, train, evals, plt, runs), _throughput_plot(run_dir, train, plt, runs)]
    moe = [r for r in train if "moe_load_mean" in r]
    if moe:
        written.append(_expert_load_plot(run_dir, moe, plt))
    columns = [r for r in train if "moe_expert_load" in r]
    if columns:
        written.append(_expert_heatmap(run_dir, columns, plt))
    return written


def _run_records(run_dir: Path, metrics_path: str | Path | None, say) -> list[tuple[str | None, list, list]]:
    """Each run's (run_id, training records, eval records) in the metrics file, each step once, in step order (one
    run, unless records of several run ids are in it: metric_runs.py); the run directory's own last, else the one
    written last (a UserError where there are none)."""
    metrics_path = _metrics_file(run_dir, metrics_path)
    cut: list[int] = []
    records = read_jsonl(metrics_path, cut)
    if cut:  # (a run killed, or out of disk, while it wrote a line)
        say(f"note: {metrics_path}: line{'s' * (len(cut) > 1)} {', '.join(map(str, cut))} "
            f"{'are' if len(cut) > 1 else 'is'} no JSON record (a write cut short); left out of the plots")
    runs = []
    for run_id, ours in split_runs(records):
        ours = continued(ours, metrics_path, say)
        # (each step once, in step order: a resumed attempt's evaluations may come before its first training record)
        train = _last_per_step(r for r in ours if r.get("kind", "train") == "train")
        if train:
            runs.append((run_id, train, _last_per_step(r for r in ours if r.get("kind") == "eval")))
    if not runs:
        raise UserError(f"{metrics_path} holds no training records to plot: `longctx train` writes one at step 1 and "
                        f"every metrics.log_interval steps after it, so a run stopped before its first step wrote "
                        f"none.")
    if len(runs) > 1:
        own = _own_run_id(run_dir)
        runs.sort(key=lambda run: run[0] == own)  # (stable: else the run written last stays last)
        whose = "the run directory's own (its checkpoints')" if runs[-1][0] == own else "the one written last"
        say(f"note: {metrics_path} holds the records of {len(runs)} runs (run_id {', '.join(r[0] for r in runs)}): "
            f"the plots are run {runs[-1][0]}'s, {whose}; each other run's loss and tokens/s are drawn beside, "
            f"labelled 'run ID'")
    return runs


def _own_run_id(run_dir: Path) -> str | None:
    """The run_id the run directory's newest checkpoint saved (run_identity.py); None without one."""
    import json

    from ..checkpoint.manager import TRAINER_STATE

    for step in sorted(_checkpoint_roots(run_dir)[0].glob("step-*"), reverse=True):
        try:
            return (json.loads((step / TRAINER_STATE).read_text()).get("run") or {}).get("id")
        except (OSError, ValueError):
            continue
    return None


def _metrics_file(run_dir: Path, given: str | Path | None) -> Path:
    """The run's metrics file: `given`, the metrics.file its config.toml names, or <run_dir>/metrics.jsonl; a
    UserError that says why where there is none."""
    # (a run given --metrics.file wrote there: its config.toml says where)
    named = None if given else _run_setting(run_dir, "metrics", "file")
    path = Path(given or (_run_path(run_dir, named) if named else run_dir / "metrics.jsonl"))
    if path.is_file():
        return path
    if run_dir.is_file():  # (the metrics file itself, say)
        raise UserError(f"{run_dir} is a file; pass the run directory (the one holding it, {run_dir.parent}?).")
    if not run_dir.is_dir():
        raise UserError(f"there is no directory {run_dir}; pass the directory a `longctx train` run wrote (its "
                        f"train.run_dir, or the runs/<time>-<preset>/ it made).")
    if named and not Path(named).is_absolute():
        raise UserError(f"{run_dir / 'config.toml'} names metrics.file {named!r}, a path relative to the directory "
                        f"`longctx train` ran in, and there is no {path.resolve()}; run `longctx report` "
                        f"from the directory the run was started in.")
    runs = sorted({str(p.parent) for name in ("config.toml", "metrics.jsonl") for p in run_dir.glob(f"*/{name}")})
    if runs and not (run_dir / "config.toml").exists():  # (the directory above the runs: runs/)
        raise UserError(f"{run_dir} is no run directory but holds {len(runs)}: "
                        f"{', '.join(runs[:RUNS_NAMED])}{', ...' if len(runs) > RUNS_NAMED else ''}; pass one of them.")
    if named:  # (moved or deleted since: the run directory is right)
        raise UserError(f"{path} does not exist: it is the metrics.file {run_dir / 'config.toml'} names, which "
                        f"`longctx report` reads; put the file back there (moved or deleted since the run?).")
    raise UserError(f"{path} does not exist; pass the run directory a `longctx train` run wrote (a run writes its "
                    f"metrics from its first step on).")


RUNS_NAMED = 5  # run directories an error names at most
def _loss_plot(run_dir: Path, train: list[dict], evals: list[dict], plt, runs: list) -> Path:
    """loss.png: the training loss (rolled-back windows shaded, skipped steps marked), the evaluations'; the other
    `runs` of the metrics file beside it (_plot_other_runs)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (first, last) in enumerate(rolled_back_steps(run_dir)):  # (their records are the abandoned attempt's)
        ax.axvspan(first - 0.5, last + 0.5, color="0.88", label=None if i else "rolled back (updates discarded)")
    _plot_train_loss(ax, train)
    _plot_other_runs(ax, runs, lambda r: number(r.get("loss_mean", r["loss"])))
    _mark_skipped(ax, train)
    mark_stages(ax, run_stage_starts(run_dir, train[-1]["step"]))
    # (a staged run's evaluations of each stage are of its length: one line per stage, not joined across)
    for i, stage in enumerate(dict.fromkeys(r.get("stage") for r in evals)):
        ours = [r for r in evals if r.get("stage") == stage]
        ax.plot([r["step"] for r in ours], [number(r["loss"]) for r in ours], marker="o", color="tab:orange",
                label=None if i else "eval (the mean over its labelled tokens)")
    if evals:
        _plot_store_evals(ax, evals)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss - {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = run_dir / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput_plot(run_dir: Path, train: list[dict], plt, runs: list) -> Path:
    """throughput.png: tokens/s (with its MFU scale) over the memory the steps used; the other `runs`' tokens/s."""
    fig, (ax, mem_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["tokens_per_s"] for r in train], color="tab:blue", marker=".",
            label=f"run {runs[-1][0]}" if len(runs) > 1 else None)
    if _plot_other_runs(ax, runs, lambda r: r["tokens_per_s"]):
        ax.legend(fontsize=8)
    ax.set_ylabel("tokens/s")
    mark_stages(ax, run_stage_starts(run_dir, steps[-1]))
    # MFU is tokens/s times a constant (model FLOPs per token / the ranks' peak): a second scale on
    # the same curve, not a second curve drawn exactly on top of the first
    ratios = {round(r["mfu"] / r["tokens_per_s"], 15) for r in train if r.get("mfu") and r["tokens_per_s"]}
    if len(ratios) == 1:
        k = 100 * ratios.pop()
        ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k)).set_ylabel("MFU (%)")
    ax.set_title(f"throughput and memory - {run_dir.name}")
    ax.grid(alpha=0.3)
    mem_ax.plot(steps, [r["memory_gib"] for r in train], color="tab:green", marker=".")
    mem_ax.set_ylabel(f"GiB ({train[-1].get('memory_kind', 'peak')})", fontsize=8)
    mem_ax.set_xlabel("step")
    mem_ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "throughput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_other_runs(ax, runs: list, value) -> bool:
    """Each run but the last (the one plotted) of a metrics file several runs wrote: its `value` per training
    record, a thin line labelled with its id, so two runs' steps are never read as one curve. Whether any was."""
    for run_id, train, _ in runs[:-1]:
        ax.plot([r["step"] for r in train], [value(r) for r in train], lw=0.8, alpha=0.7, label=f"run {run_id}")
    return len(runs) > 1


SMOOTHING_POINTS = 5  # logged steps in the moving mean drawn over single-step losses


def _plot_train_loss(ax, train: list[dict]) -> None:
    """The training loss as the records hold it. A record's `loss` is the loss of its one logged
    step (one global batch), not a mean over the steps since the previous record: drawn as such, with
    a moving mean over SMOOTHING_POINTS logged steps (a mean of samples, said so). Records that
    carry `loss_mean` (the mean over all steps of their log interval) draw that mean instead, with a gap at
    a record without it: an interval whose every step was skipped (_mark_skipped marks it)."""
    steps = [r["step"] for r in train]
    if any("loss_mean" in r for r in train):
        ax.plot(steps, [number(r.get("loss_mean")) for r in train], marker=".", color="tab:blue",
                label="train (mean over each log interval)")
        return
    losses = [number(r["loss"]) for r in train]  # (null: a non-finite loss)
    every = _log_every(steps)
    ax.plot(steps, losses, marker=".", lw=0.6, alpha=0.45, color="tab:blue",
            label="train (the logged step's loss" + (f", every {every} steps)" if every > 1 else ")"))
    if len(train) >= 2 * SMOOTHING_POINTS:  # (only whole windows: a cut one at the ends would mislead)
        n, half = SMOOTHING_POINTS, SMOOTHING_POINTS // 2
        mean = [sum(losses[i:i + n]) / n for i in range(len(losses) - n + 1)]
        ax.plot(steps[half:half + len(mean)], mean, color="tab:blue", lw=1.8,
                label=f"train (moving mean of {n} logged steps, centred)")


def _mark_skipped(ax, train: list[dict]) -> None:
    """An x on the step axis at each record whose interval holds steps not applied (train.on_nonfinite = skip:
    non-finite, or a loss spike; a record's `skipped_steps` counts the run's so far), their number in the legend:
    a gap in the curve alone does not say why, and a skipped spike's finite loss leaves none."""
    marks, before, total = [], 0, 0
    for r in train:
        now = int(r.get("skipped_steps") or 0)
        if now > before:
            marks.append(r["step"])
            total += now - before
        before = now
    if marks:
        ax.plot(marks, [0.03] * len(marks), "x", color="tab:red", transform=ax.get_xaxis_transform(),
                label=f"skipped: {total} step{'s' * (total != 1)} not applied (x: in the log interval ending there)")


def _log_every(steps: list[int]) -> int:
    """The usual distance between logged steps (the first record is step 1, the last the run's end)."""
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]))
    return gaps[len(gaps) // 2] if gaps else 1


def _expert_load_plot(run_dir: Path, records: list[dict], plt) -> Path:
    """MoE runs: max/mean of the router's choices per expert (before a capacity's drops; mean over MoE layers
    and the worst layer; 1 = even), the rows the busiest expert-parallel rank ran over the mean, under a
    capacity the share of choices dropped (right axis), and the balancing losses."""
    fig, (load_ax, loss_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = [r["step"] for r in records]
    load_ax.plot(steps, [r["moe_load_mean"] for r in records], marker=".",
                 label="max/mean choices per expert (mean layer)")
    load_ax.plot(steps, [r["moe_load_worst"] for r in records], marker=".",
                 label="max/mean choices per expert (worst layer)")
    if any("expert_rank_load" in r for r in records):
        load_ax.plot(steps, [r.get("expert_rank_load", float("nan")) for r in records], marker=".",
                     label="rows the busiest expert-parallel rank ran / mean")
    load_ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    load_ax.set_ylabel("expert load")
    load_ax.set_title(f"expert load - {run_dir.name}")
    load_ax.grid(alpha=0.3)
    load_ax.legend(fontsize=8, loc="upper left")
    if any("moe_layer_drop" in r for r in records):  # (a capacity: the choices above it never ran)
        drop_ax = load_ax.twinx()
        drop_ax.plot(steps, [100 * r.get("moe_drop_rate", float("nan")) for r in records], color="tab:red",
                     ls="--", marker=".", label="choices dropped (%, right)")
        drop_ax.set_ylabel("choices dropped (%)", fontsize=8)
        drop_ax.set_ylim(bottom=0)
        drop_ax.legend(fontsize=8, loc="upper right")
    loss_ax.plot(steps, [r["moe_aux_loss"] for r in records], marker=".", label="aux (1 = balanced)")
    loss_ax.plot(steps, [r["moe_z_loss"] for r in records], marker=".", label="z")
    loss_ax.set_ylabel("router losses (unweighted)", fontsize=8)
    loss_ax.set_xlabel("step")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    path = run_dir / "expert_load.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


HEATMAP_PANELS = 8  # MoE layers drawn at most (the most unevenly loaded ones, past that)
HEATMAP_RANGE = 4.0  # the colour scale: 1/4 to 4 times an even share (beyond: the end colours)


def _expert_heatmap(run_dir: Path, records: list[dict], plt) -> Path:
    """MoE runs: each expert's share of its layer's choices over the steps (router_metrics.py's
    `moe_expert_load`, 1 = an even share), one panel per MoE layer, experts up, steps across; a
    column per record, spanning the steps it covers. Past HEATMAP_PANELS layers, the most unevenly
    loaded ones (highest expert load anywhere in the run)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    # the steps each column covers, a blank column where records are missing (a resumed run)
    edges, columns = [records[0].get("moe_expert_load_from", records[0]["step"]) - 1], []
    for r in records:
        start = r.get("moe_expert_load_from", edges[-1] + 1) - 1
        if start > edges[-1]:
            columns.append(None)
            edges.append(start)
        columns.append(np.asarray(r["moe_expert_load"], dtype=float) / 100)  # [layers, E]
        edges.append(r["step"])
    layers, experts = next(c for c in columns if c is not None).shape
    load = np.stack([np.full((layers, experts), np.nan) if c is None else c for c in columns], axis=-1)  # [L, E, t]
    blocks = records[-1].get("moe_blocks") or list(range(layers))
    shown = list(range(layers))
    if layers > HEATMAP_PANELS:
        worst = np.nanmax(load, axis=(1, 2))
        shown = sorted(np.argsort(-worst, kind="stable")[:HEATMAP_PANELS].tolist())
    # a log scale symmetric about an even share: 2x over reads as far from even as 2x under
    norm = LogNorm(vmin=1 / HEATMAP_RANGE, vmax=HEATMAP_RANGE)
    load = np.where(np.isnan(load), np.nan, np.maximum(load, 1 / HEATMAP_RANGE))  # (an idle expert: coldest)
    panel_h = min(1.8, max(1.0, 0.12 * experts))
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 1.0 + panel_h * len(shown)), sharex=True, squeeze=False,
                             layout="constrained")
    axes = axes[:, 0]
    for ax, i in zip(axes, shown):
        mesh = ax.pcolormesh(edges, np.arange(experts + 1) - 0.5, load[i], cmap="RdBu_r", norm=norm)
        ax.set_facecolor("0.6")  # steps no record covers (white is an even load)
        ax.set_ylabel(f"block {blocks[i]}\nexpert", fontsize=8)
        if experts <= 16:
            ax.set_yticks(range(experts))
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("step")
    what = (f"{len(shown)} of {layers} MoE layers (the most unevenly loaded)" if len(shown) < layers
            else f"{layers} MoE layer{'s' * (layers != 1)}")
    gap = "; grey: steps no record covers" if any(c is None for c in columns) else ""
    fig.suptitle(f"expert load over steps - {run_dir.name}\n{what}\neach column: the steps since the previous one{gap}",
                 fontsize=9)
    bar = fig.colorbar(mesh, ax=list(axes), extend="both", aspect=max(20, 12 * len(shown)))
    ticks = [2.0**k for k in range(-int(np.log2(HEATMAP_RANGE)), int(np.log2(HEATMAP_RANGE)) + 1)]
    bar.set_ticks(ticks, labels=[f"{t:g}" if t >= 1 else f"1/{1 / t:g}" for t in ticks])
    bar.minorticks_off()
    bar.set_label("share of the layer's choices / even share (1/experts)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    path = run_dir / "expert_heatmap.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


TOKEN_AXIS_LABELS = 8  # labelled ticks on a log token axis, at most


def token_text(n: int) -> str:
    """A power-of-2 token count as lengths are written (--lengths 1K,8K): 512, 1K, 64K, 1M, 2G."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n:g}"


def token_log_axis(ax, axis: str = "x", most: int = TOKEN_AXIS_LABELS) -> None:
    """Make `axis` of `ax` a log-scaled token axis (positions, lengths) for the data already drawn:
    ticks at powers of 2, at most `most` of them labelled (every 1st, 2nd, 5th or 10th power, so 1K and
    1M stay labelled as the span grows), as 1K / 64K / 1M; the other powers unlabelled minor ticks.
    (matplotlib's own log axis labels minor ticks when the data spans a decade or two, as one eval
    length's positions do, and those labels run into one another.)"""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    lo, hi = ax.dataLim.intervalx if axis == "x" else ax.dataLim.intervaly
    first, last = max(0, math.floor(math.log2(max(lo, 1)))), max(0, math.ceil(math.log2(max(hi, 1))))
    stride = next((s for s in (1, 2, 5, 10) if (last - first) // s + 1 <= most),
                  10 * math.ceil((last - first) / most / 10))
    powers = range(first, last + 1)
    which.set_major_locator(FixedLocator([2.0**k for k in powers if k % stride == 0]))
    which.set_major_formatter(FuncFormatter(lambda v, _: token_text(int(round(v)))))
    which.set_minor_locator(FixedLocator([2.0**k for k in powers if k % stride]))
    which.set_minor_formatter(NullFormatter())


def rolled_back_steps(run_dir: Path) -> list[tuple[int, int]]:
    """The [first, last] steps each rollback of the run discarded (train/rollback.py records them beside the
    checkpoints: <run>/checkpoints, or the checkpoint.dir its config.toml names): the records of those
    steps stay in metrics.jsonl, but the updates they logged were undone and their data is never trained."""
    from .rollback import RECORD

    roots = _checkpoint_roots(run_dir)
    # (every attempt's: a run resumed with another --checkpoint.dir recorded its earlier rollbacks in the first)
    records = [(root, r) for root in roots if (root / RECORD).is_file() for r in read_jsonl(root / RECORD)]
    return sorted({(int(r["skipped_steps"][0]), int(r["skipped_steps"][1])) for root, r in records
                   if not _abandoned(run_dir, root, roots[0], r)})


def _checkpoint_roots(run_dir: Path) -> list[Path]:
    """The checkpoint directories of the run's attempts, the last attempt's first: the checkpoint.dir its
    config.toml names (else <run>/checkpoints), then <run>/checkpoints and the checkpoint.dir of each earlier
    attempt's config, kept as config.before-stepN.toml where a resume changed a setting (checkpoint.dir too)."""
    earlier = sorted(p.name for p in run_dir.glob("config.before-step*.toml"))
    named = [_run_setting(run_dir, "checkpoint", "dir", config) for config in ["config.toml", *earlier]]
    roots = [_run_path(run_dir, named[0]) if named[0] else run_dir / "checkpoints", run_dir / "checkpoints",
             *(_run_path(run_dir, n) for n in named[1:] if n)]
    unique: dict[Path, Path] = {}
    for root in roots:  # (each once, where it first comes)
        unique.setdefault(root.resolve(), root)
    return list(unique.values())


def _abandoned(run_dir: Path, root: Path, latest: Path, rollback: dict) -> bool:
    """A rollback of an attempt that a resume of an older checkpoint abandoned: the checkpoint it went back to
    was saved again since, by the attempt that trained its skipped steps anew (another manifest checksum at that
    step), so those steps' records are that attempt's. Saved again in the rollback's own checkpoint directory
    `root`, or by this run in the last attempt's, `latest` (a resume into another --checkpoint.dir; there, a
    checkpoint another run saved is not this run's). (A record without a checksum, or a checkpoint since
    pruned, is kept: nothing says otherwise.)"""
    checksum = rollback.get("checkpoint")
    if not checksum or "rolled_back_to" not in rollback:
        return False
    name = step_name(int(rollback["rolled_back_to"]))
    if manifest_or_empty(root / name).get("checksum") not in (None, checksum):
        return True
    saved = manifest_or_empty(latest / name) if latest.resolve() != root.resolve() else {}
    by = saved.get("run_dir")
    return saved.get("checksum") not in (None, checksum) and bool(by) and Path(by).resolve() == run_dir.resolve()


def _run_path(run_dir: Path, named: str) -> Path:
    """A path the run's config.toml names (metrics.file, checkpoint.dir). A relative one is relative to the
    directory `longctx train` ran in, not necessarily this process's: where train.run_dir was relative too (or
    not given: runs/<time>-<preset>), that directory is `run_dir` less its trailing parts (runs/x of /a/runs/x)."""
    path = Path(named)
    if path.is_absolute() or path.exists():
        return path
    here = run_dir.resolve().parts
    stored = _run_setting(run_dir, "train", "run_dir") or str(Path("runs", here[-1]))
    parts = () if Path(stored).is_absolute() else Path(stored).parts
    if parts and ".." not in parts and len(here) > len(parts) and here[-len(parts):] == parts:
        return Path(*here[:-len(parts)]) / path
    return path


def run_stage_starts(run_dir: Path, last_step: int) -> list[tuple[int, int, int]]:
    """stage_marks.stage_starts of the run's own train.stages (its config.toml)."""
    return stage_starts(_run_setting(run_dir, "train", "stages"), last_step)


def _run_setting(run_dir: Path, section: str, key: str, config: str = "config.toml"):
    """A setting of the run's config.toml, or of another `config` in the run directory (None where it has
    none, or the directory no readable config)."""
    from ..config.load import tomllib  # (tomli before Python 3.11, which the project still supports)

    try:
        return tomllib.loads((run_dir / config).read_text()).get(section, {}).get(key) or None
    except (OSError, ValueError):
        return None


def _last_per_step(records) -> list[dict]:
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
