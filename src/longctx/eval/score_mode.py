"""`longctx eval --mode score` (the default): every length's sequences scored in teacher-forced forward
passes (eval/runner.py) on this rank's part of the layout, summarised per position bucket (ppl) or per
depth (passkey/needle: right when every answer token is the argmax). Passkey/needle sequences are read
after the special tokens `longctx generate` would put before their text (hf:DIR's BOS, say), as
generate mode's prompts are, each still `length` tokens (generate_mode.py, model_text_prefix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.checkpoint_paths import step_read
from ..progress import phase, say
from .results import _headline, _length_phase, _note_routing, _result_head, announce_task

if TYPE_CHECKING:
    from .request import EvalRequest
    from .tasks import Sequence


def evaluate_score(request: EvalRequest, args) -> dict | None:
    """Score every length's sequences on this rank's part of the layout; the result on rank 0."""
    from ..job.launch import finish_distributed

    results = score_tasks([request], [args])
    finish_distributed()
    return results[0] if results is not None else None


def score_tasks(requests: list[EvalRequest], args_list: list) -> list[dict] | None:
    """Each request (one per task, eval/task_list.py; the same model config) scored on one model built
    once; each task's result, on rank 0, as that task alone gives it. The process groups are left joined
    (the caller ends them: a run of several tasks may go on to generate on the same ones)."""
    from ..job.launch import end_one_rank_group

    try:
        return _score_tasks(requests, args_list)
    except BaseException:
        end_one_rank_group()  # (memory.model_states = host at world 1 made it)
        raise


def _score_tasks(requests: list[EvalRequest], args_list: list) -> list[dict] | None:
    from ..job.devices import resolve_dtype
    from ..job.join import join_job
    from ..train.model import build_training_model, resolve_offload

    cfg, checkpoint = requests[0].cfg, args_list[0].checkpoint
    rt, device = join_job(cfg)
    if cfg.train.compile:  # (before the weights are read: models/compile.py)
        from ..models.compile import check_compiler

        check_compiler(device.type)
    log = say if rt.is_main else (lambda *_: None)
    dtype = resolve_dtype(cfg.train.dtype, device)
    with phase(f"eval: building the model from {checkpoint}{step_read(checkpoint)}"):
        cfg = resolve_offload(cfg, device, rt, log)
        model = build_training_model(cfg, device, rt, log)
    model.eval()
    layout = {"world": rt.world, **{k: getattr(rt.dims, k) for k in ("dp_replicate", "dp_shard", "head", "ctx")}}
    if rt.dims.expert > 1:  # (folded over the same ranks: the degrees above do not show it)
        layout["expert"] = rt.dims.expert
    scored = ScoringModel(model, rt, device, dtype, cfg, layout)
    # (the routing note said with the first task only: the same model's)
    outs = [_score_task(request, args, scored, say_routing=i == 0)
            for i, (request, args) in enumerate(zip(requests, args_list))]
    return outs if rt.is_main else None


@dataclass
class ScoringModel:
    """What every task of a run scores with: the model built once, this rank's place and its layout."""
    model: object
    rt: object
    device: object
    dtype: object
    cfg: object  # (offload resolved: what the result's head records)
    layout: dict


def _score_task(request: EvalRequest, args, scored: ScoringModel, say_routing: bool = True) -> dict:
    """One task's result (on every rank; kept by rank 0) from the model `scored` holds."""
    import torch

    from ..progress import progress_bar, said
    from .runner import score

    rt, dtype = scored.rt, scored.dtype
    announce_task(request, say if rt.is_main else (lambda *_: None))
    prefix = _prefix(request)
    out = _result_head(request, args, scored.cfg, dict(scored.layout), dtype)
    _note_routing(out, scored.model, rt.is_main and say_routing)
    if rt.is_main:  # (what a run stopped part-way keeps: eval/stopped.py)
        request.result = out
    if prefix:
        out["special_prefix"] = prefix
    total = sum(request.sequences.counts.values())
    bar = progress_bar(total, f"eval {request.task}", "seq", rt.is_main)
    start_all = time.perf_counter()
    try:
        with phase(f"eval {request.task}", done_line=False):
            for which, length in enumerate(request.lengths):
                seqs = _prefixed(request, length, prefix)  # (built now, dropped below)
                buckets = min(args.buckets, length)  # (a bucket holds one position at least)
                t0 = time.perf_counter()
                # (each length's own line follows it: no closing line from the phase)
                with phase(_length_phase(request, which), len(seqs), "sequences", done_line=False, bar=bar) as progress:
                    scores = score(scored.model, rt, seqs, request.batch, buckets, scored.device,
                                   dtype if dtype != torch.float32 else None, progress)
                out["results"].extend(_summarise(request, length, seqs, scores, buckets, time.perf_counter() - t0))
                del seqs  # (before the next length's are built: one length's held at a time)
                if rt.is_main and bar is None:
                    say(f"eval: {request.task} at {length} tokens: {_headline(out['results'], length)}")
                    said()
    finally:
        if bar is not None:
            bar.close()
    out["seconds"] = round(time.perf_counter() - start_all, 2)
    if request.task != "ppl":
        done = out["results"]
        out["accuracy"] = sum(r["correct"] for r in done) / max(1, sum(r["samples"] for r in done))
    return out


def _prefixed(request: EvalRequest, length: int, prefix: list[int]) -> list[Sequence]:
    """`length`'s sequences as the model reads them (built now: request.sequences builds a length when asked)."""
    from .generate_mode import with_prefix

    return [with_prefix(q, prefix) for q in request.sequences[length]]


def _prefix(request: EvalRequest) -> list[int]:
    """The special-token prefix each sequence is read after (`with_prefix`): passkey/needle ones after the
    prefix `longctx generate` gives a text (generate_mode.py); ppl's spans of documents as they are (a span
    starts mid-document, where no BOS stands): none."""
    if request.task == "ppl":
        return []
    from ..config.tokenizer import model_text_prefix
    from ..data.tokenizer import load_tokenizer

    return model_text_prefix(request.cfg.model.init_from, load_tokenizer(request.tokenizer))


def _summarise(request: EvalRequest, length: int, seqs: list[Sequence], s: dict, buckets: int,
               seconds: float) -> list[dict]:
    if request.task == "ppl":
        # position p is in bucket p * buckets // length: bucket i holds [ceil(i L / B), ceil((i + 1) L / B))
        rows = [{"start": -(-i * length // buckets), "end": -(-(i + 1) * length // buckets),
                 "loss": s["nll_sum"][i] / s["tokens"][i] if s["tokens"][i] else None, "tokens": int(s["tokens"][i])}
                for i in range(buckets)]
        total = sum(s["tokens"])
        return [{"length": length, "sequences": len(seqs), "loss": sum(s["nll_sum"]) / max(total, 1),
                 "tokens": int(total), "buckets": rows, "seconds": round(seconds, 2)}]
    results = []
    for depth in request.depths:
        idx = [i for i, q in enumerate(seqs) if q.depth == depth]
        correct = [s["misses"][i] == 0 for i in idx]
        results.append({"length": length, "depth": depth, "samples": len(idx), "correct": sum(correct),
                        "accuracy": sum(correct) / len(idx),
                        "answer_nll": sum(s["nll"][i] for i in idx) / max(1.0, sum(s["scored"][i] for i in idx)),
                        "per_sample": correct, "seconds": round(seconds / len(request.depths), 2)})
    return results
