"""PNG plots of a run from its metrics JSONL: loss (train and eval) and throughput (tokens/s, MFU)."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .metrics import read_jsonl


def write_plots(run_dir: str | Path, metrics_path: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = Path(metrics_path) if metrics_path else run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{metrics_path} does not exist; pass the run directory a `longctx train` run wrote.")
    records = read_jsonl(metrics_path)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
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

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["tokens_per_s"] for r in train], color="tab:blue", marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s", color="tab:blue")
    mfu = [(r["step"], r["mfu"]) for r in train if r.get("mfu") is not None]
    if mfu:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in mfu], [100 * m for _, m in mfu], color="tab:orange", marker=".")
        ax2.set_ylabel("MFU (%)", color="tab:orange")
    ax.set_title(f"throughput - {run_dir.name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tput_png = run_dir / "throughput.png"
    fig.savefig(tput_png, dpi=100)
    plt.close(fig)
    return [loss_png, tput_png]
