"""PNG plots of an eval result: loss vs position (ppl), the depth x length accuracy heatmap (retrieval)."""

from __future__ import annotations

import math
from pathlib import Path

from ..train.report import token_log_axis


def write_plot(result: dict, path: str | Path) -> Path:
    import matplotlib  # (lazy: ~100 MB and a second to load, only when a plot is written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"{result['task']} - {result['model']}"
    if result["task"] == "ppl":
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for r in result["results"]:
            # (a NaN or infinite loss, a diverged model's, is no point: a gap, as the JSON's null)
            kept = [b for b in r["buckets"] if b["loss"] is not None and math.isfinite(b["loss"])]
            xs = [(b["start"] + b["end"]) / 2 for b in kept]
            ys = [b["loss"] for b in kept]
            drawn = drawn or bool(xs)
            ax.plot(xs, ys, marker=".", label=f"{r['length']:,} tokens ({r['sequences']} seq)")
        if drawn:  # (no finite loss at all: the axis has no data to place ticks by)
            token_log_axis(ax)  # (powers of 2 labelled 1K / 64K / 1M, never overlapping)
        else:
            ax.text(0.5, 0.5, "no finite loss", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("position in the sequence (tokens)")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
    else:
        lengths = sorted({r["length"] for r in result["results"]})
        depths = sorted({r["depth"] for r in result["results"]})
        # (a cell not run, or a null accuracy a JSON read back holds, is NaN: drawn blank, labelled '-', never 0%)
        acc = {(r["length"], r["depth"]): _number(r["accuracy"]) for r in result["results"]}
        grid = [[acc.get((length, d), math.nan) for length in lengths] for d in depths]
        fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * len(depths) + 2))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("depth")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, cell_label(v), ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, label="exact-match accuracy")
        title += f" - {100 * result['accuracy']:.0f}% overall"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cell_label(accuracy: float) -> str:
    """A heatmap cell's text: its accuracy in percent, '-' where it has none (a cell not run: not 'nan')."""
    return f"{100 * accuracy:.0f}" if math.isfinite(accuracy) else "-"


def _number(value) -> float:
    """An accuracy as a float (None, as a JSON's null, is NaN)."""
    return math.nan if value is None else float(value)
