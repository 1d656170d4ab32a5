"""PNG plots of a run from its metrics JSONL: loss (train and eval), throughput (tokens/s with its
MFU scale) over memory, and for MoE models the expert load and router losses (expert_load.png) and
each expert's share of its layer's choices over the steps (expert_heatmap.png)."""

from __future__ import annotations

from pathlib import Path

from ..config.rules import moe_notes
from ..errors import UserError
from ..models.llama import count_params
from .metrics import read_jsonl


def write_plots(run_dir: str | Path, metrics_path: str | Path | None = None) -> list[Path]:
    import matplotlib  # (lazy: ~100 MB and a second to load, only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = Path(metrics_path) if metrics_path else run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{metrics_path} does not exist; pass the run directory a `longctx train` run wrote.")
    records = read_jsonl(metrics_path)
    # the newest record of each step (a run resumed by an older longctx repeated steps)
    train = _last_per_step(r for r in records if r.get("kind", "train") == "train")
    evals = _last_per_step(r for r in records if r.get("kind") == "eval")
    if not train:
        raise UserError(f"{metrics_path} holds no training records to plot.")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", marker=".")
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], label="eval", marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss - {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
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


def _expert_load_plot(run_dir: Path, records: list[dict], plt) -> Path:
    """MoE runs: max/mean tokens per expert (mean over MoE layers and the worst layer; 1 = even),
    the busiest expert-parallel rank's load, and the balancing losses."""
    fig, (load_ax, loss_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = [r["step"] for r in records]
    load_ax.plot(steps, [r["moe_load_mean"] for r in records], marker=".", label="max/mean per expert (mean layer)")
    load_ax.plot(steps, [r["moe_load_worst"] for r in records], marker=".", label="max/mean per expert (worst layer)")
    if any("expert_rank_load" in r for r in records):
        load_ax.plot(steps, [r.get("expert_rank_load", float("nan")) for r in records], marker=".",
                     label="busiest expert-parallel rank / mean")
    load_ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    load_ax.set_ylabel("expert load")
    load_ax.set_title(f"expert load - {run_dir.name}")
    load_ax.grid(alpha=0.3)
    load_ax.legend(fontsize=8)
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
            else f"{layers} MoE layers")
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


def _last_per_step(records) -> list[dict]:
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def describe_run(cfg, world: int, dims, model, device, dtype, peak: str) -> list[str]:
    """The run's opening line: the model, its precision and memory policy, the layout."""
    mem = cfg.memory
    layout = (f"{world} ranks: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x head {dims.head} x ctx "
              f"{dims.ctx}" + (f" (window {dims.window})" if dims.window else "") + f", {dims.placement}"
              if world > 1 else "1 process")
    return [f"model: {cfg.model.label}, {count_params(model) / 1e6:.2f}M parameters, "
            f"{device.type} {str(dtype).removeprefix('torch.')}, memory: recompute={mem.recompute}"
            + (f" offload={mem.offload_fraction} skip_last={mem.offload_skip_last}" if mem.offload_fraction else "")
            + f", loss_chunk={mem.loss_chunk}, {layout}; {peak}"] + (
        [model.grad_bucket_plan.describe()] if hasattr(model, "grad_bucket_plan") else []) + [
        f"note: {note}" for note in (moe_notes(cfg.model) if not cfg.draft.target else [])]
