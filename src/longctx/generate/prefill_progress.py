"""The progress phase of a long prompt's prefill (progress.py), on one device or sharded over head x ctx ranks.

A long prefill is minutes on a CPU (a 128K-token prompt: more), in calls that say nothing until the first new
token. Under a phase, rank 0 counts its prompt tokens and a line each LONGCTX_PROGRESS_S of quiet says them:

- one device (generate/local.py), in chunks: each chunk's tokens, layer by layer within it;
- sharded (generate/sharded.py): the whole prompt is one call, so the layers count it (each layer's end,
  its 1/layers of the prompt's tokens; progress.LayerCounts on the blocks).

The time left is timed by the model's FLOPs (models/flops.py layer_prefill_flops, the one formula), not by the
tokens' share: a chunk's tokens attend to every key before them, so the later chunks cost more (a count of
tokens alone promised a time left that each line pushed back: 32s left at 38% of a 32K prompt, 34s at 64%);
a sharded prefill's layers each run every position, so there a layer's share is its FLOPs' (a MoE layer's
and a dense one's differ).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

from ..models.flops import layer_prefill_flops, prefill_flops
from ..progress import LayerCounts, Phase, phase


def _prompts(rows: int, length: int) -> str:
    return f"{rows} prompt{'s' if rows != 1 else ''} of {length:,} tokens"


@contextmanager
def prefill_phase(rows: int, length: int, chunk: int, cfg=None):
    """The phase of a chunked prefill of `rows` x `length` tokens (a quiet one for a single chunk). With the
    model's `cfg`, its time left is timed by FLOPs: the count `done` stands for positions up to done / rows of
    each prompt, prefill_flops(cfg, done / rows) of its prefill_flops(cfg, length)."""
    if length <= chunk:
        yield Phase("")
        return
    what = f"prefill of {_prompts(rows, length)}, in chunks of {chunk:,}"
    with phase(what, total=rows * length, unit="prompt tokens", done_line=False) as progress:
        if cfg is not None:
            # (positions from 0: a cache already holding tokens, a draft's appended prompt, is rare and short)
            whole = prefill_flops(cfg, length)
            progress.weigh(lambda done: prefill_flops(cfg, done / rows) / whole)
        yield progress


@contextmanager
def sharded_prefill_phase(model, rows: int, length: int, chunk: int, head: int, ctx: int):
    """Count a sharded prefill of `rows` x `length` tokens, its one model call over head x ctx ranks, layer by
    layer in prompt tokens (each block's end: its share), in a phase when the prompt is longer than `chunk` (a
    prompt the one-device backend would prefill in more than one call; else nothing is said, as there). The
    time left timed by the layers' FLOPs (`layer_weights`). Yields the LayerCounts to begin and end the call."""
    cfg, layers = getattr(model, "cfg", None), getattr(model, "layers", None)
    if length <= (chunk if chunk > 0 else length) or layers is None:
        counts = LayerCounts(None, None)
        yield counts
        return
    what = f"prefill of {_prompts(rows, length)}, sharded over head {head} x ctx {ctx}"
    with phase(what, total=rows * length, unit="prompt tokens", done_line=False) as progress:
        if cfg is not None:
            progress.weigh(layer_weights(layer_prefill_flops(cfg, length), rows * length))
        counts = LayerCounts(layers, progress)
        try:
            yield counts
        finally:
            counts.close()


def layer_weights(flops: list[float], total: float):
    """Part (0..1) of the work that a count `done` of `total` stands for when each layer's end counts
    total / len(flops): the layers done so far by their FLOPs, the one running by its share of its own."""
    ends = [0.0, *itertools.accumulate(flops)]
    whole = ends[-1] or 1.0

    def part(done: float) -> float:
        at = min(max(done / total, 0.0), 1.0) * len(flops)
        i = min(int(at), len(flops) - 1)
        return (ends[i] + (at - i) * flops[i]) / whole
    return part
