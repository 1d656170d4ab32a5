"""The JSON result and progress lines that `longctx eval`'s two modes share: the result's head (task,
checkpoint, model (costs/model_states.py model_said), layout, data, tokenizer, dtype, rope), the routing note, what
a heartbeat says of the length being evaluated, and each length's one-line headline.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..config.hf_export import ROPE_SCALING_READS
from ..progress import say

if TYPE_CHECKING:
    from .request import EvalRequest


def rope_record(m) -> dict:
    """What positions the model evaluated with: theta, the scaling and the settings it reads, and Ms-PoE (its
    settings when on), never a setting the model does not read (a factor of 8 beside scaling none)."""
    given = {f.name.removeprefix("rope_"): getattr(m, f.name) for f in dataclasses.fields(m)
             if f.name.startswith("rope_")}
    read = {"theta", "scaling", "ms_poe", *ROPE_SCALING_READS[m.rope_scaling]}
    return {k: v for k, v in given.items() if k in read or (m.rope_ms_poe and k.startswith("ms_poe_"))}


def _result_head(request: EvalRequest, args, cfg, layout: dict, dtype) -> dict:
    """The JSON result before its rows: what was evaluated, on what, under which layout ("results" empty)."""
    from ..costs.model_states import model_said

    rope = rope_record(cfg.model)
    out = {"task": request.task, "mode": request.mode, "checkpoint": args.checkpoint,
           "model": model_said(cfg.model, args.checkpoint),  # (as generate names it)
           "layout": layout, "data": request.source, "tokenizer": request.tokenizer,
           "dtype": str(dtype).removeprefix("torch."), "rope": rope, "seed": args.seed, "results": []}
    if request.task != "ppl":  # (what a retrieval result is reproduced from: the depths asked, with seed and lengths)
        out["depths"] = list(request.depths)
    if request.notes:  # (said before work on stdout; kept with the figures: a length past the model's reach)
        out["notes"] = list(request.notes)
    if request.routing:  # (a capacity scored dropless: eval/request.py dropless)
        out["routing"] = request.routing
    return out


def _note_routing(out: dict, model, main_rank: bool) -> None:
    """How the model routes where that depends on its step (a DTS-Gate checkpoint: as training did at
    its step), in the JSON and said once."""
    from ..models.moe_eval_routing import eval_routing_note

    note = eval_routing_note(model)
    if note:
        out["routing"] = note
        if main_rank:
            say(f"eval: {note}")


def announce_task(request: EvalRequest, log) -> None:
    """In a run of several tasks, the line that says which one starts (mode and lengths: what it will do)."""
    if request.place:
        log(f"eval: {request.place}: {request.task} (--mode {request.mode}) at "
            f"{', '.join(f'{n:,}' for n in request.lengths)} tokens")


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
