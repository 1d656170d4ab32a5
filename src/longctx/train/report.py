"""PNG plots of a run from its metrics JSONL: loss (train and eval), throughput (tokens/s with its
MFU scale) over memory, and for MoE models the expert load and router losses (expert_load.png) and
each expert's share of its layer's choices over the steps (expert_heatmap.png). token_log_axis: a
log-scaled token axis labelled at a few powers of 2 (1K, 64K, 1M), for plots over positions.
describe_run and done_line: what a run says when it starts and when it ends."""

from __future__ import annotations

import json
from pathlib import Path

from ..config.checkpoint_paths import MANIFEST, step_name
from ..config.inert_options import inert_option_notes
from ..config.rules import moe_notes
from ..errors import UserError
from ..models.llama import count_params
from ..step.schedule import schedule_note, schedule_words
from ..strict_json import number
from .metrics import read_jsonl


def _plot_store_evals(ax, evals: list[dict]) -> None:
    """A mix's eval loss of each store (the record's by_store), a dashed line each beside the blend's."""
    names = list(dict.fromkeys(name for r in evals for name in r.get("by_store") or {}))
    for name in names:
        points = [(r["step"], number(r["by_store"][name])) for r in evals if name in (r.get("by_store") or {})]
        ax.plot([s for s, _ in points], [x for _, x in points], label=f"eval: {name}", marker=".", linestyle="--")


def write_plots(run_dir: str | Path, metrics_path: str | Path | None = None, say=print) -> list[Path]:
    import matplotlib  # (lazy: ~100 MB and a second to load, only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    # (a run given --metrics.file wrote there: its config.toml says where)
    named = None if metrics_path else _run_setting(run_dir, "metrics", "file")
    metrics_path = Path(metrics_path or (_run_path(run_dir, named) if named else run_dir / "metrics.jsonl"))
    if not metrics_path.is_file():
        if named and not Path(named).is_absolute():
            raise UserError(f"{run_dir / 'config.toml'} names metrics.file {named!r}, a path relative to the directory "
                            f"`longctx train` ran in, and there is no {metrics_path.resolve()}; run `longctx report` "
                            f"from the directory the run was started in.")
        raise UserError(f"{metrics_path} does not exist; pass the run directory a `longctx train` run wrote.")
    cut: list[int] = []
    records = read_jsonl(metrics_path, cut)
    if cut:  # (a run killed, or out of disk, while it wrote a line)
        say(f"note: {metrics_path}: line{'s' * (len(cut) > 1)} {', '.join(map(str, cut))} "
            f"{'are' if len(cut) > 1 else 'is'} no JSON record (a write cut short); left out of the plots")
    # the newest record of each step (a run resumed by an older longctx repeated steps)
    train = _last_per_step(r for r in records if r.get("kind", "train") == "train")
    evals = _last_per_step(r for r in records if r.get("kind") == "eval")
    if not train:
        raise UserError(f"{metrics_path} holds no training records to plot.")

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (first, last) in enumerate(rolled_back_steps(run_dir)):  # (their records are the abandoned attempt's)
        ax.axvspan(first - 0.5, last + 0.5, color="0.88", label=None if i else "rolled back (updates discarded)")
    _plot_train_loss(ax, train)
    if evals:
        ax.plot([r["step"] for r in evals], [number(r["loss"]) for r in evals],
                label="eval (the mean over its labelled tokens)", marker="o", color="tab:orange")
        _plot_store_evals(ax, evals)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss - {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    loss_png = run_dir / "loss.png"
    fig.savefig(loss_png, dpi=100)
    plt.close(fig)

    fig, (ax, mem_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["tokens_per_s"] for r in train], color="tab:blue", marker=".")
    ax.set_ylabel("tokens/s")
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
    tput_png = run_dir / "throughput.png"
    fig.savefig(tput_png, dpi=100)
    plt.close(fig)
    written = [loss_png, tput_png]
    moe = [r for r in train if "moe_load_mean" in r]
    if moe:
        written.append(_expert_load_plot(run_dir, moe, plt))
    columns = [r for r in train if "moe_expert_load" in r]
    if columns:
        written.append(_expert_heatmap(run_dir, columns, plt))
    return written


SMOOTHING_POINTS = 5  # logged steps in the moving mean drawn over single-step losses


def _plot_train_loss(ax, train: list[dict]) -> None:
    """The training loss as the records hold it. A record's `loss` is the loss of its one logged
    step (one global batch), not a mean over the steps since the previous record: drawn as such, with
    a moving mean over SMOOTHING_POINTS logged steps (a mean of samples, said so). Records that
    carry `loss_mean` (the mean over all steps of their log interval) draw that mean instead."""
    steps = [r["step"] for r in train]
    if all("loss_mean" in r for r in train):
        ax.plot(steps, [number(r["loss_mean"]) for r in train], marker=".", color="tab:blue",
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

    named = _run_setting(run_dir, "checkpoint", "dir")
    roots = [run_dir / "checkpoints", *([_run_path(run_dir, named)] if named else [])]
    # (both: a run resumed with another --checkpoint.dir recorded its earlier rollbacks in the first)
    records = [r for root in roots if (root / RECORD).is_file() for r in read_jsonl(root / RECORD)
               if not _abandoned(root, r)]
    return sorted({(int(r["skipped_steps"][0]), int(r["skipped_steps"][1])) for r in records})


def _abandoned(root: Path, rollback: dict) -> bool:
    """A rollback of an attempt that a resume of an older checkpoint abandoned: the checkpoint it went back to
    was saved again since, by the attempt that trained its skipped steps anew (another manifest checksum at that
    step), so those steps' records are that attempt's. (A record without a checksum, or a checkpoint since
    pruned, is kept: nothing says otherwise.)"""
    checksum = rollback.get("checkpoint")
    if not checksum or "rolled_back_to" not in rollback:
        return False
    try:
        saved = json.loads((root / step_name(int(rollback["rolled_back_to"])) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and saved.get("checksum") not in (None, checksum)


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


def _run_setting(run_dir: Path, section: str, key: str):
    """A setting of the run's config.toml (None where it has none, or the directory no readable config)."""
    from ..config.load import tomllib  # (tomli before Python 3.11, which the project still supports)

    try:
        return tomllib.loads((run_dir / "config.toml").read_text()).get(section, {}).get(key) or None
    except (OSError, ValueError):
        return None


def _last_per_step(records) -> list[dict]:
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def describe_run(cfg, world: int, dims, model, device, dtype, peak: str) -> list[str]:
    """The run's opening line: the model, its precision and memory policy, the layout."""
    from .. import threads
    from ..config.load import lr_note

    mem = cfg.memory
    expert = f" (expert {dims.expert} folded over them)" if getattr(dims, "expert", 1) > 1 else ""
    layout = (f"{world} ranks: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x head {dims.head} x ctx "
              f"{dims.ctx}" + (f" (window {dims.window})" if dims.window else "") + f", {dims.placement}{expert}"
              if world > 1 else "1 process")
    cpu = f", {threads.describe()}" if device.type == "cpu" else ""
    return [f"model: {cfg.model.label}, {count_params(model) / 1e6:.2f}M parameters, "
            f"{device.type} {str(dtype).removeprefix('torch.')}{cpu}, memory: recompute={mem.recompute}"
            + (f" offload={mem.offload_fraction} skip_last={mem.offload_skip_last}" if mem.offload_fraction else "")
            + _memory_options(mem) + f", loss_chunk={mem.loss_chunk}, {layout}"
            + (", compiled (train.compile: each block's token-wise parts)" if cfg.train.compile else "")
            + (", deterministic kernels (train.deterministic)" if cfg.train.deterministic else "")
            + (", loss per sequence (train.loss_weighting: each trained sequence's mean, averaged)"
               if cfg.train.loss_weighting == "sequence" else "")
            + f"; {lr_note(cfg)}" + (f", {words}" if (words := schedule_words(cfg)) else "") + f"; {peak}"] + (
        [model.grad_bucket_plan.describe()] if hasattr(model, "grad_bucket_plan") else []) + [
        f"note: {note}" for note in (moe_notes(cfg.model) if not cfg.draft.target else []) + [schedule_note(cfg)]
        + inert_option_notes(cfg) if note]


def _memory_options(mem) -> str:
    """The memory settings a run departs from the default in, beyond recompute and offload (a plan's choices,
    planner/output.py, read back in the setup line): chunks, the attention offload, grad_sync, model_states."""
    chunks = "".join(f" {k}={getattr(mem, k)}" for k in ("block_chunk", "attention_chunk", "expert_chunk")
                     if getattr(mem, k))
    return (chunks + (" attention_offload=true" if mem.attention_offload else "")
            + (f" grad_sync={mem.grad_sync}" if mem.grad_sync != "step" else "")
            + (f" model_states={mem.model_states}" if mem.model_states != "device" else ""))


def done_line(result, steps: int, total_s: float, run_dir: Path, plots: bool, checkpoints: Path | None,
              draft_target: str = "", skipped: int = 0, rollbacks: int = 0) -> str:
    """The run's closing line: the steps this job ran (`result`: trainer.py TrainResult) up to
    train.steps `steps`, their time and first and last loss, the last evaluation's, the run's skipped steps and
    rollbacks (train.on_nonfinite, as the metrics count them), and where what the run wrote is (`checkpoints`:
    the checkpoint directory, None when the run saves nothing; `draft_target`: a draft run's draft.target, which
    generate reads the draft beside)."""
    # (no losses: a resume of a finished run under torchrun directly; `longctx train` says so before building)
    if not result.losses:
        return f"done: nothing to train: the run is at step {result.first_step - 1} of train.steps {steps}."
    # a rollback of the last step (read_back.py): the run ends with checkpoint step `kept`'s weights, so the
    # losses and evaluations after it are of discarded updates
    kept = result.ended_at
    evals = [loss for s, loss in result.eval_losses.items() if kept is None or s <= kept]
    last_eval = f", eval loss {evals[-1]:.4f}" if evals else ""
    if kept is None:
        last = f"{result.losses[-1]:.4f}"
    elif kept >= result.first_step:
        last = f"{result.losses[kept - result.first_step]:.4f} (step {kept}'s: steps {kept + 1}-{steps} rolled back)"
    else:
        last = f"- (steps {kept + 1}-{steps} rolled back)"
    where = (_where_it_is(steps, run_dir, plots, checkpoints, draft_target) if kept is None else
             _where_it_is(kept, run_dir, plots, checkpoints, draft_target, f"the weights it ends with (step {kept}'s)"))
    return (f"done: steps {result.first_step}-{steps} in {total_s:.1f}s, loss {result.losses[0]:.4f} -> "
            f"{last}{last_eval}{_bad_steps(skipped, rollbacks)}. {where}")


def _bad_steps(skipped: int, rollbacks: int) -> str:
    """The done line's count of the run's bad steps: without it, a run whose every step was non-finite ended
    "done" with its untrained weights as "the last step's", the per-step lines long scrolled away."""
    said = ""
    if skipped:
        said += (f"; skipped {skipped} step{'s' if skipped != 1 else ''} (not applied: non-finite or a loss spike, "
                 f"train.on_nonfinite = skip)")
    if rollbacks:
        said += f"; rolled back {rollbacks} time{'s' if rollbacks != 1 else ''} (train.on_nonfinite = rollback)"
    return said


def _where_it_is(step: int, run_dir: Path, plots: bool, checkpoints: Path | None, draft_target: str = "",
                 what: str = "the last step's weights") -> str:
    """The done line's pointer to what the run wrote: its files, and the last step's checkpoint
    when one was saved (what `longctx generate --checkpoint` reads)."""
    files = "config, metrics and plots" if plots else "config and metrics"
    said = f"Its {files} are in {run_dir}/"
    if checkpoints is None:
        return f"{said} (nothing saved: checkpoint.interval 0 and checkpoint.final false)."
    saved = checkpoints / step_name(step)
    if not saved.is_dir():  # (a failed save under checkpoint.on_save_error = warn)
        return f"{said}."
    how = f"--checkpoint {draft_target} --draft {checkpoints}" if draft_target else f"--checkpoint {checkpoints}"
    return f"{said}; {what} in {saved}/ (`longctx generate {how}` reads them)."
