"""PNG plots of a run from its metrics JSONL: loss (train and eval), and throughput (tokens/s with its
MFU scale) over memory."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
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
    return [loss_png, tput_png]


def _last_per_step(records) -> list[dict]:
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
