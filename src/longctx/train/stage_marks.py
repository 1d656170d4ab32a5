"""Where each stage of a staged run (train.stages) begins, on `longctx report`'s plots: the loss moves with the
length trained, so a step axis without the stages' starts reads a jump as a fault."""

from __future__ import annotations

from ..config.rules import parse_stages
from ..errors import ConfigError


def stage_starts(spec: str | None, last_step: int) -> list[tuple[int, int, int]]:
    """(stage, first step, sequence length) of each stage after the first that began by `last_step`, from a run's
    train.stages `spec` ([] for a run of one stage, or a config without it)."""
    try:
        stages = parse_stages(spec) if spec else []
    except ConfigError:
        return []
    starts, first = [], 1
    for stage, (seq_len, steps, _) in enumerate(stages, 1):
        if stage > 1 and first <= last_step:
            starts.append((stage, first, seq_len))
        first += steps
    return starts


def mark_stages(ax, starts: list[tuple[int, int, int]]) -> None:
    """A dotted line where each stage begins, with its length: the loss moves with the length trained."""
    for i, (stage, first, seq_len) in enumerate(starts):
        ax.axvline(first - 0.5, color="0.45", linestyle=":", lw=1, label=None if i else "a stage begins (train.stages)")
        ax.text(first - 0.5, 0.98, f" {stage}: {seq_len:,}", transform=ax.get_xaxis_transform(), fontsize=7,
                va="top", color="0.3")
