"""The progress phase of a generate run's prompts (progress.py): a log must not fall silent while they run.

A prompt's prefill runs in one call that says nothing until its first new token, and the prompts' lines
are written only when a batch is done (to a file or a pipe no tokens are streamed): a 32K-token prompt on
a CPU was a minute with no line. Under the phase, a line every LONGCTX_PROGRESS_S of quiet names the
prompts and counts the new tokens chosen so far (on rank 0 only, as every phase):

    ... generate: 1 prompt of 32,000 tokens [40s]: 0/16 new tokens (0%)
"""

from __future__ import annotations

from collections.abc import Callable

from ..progress import Phase, phase


def prompts_phase(prompts: list[dict], limits: list[int], samples: int):
    """The phase of generating `prompts` (each up to its limit of new tokens, `samples` times)."""
    tokens = sum(len(p["ids"]) for p in prompts)
    what = f"generate: {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} of {tokens:,} tokens"
    return phase(what, total=sum(limits) * samples, unit="new tokens", done_line=False)


def counting(on_token: Callable[[int, int], None] | None, progress: Phase) -> Callable[[int, int], None]:
    """`on_token` (or nothing) with each new token counted in `progress`."""
    def count(row: int, token: int) -> None:
        progress.update(1)
        if on_token is not None:
            on_token(row, token)
    return count
