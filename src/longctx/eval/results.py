"""The JSON result and progress lines that `longctx eval`'s two modes share: the result's head (task,
checkpoint, model, layout, data, tokenizer, dtype, rope), the routing note, what a heartbeat says of
the length being evaluated, and each length's one-line headline.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..progress import say

if TYPE_CHECKING:
    from .request import EvalRequest


def _result_head(request: EvalRequest, args, cfg, layout: dict, dtype) -> dict:
    """The JSON result before its rows: what was evaluated, on what, under which layout ("results" empty)."""
    rope = {f.name.removeprefix("rope_"): getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)
            if f.name.startswith("rope_")}  # (theta, scaling, factor, ..., the Ms-PoE settings)
    out = {"task": request.task, "mode": request.mode, "checkpoint": args.checkpoint, "model": cfg.model.label,
           "layout": layout, "data": request.source, "tokenizer": request.tokenizer,
           "dtype": str(dtype).removeprefix("torch."), "rope": rope, "results": []}
    if request.routing:  # (a capacity scored dropless: eval/request.py dropless)
        out["routing"] = request.routing
    return out


def _note_routing(out: dict, model, main_rank: bool) -> None:
    """How the model routes where that depends on its step (a DTS-Gate checkpoint: as training did at
    its step), in the JSON and said once."""
    from ..models.moe import eval_routing_note

    note = eval_routing_note(model)
    if note:
        out["routing"] = note
        if main_rank:
            say(f"eval: {note}")


def _length_phase(request: EvalRequest, i: int) -> str:
    """'4,096 tokens (length 1 of 2)': what a heartbeat line says of the length being evaluated."""
    n = len(request.lengths)
    return f"{request.lengths[i]:,} tokens" + (f" (length {i + 1} of {n})" if n > 1 else "")


def _headline(results: list[dict], length: int) -> str:
    mine = [r for r in results if r["length"] == length]
    if "loss" in mine[0]:
        return f"loss {mine[0]['loss']:.4f} over {mine[0]['tokens']:,} tokens"
    correct, n = sum(r["correct"] for r in mine), sum(r["samples"] for r in mine)
    return f"{correct}/{n} correct ({100 * correct / n:.0f}%)"
