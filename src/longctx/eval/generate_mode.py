"""`longctx eval --mode generate` (passkey/needle): the model answers. Each prompt (the sequence up to its
answer) is continued greedily, or sampled with `longctx generate`'s flags, with the KV cache
(generate/engine.py), on one process or sharded over head x ctx ranks (generate/sharded.py), or through
InfLLM's context memory (--context-memory infllm: generate/context_memory.py; sharded over ctx ranks
with --nproc N, generate/sharded_infllm.py); right
when the first run of digits it writes is the answer. Sampled draws are seeded per sequence from --seed and
what the sequence is (its length, depth and sample number: `sequence_seed`), never from its place in the
run. The answer is read from the generated tokens up to the first one that decodes to nothing (a special
token such as BOS, or an id past the tokenizer's vocabulary: `answer_text`), as score mode, which
wants every answer token, would count a key such a token interrupts as a miss.

The special-token prefix. `longctx generate` puts before a prompt's text the special tokens the model's
training documents began with (generate/prompts.py): for hf:DIR, the tokenizer's own (e.g. BOS, as
transformers does); for a longctx checkpoint, those its manifest records (data/builder/tokenize.py).
Eval's sequences are built without them (data/synthetic.py), so both modes give the model that prefix
first (config/tokenizer.py `model_text_prefix`; `special_prefix` in the JSON): generate mode before
each prompt, score mode in place of each sequence's last token, which is only ever a label
(`with_prefix`), so a sequence stays `length` tokens and the context before the answer is the same in
both modes. None for a tokenizer that adds none, a checkpoint trained
before documents carried one, or the byte tokenizer.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.checkpoint_paths import step_read
from ..config.tokenizer import model_text_prefix
from ..progress import say
from .defaults import EXTRA_NEW_TOKENS
from .generate_count import SequenceCount
from .results import _headline, _length_phase, _note_routing, _result_head, announce_task

if TYPE_CHECKING:
    from .request import EvalRequest
    from .tasks import Sequence

TEXT_CHARS = 80         # generate mode: each sample's generated text in the JSON, at most this many characters


def answer_start(seq: Sequence) -> int:
    """Where the answer's tokens begin: one past the first scored position (labels[i] is tokens[i + 1])."""
    import numpy as np

    from ..data.samples import IGNORE

    return int(np.flatnonzero(seq.labels != IGNORE)[0]) + 1


def with_prefix(seq: Sequence, prefix: list[int]) -> Sequence:
    """`seq` read after `prefix`, still seq.length tokens: the prefix, then its tokens but the last
    len(prefix), whose labels must be unscored (the last token is only ever a label: labels[i] is
    tokens[i + 1]; the answer's last token stays the label of the last position)."""
    import dataclasses

    import numpy as np

    from ..data.samples import IGNORE
    from ..errors import DataError

    k = len(prefix)
    if not k:
        return seq
    if (seq.labels[len(seq.labels) - k:] != IGNORE).any():
        raise DataError(f"the tokenizer puts {k} special tokens ({prefix}) before a text, as `longctx generate` "
                        f"gives it to this model; --mode score keeps a sequence at its length by reading one such "
                        f"token in place of its last token (only ever a label), and has room for no more without "
                        f"leaving answer tokens unscored. Use --mode generate, which prompts with them all.")
    tokens = np.concatenate([np.asarray(prefix, dtype=seq.tokens.dtype), seq.tokens[:-k]])
    labels = np.concatenate([np.full(k, IGNORE, dtype=seq.labels.dtype), seq.labels[:-k]])
    return dataclasses.replace(seq, tokens=tokens, labels=labels)


def parse_answer(text: str) -> str:
    """The answer a generation gives: its first run of digits ('' when it has none)."""
    found = re.search(r"[0-9]+", text)
    return found.group() if found else ""


def answer_text(tokenizer, ids, vanishing: dict | None = None) -> str:
    """The text a generation's answer is read from: its tokens decoded up to the first that decodes to
    nothing. Decoding drops such a token (the byte tokenizer's BOS or an id past its 256 bytes, a
    Hugging Face tokenizer's special tokens or an id past its vocabulary) and would join the text on
    either side: ' 714' <BOS> '32.' must not read as the key 71432. `vanishing`: a cache by id."""
    ids = [int(t) for t in ids]
    cut = next((i for i, t in enumerate(ids) if _vanishes(tokenizer, t, vanishing)), len(ids))
    return tokenizer.decode(ids[:cut])


def _vanishes(tokenizer, token: int, cache: dict | None) -> bool:
    """Whether `token` decodes to nothing: between two copies of a visible text it adds no character.
    (Alone is not enough: a SentencePiece-style decoder strips the text's first space, so a bare '▁'
    decodes to '' at the start of a text, yet is a space in it.)"""
    if cache is not None and token in cache:
        return cache[token]
    from ..data.tokenizer import PROBE

    probe = [int(t) for t in tokenizer.encode_batch([PROBE])[0]]
    out = tokenizer.decode(probe + [token] + probe) == tokenizer.decode(probe + probe)
    if cache is not None:
        cache[token] = out
    return out


def sequence_seed(seed: int, seq: Sequence) -> int:
    """Sequence `seq`'s sampling seed: from --seed and what the sequence is (its length, its depth's
    value, its sample number), so its draws are the same whatever else the run evaluates (other
    lengths or depths) and whatever --batch groups it with."""
    from ..generate.sampling import derive_seed
    from .tasks import depth_key

    return derive_seed(derive_seed(derive_seed(seed, seq.length), depth_key(seq.depth or 0.0)), seq.sample)


def evaluate_generate(request: EvalRequest, args) -> dict | None:
    """--mode generate: each prompt (the sequence up to its answer) continued greedily by the answer's
    length + EXTRA_NEW_TOKENS tokens, on one device or sharded over head x ctx (every rank the same
    tokens); right when the first run of digits generated is the answer. The result on rank 0."""
    from ..job.launch import end_one_rank_group, finish_distributed

    try:
        results = generate_tasks([request], [args])
    except BaseException:
        end_one_rank_group()  # (no barrier: a peer of a rank that failed alone waits in a decode collective)
        raise
    finish_distributed()
    return results[0] if results is not None else None


def generate_tasks(requests: list[EvalRequest], args_list: list) -> list[dict] | None:
    """evaluate_generate for each request (one per task, eval/task_list.py; the same model config) on one
    model loaded once; each task's result, on rank 0, as that task alone gives it. The process groups
    are left joined (the caller ends them)."""
    from ..data.tokenizer import load_tokenizer
    from ..generate.loading import backend_for as _backend
    from ..generate.loading import load_model
    from ..job.devices import resolve_dtype
    from ..progress import phase

    cfg, checkpoint = requests[0].cfg, args_list[0].checkpoint
    for request in requests:  # (every task's window checked before the weights are read)
        _check_window(request, len(model_text_prefix(cfg.model.init_from, load_tokenizer(request.tokenizer))))
    backend, device, main_rank = _eval_backend(requests[0], _backend)
    dtype = resolve_dtype(cfg.train.dtype, device)
    with phase(f"eval: loading the model from {checkpoint}{step_read(checkpoint)}"):
        model = load_model(cfg, device, dtype)
    loaded = GeneratingModel(model, backend, device, dtype, main_rank)
    # (the routing note said with the first task only: the same model's)
    outs = [_generate_task(request, args, loaded, say_routing=i == 0)
            for i, (request, args) in enumerate(zip(requests, args_list))]
    return outs if main_rank else None


@dataclass
class GeneratingModel:
    """What every task of a run generates with: the model loaded once and this rank's backend."""
    model: object
    backend: object
    device: object
    dtype: object
    main_rank: bool


def _generate_task(request: EvalRequest, args, loaded: GeneratingModel, say_routing: bool = True) -> dict:
    """One task's result (on every rank; kept by rank 0) from the model `loaded` holds."""
    from ..data.tokenizer import load_tokenizer
    from ..generate.loading import eos_ids
    from ..progress import phase, progress_bar, said

    cfg, main_rank = request.cfg, loaded.main_rank
    log = say if main_rank else (lambda *_: None)
    announce_task(request, log)
    tokenizer = load_tokenizer(request.tokenizer)
    prefix = model_text_prefix(cfg.model.init_from, tokenizer)
    eos = eos_ids(cfg.model.init_from, tokenizer)
    p = cfg.parallel
    layout = {"world": p.head * p.ctx, "dp_replicate": 1, "dp_shard": 1, "head": p.head, "ctx": p.ctx}
    out = _result_head(request, args, cfg, layout, loaded.dtype)
    _note_routing(out, loaded.model, main_rank and say_routing)
    if main_rank:  # (what a run stopped part-way keeps: eval/stopped.py)
        request.result = out
    if prefix:
        out["special_prefix"] = prefix
    if request.memory is not None:
        out["context_memory"] = {"method": "infllm", **vars(request.memory)}
    if request.sampling is not None:
        out["sampling"] = {k: v for k, v in vars(request.sampling).items() if k not in ("seed", "min_new_tokens")}
    total = sum(request.sequences.counts.values())
    bar = progress_bar(total, f"eval {request.task} (generate)", "seq", main_rank)
    start_all = time.perf_counter()
    try:
        with phase(f"eval {request.task} (generate)", done_line=False):
            for which, length in enumerate(request.lengths):
                seqs = request.sequences[length]  # (built now, dropped below: one length's held at a time)
                t0 = time.perf_counter()
                texts = []
                what = _length_phase(request, which)
                with phase(what, len(seqs), "sequences", done_line=False, bar=bar) as progress:
                    # (counted inside each batch too: its prefill's share, then its new tokens; generate_count.py)
                    count = SequenceCount(progress, getattr(loaded.model, "cfg", None))
                    for start in range(0, len(seqs), request.batch):
                        group = seqs[start:start + request.batch]
                        texts += _generate_answers(loaded.model, tokenizer, group, request.sampling, args.seed,
                                                   prefix, count=count, eos_ids=eos, device=loaded.device,
                                                   backend=loaded.backend)
                out["results"].extend(_summarise_generated(request, length, seqs, texts, time.perf_counter() - t0))
                del seqs
                if bar is None:
                    log(f"eval: {request.task} (generate) at {length} tokens: {_headline(out['results'], length)}")
                    said()
    finally:
        if bar is not None:
            bar.close()
    out["seconds"] = round(time.perf_counter() - start_all, 2)
    done = out["results"]
    out["accuracy"] = sum(r["correct"] for r in done) / max(1, sum(r["samples"] for r in done))
    return out


def _check_window(request: EvalRequest, prefix: int) -> None:
    """The decode loop's sliding-window rule (generate/loading.py check_window) before any work: each
    sequence's prompt and new tokens take prefix + its length + EXTRA_NEW_TOKENS positions (InfLLM's memory:
    at most its farthest distance + 1), which must lie within the window of a windowed model's weights."""
    from ..generate.loading import check_window, init_window

    longest = max(request.lengths)
    need = prefix + longest + EXTRA_NEW_TOKENS
    if request.memory is not None:
        need = min(need, request.memory.positions_needed)
    fit = init_window(request.cfg.model.init_from) - EXTRA_NEW_TOKENS - prefix
    check_window(request.cfg.model, need, f"eval --mode generate at length {longest:,} ({prefix} special tokens "
                                          f"before it, {EXTRA_NEW_TOKENS} new tokens past its answer; --lengths up "
                                          f"to {fit:,} fit)")


def _eval_backend(request: EvalRequest, layout_backend):
    """(backend, device, main rank): the layout's (one device or sharded), or with --context-memory
    infllm the memory's on it (one device, or sharded over ctx ranks: generate/context_memory.py)."""
    backend, device, main_rank = layout_backend(request.cfg)
    if request.memory is not None:
        from ..generate.context_memory import memory_backend

        backend = memory_backend(request.memory, backend)
    return backend, device, main_rank


def _generate_answers(model, tokenizer, group: list[Sequence], sampling, seed: int,
                      prefix: list[int] | tuple = (), count: SequenceCount | None = None, **engine) -> list[str]:
    """One batch of prompts (each sequence up to its answer, after `prefix`: model_text_prefix) continued by
    the answer's length + EXTRA_NEW_TOKENS tokens, greedily unless `sampling` says otherwise, each
    sequence's draws seeded by `sequence_seed`; the texts the answers are read from (`answer_text`).
    `count`: the length's count, moved as the batch runs and whole at its end. `engine`: generate()'s
    eos_ids, device, backend."""
    from ..generate.engine import GREEDY, generate

    cuts = [answer_start(q) for q in group]
    prompts = [list(prefix) + q.tokens[:c].tolist() for q, c in zip(group, cuts)]
    limits = [q.length - c + EXTRA_NEW_TOKENS for q, c in zip(group, cuts)]
    if count is not None:
        count.begin([len(p) for p in prompts], limits)
        engine["on_token"] = count.on_token
    results = generate(model, prompts, max_new_tokens=limits, sampling=sampling or GREEDY,
                       seeds=[sequence_seed(seed, q) for q in group], **engine)
    if count is not None:
        count.end(results)
    vanishing: dict[int, bool] = {}
    return [answer_text(tokenizer, r.tokens, vanishing) for r in results]


def _summarise_generated(request: EvalRequest, length: int, seqs: list[Sequence], texts: list[str],
                         seconds: float) -> list[dict]:
    results = []
    for depth in request.depths:
        idx = [i for i, q in enumerate(seqs) if q.depth == depth]
        correct = [parse_answer(texts[i]) == seqs[i].answer for i in idx]
        results.append({"length": length, "depth": depth, "samples": len(idx), "correct": sum(correct),
                        "accuracy": sum(correct) / len(idx), "per_sample": correct,
                        "answers": [seqs[i].answer for i in idx],
                        "generated": [texts[i][:TEXT_CHARS] for i in idx],
                        "seconds": round(seconds / len(request.depths), 2)})
    return results
