"""`longctx eval`: loss by position (ppl), pass-key and multi-key needle retrieval, under any layout.

    longctx eval --checkpoint runs/X/checkpoints --task passkey --lengths 1K,4K --depths 0,0.5,1
    longctx eval --checkpoint hf:DIR --task ppl --lengths 16K,32K --nproc 4 --parallel.ctx 4
    longctx eval --checkpoint runs/X/checkpoints --task passkey --lengths 4K --mode generate --nproc 4

--mode score (the default) scores the answer in one teacher-forced forward pass (right when every
answer token is the argmax); --mode generate (passkey/needle) lets the model answer: free greedy
generation (or sampled: --temperature, --top-k, --top-p, --min-p and the penalties of `longctx
generate`, each sequence seeded from --seed and its index) from the question with the KV cache
(generate/engine.py), right when the first run of digits it writes is the key. Generation runs on
one process or sharded over head x ctx ranks (generate/sharded.py, every rank the full weights),
so its layout has no data parallelism.

Everything that can be wrong with the input (task, lengths the layout cannot split, depths, a
missing tokenizer, a too-short text) is found before any rank starts: the launching process
prepares the sequences once, and every rank prepares the same ones again (cheap, deterministic).
The JSON result goes to stdout or --output; plots next to --output (or to --plot).

The imports inside functions are on purpose: `longctx` builds this command's parser for every
command, and what eval runs loads torch, which `longctx data build` must not.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import threads
from ..config.rules import SYNTHETIC_TASKS
from ..config.tokenizer import model_tokenizer, same_tokenizer
from ..errors import ConfigError, DataError
from ..generate.settings import SAMPLING_FLAGS, add_sampling_flags
from ..progress import say

if TYPE_CHECKING:
    from .tasks import Sequence

# eval/tasks.py is imported only when a command runs: building the CLI's parser must not import
# it (and torch with it), or every `longctx` command, `data build` included, pays ~220 MB for it
TASKS = ("ppl", *SYNTHETIC_TASKS)

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
MODES = ("score", "generate")
EXTRA_NEW_TOKENS = 8    # generate mode: new tokens past the answer's length (room for a wrong or longer answer)
TEXT_CHARS = 80         # generate mode: each sample's generated text in the JSON, at most this many characters


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint at long lengths: loss by position, passkey, needle "
                                    "(forward only, under any layout)", allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, metavar="DIR|hf:DIR",
                   help="a longctx checkpoint (a step-* directory, or a checkpoints directory for its latest) or "
                        "hf:DIR, a Hugging Face model directory")
    p.add_argument("--task", required=True, choices=TASKS,
                   help="ppl: loss per position bucket; passkey: a 5-digit key hidden at each depth; needle: "
                        "several keyed 7-digit numbers hidden, one asked for")
    p.add_argument("--lengths", required=True, help="sequence lengths in tokens, e.g. 1K,4K,16K (K = 1024)")
    p.add_argument("--depths", default=DEFAULT_DEPTHS,
                   help=f"passkey/needle: where the needle sits, fractions of the filler (default {DEFAULT_DEPTHS})")
    p.add_argument("--samples", type=int, default=0,
                   help="sequences per length (ppl, default 8) or per length and depth (passkey/needle, default 5)")
    p.add_argument("--data", default="",
                   help="text to evaluate on (ppl) and take filler from (passkey/needle): a store directory, a "
                        "text file, or '' for the default corpus (data.corpus, stdlib)")
    p.add_argument("--split", default="eval", choices=("eval", "train"), help="the store split to use (default eval)")
    p.add_argument("--tokenizer", default="",
                   help="'byte' or PATH/tokenizer.json; default: the checkpoint's (its manifest, or hf:DIR's "
                        "tokenizer.json)")
    p.add_argument("--buckets", type=int, default=16, help="ppl: position buckets per length (default 16)")
    p.add_argument("--mode", default="score", choices=MODES,
                   help="passkey/needle: score (default): one teacher-forced forward pass, right when every answer "
                        "token is the argmax; generate: free greedy generation from the question, right when the "
                        "first run of digits generated is the answer (one process, or --nproc = --parallel.head x "
                        "--parallel.ctx: the cache sharded, no data parallelism)")
    # --mode generate decodes greedily unless these say otherwise (generate/settings.py; no generation_config.json
    # defaults: a benchmark stays greedy); its draws are seeded per sequence from --seed and the sequence's index
    add_sampling_flags(p.add_argument_group("--mode generate sampling (default greedy, as longctx generate's flags)"))
    p.add_argument("--batch", type=int, default=0, help="sequences per forward (score) or prompts generated together "
                                                       "(generate) over the whole job (default: one per "
                                                       "data-parallel rank)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for keys and filler offsets, and with --mode generate's sampling flags of each "
                        "sequence's draws (from it and the sequence's index)")
    p.add_argument("--output", default="", help="write the JSON here (and the plot next to it) instead of stdout")
    p.add_argument("--plot", default="", help="the PNG to write (default: --output with .png)")
    p.add_argument("--nproc", type=int, default=1, help="local processes through torchrun (default 1)")
    p.add_argument("--threads", type=int, default=None, help=threads.HELP)
    p.set_defaults(func=main)


@dataclass
class Plan:
    """What one eval computes, prepared identically in the launcher and on every rank."""
    cfg: object
    task: str
    lengths: list[int]
    depths: list[float]
    sequences: dict[int, list[Sequence]]
    source: str
    tokenizer: str
    batch: int
    mode: str = "score"
    sampling: object = None  # --mode generate: generate/sampling.py's Sampling (None: greedy)
    notes: tuple = ()        # said once before work (lengths past the model's reach)


def _config(args, overrides: list[str], lengths: list[int], nproc: int):
    """The run config eval builds its model from: the checkpoint's [model] (extension keys may be
    overridden), the layout and memory flags given, and the longest length."""
    from ..config import load_config, parse_overrides
    from ..config.layout import default_layout

    given = parse_overrides(overrides)
    allowed = {"model", "parallel", "memory", "train"}
    other = sorted(set(given) - allowed)
    if other:
        raise ConfigError(f"longctx eval takes --model.* (extension keys such as rope_theta), --parallel.*, "
                          f"--memory.* and --train.device/dtype overrides; [{', '.join(other)}] does not apply.")
    if "init_from" in given.get("model", {}):
        raise ConfigError("longctx eval takes the weights from --checkpoint; drop --model.init_from.")
    p = given.get("parallel", {})
    if nproc > 1 and not any(k in p for k in ("dp_replicate", "dp_shard", "head", "ctx")):
        given.setdefault("parallel", {}).update(default_layout(nproc, *_heads(args.checkpoint)))
    given.setdefault("model", {})["init_from"] = args.checkpoint
    train = given.setdefault("train", {})
    # the checkpoint's own model and the layout's data-parallel degree, before the lengths are set
    probe = load_config(None, {**given, "train": {**train, "seq_len": 2, "eval_interval": 0}})
    dp = _dp(probe, nproc)
    batch = args.batch or dp
    if batch % dp:
        raise ConfigError(f"--batch {batch} must be a multiple of the data-parallel degree {dp}.")
    if max(lengths) > probe.model.max_seq_len:  # evaluating past the trained length is the point
        given["model"]["max_seq_len"] = max(lengths)
    train.update(seq_len=max(lengths), global_batch=batch, grad_accum=1, eval_interval=0)
    return load_config(None, given), batch


def _heads(checkpoint: str) -> tuple[int, int]:
    """The checkpoint's (heads, kv_heads), for the default layout."""
    from ..config import load_config

    m = load_config(None, {"model": {"init_from": checkpoint}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    return m.heads, m.kv_heads


def _dp(cfg, nproc: int) -> int:
    from ..job.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size=nproc)
    return dims.dp_replicate * dims.dp_shard


def prepare(args, overrides: list[str], nproc: int) -> Plan:
    """Check every input and build the sequences to evaluate (the same in the launcher and on every rank)."""
    from .tasks import parse_depths, parse_lengths

    mode = getattr(args, "mode", "score")
    if mode == "generate" and args.task == "ppl":
        raise ConfigError("--mode generate lets the model answer a retrieval question (--task passkey or needle); "
                          "--task ppl asks none (it is the loss of every token): drop --mode generate.")
    sampling = _sampling(args, mode)
    lengths = parse_lengths(args.lengths)
    depths = parse_depths(args.depths) if args.task != "ppl" else []
    for flag, value in (("--samples", args.samples), ("--buckets", args.buckets), ("--batch", args.batch)):
        if value < 0 or (flag == "--buckets" and value == 0):
            raise ConfigError(f"{flag} must be positive, got {value}.")
    cfg, batch = _config(args, overrides, lengths, nproc)
    _check_layout(cfg, lengths, mode, nproc)
    spec, tokenizer = _load_tokenizer(args, cfg)
    source = _load_source(args, cfg, spec, tokenizer)
    sequences = _sequences(args, source, tokenizer, lengths, depths)
    return Plan(cfg, args.task, lengths, depths, sequences, source.description, spec or source.tokenizer_spec, batch,
                mode, sampling, reach_notes(cfg.model, lengths))


def reach_notes(m, lengths: list[int]) -> tuple[str, ...]:
    """Lengths past the positions the model reaches (config/positions.py): evaluating there is what an
    extension study does, so it runs, but it is said once, with the scaling that would cover them."""
    from ..config.positions import model_reach

    reach = model_reach(m)
    past = [n for n in lengths if n > reach.positions]
    if not past:
        return ()
    many = len(past) > 1
    return (f"length{'s' * many} {', '.join(f'{n:,}' for n in past)} run past the {reach.positions:,} positions the "
            f"model reaches ({reach.said()}): {'their scores measure' if many else 'its score measures'} "
            f"extrapolation, not what the model learned; {reach.extension_flags(max(past))} would cover "
            f"{'them' if many else 'it'}",)


def _sampling(args, mode: str):
    """--mode generate's sampling flags (None: all unset, greedy), checked; refused under --mode score."""
    given = [flag for flag, _, _ in SAMPLING_FLAGS if getattr(args, flag[2:].replace("-", "_"), None) is not None]
    if not given:
        return None
    if mode != "generate":
        raise ConfigError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --mode generate (the model "
                          f"answers by decoding); --mode score reads the answer's logits and samples nothing.")
    from ..generate.sampling import Sampling
    from ..generate.settings import greedy_filter_problem, resolve

    fields, _, _ = resolve(args, {})
    sampling = Sampling(**fields, seed=args.seed)
    sampling.check()
    inert = greedy_filter_problem(args, sampling.temperature)
    if inert:
        raise ConfigError(inert + ".")
    return sampling


def _check_layout(cfg, lengths: list[int], mode: str, nproc: int) -> None:
    """Every length splits over the layout, and the layout runs (generation's narrower one too)."""
    from ..job.checks import check_divisible, check_layout
    from ..job.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size=nproc)
    for length in lengths:
        try:
            check_divisible(length, dims.ctx, dims.head)
        except ConfigError as e:
            raise ConfigError(f"--lengths: {e} (the layout is head {dims.head} x ctx {dims.ctx})") from None
    check_layout(cfg, nproc)
    if mode == "generate":
        _check_generation_layout(cfg, dims, nproc)


def _load_tokenizer(args, cfg):
    """(the tokenizer's spec, the tokenizer), both None when there is none and the task needs no text."""
    from ..data.tokenizer import load_tokenizer
    from .tasks import is_glob  # (lazy, as this module's other task imports: the CLI's parser imports it)

    spec = args.tokenizer or model_tokenizer(cfg.model.init_from)  # --tokenizer, else the checkpoint's
    text_needed = args.task != "ppl" or not args.data or Path(args.data).is_file() or is_glob(args.data)
    if spec is None and text_needed:
        where = ("its directory has no tokenizer.json" if cfg.model.init_from.startswith("hf:") else
                 "its manifest records no tokenizer (written before longctx recorded one)")
        raise ConfigError(f"--checkpoint {args.checkpoint}: {where}, and the {args.task} task turns text into "
                          f"tokens. Pass --tokenizer byte (longctx's default) or --tokenizer PATH/tokenizer.json, "
                          f"the one the model was trained with.")
    tokenizer = load_tokenizer(spec) if spec else None
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"the tokenizer {spec} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                        f"{cfg.model.vocab_size}; pass the tokenizer the model was trained with (--tokenizer).")
    return spec, tokenizer


def _load_source(args, cfg, spec: str | None, tokenizer):
    """The text to evaluate on (--data, or the default corpus), checked against the model's tokenizer."""
    from .tasks import load_source

    def default_store():
        from ..config import DataConfig
        from ..data.cache import default_store as build

        return build(DataConfig(tokenizer=spec or "byte"), 1024, progress=False, log=say, announce_cached=False)

    source = load_source(args.data, args.split, tokenizer, default_store)
    if source.meta.get("vocab_size", 0) > cfg.model.vocab_size:
        raise ConfigError(f"--data {args.data}: its tokenizer has {source.meta['vocab_size']} tokens but the model's "
                          f"vocabulary is {cfg.model.vocab_size}; pass a store built with the model's tokenizer.")
    if source.tokenizer_spec and spec and not same_tokenizer(source.tokenizer_spec, spec):
        raise DataError(f"--data {args.data or '(default corpus)'} was tokenized with {source.tokenizer_spec} but "
                        f"the checkpoint's tokenizer is {spec}; pass a store built with it, or a text file.")
    return source


def _sequences(args, source, tokenizer, lengths: list[int], depths: list[float]) -> dict[int, list[Sequence]]:
    """Each length's sequences: text windows (ppl), or keys hidden at each depth (passkey/needle)."""
    from .tasks import ppl_sequences, retrieval_sequences

    sequences = {}
    for length in lengths:
        if args.task == "ppl":
            sequences[length] = ppl_sequences(source, length, args.samples or 8)
            continue
        try:
            sequences[length] = retrieval_sequences(args.task, source, tokenizer, length, depths, args.samples or 5,
                                                    args.seed)
        except DataError as e:
            raise ConfigError(f"--lengths {length}: {e}") from None
    return sequences


def _check_generation_layout(cfg, dims, nproc: int) -> None:
    """--mode generate runs on one process, or on head x ctx ranks that shard the KV cache, each with
    the full weights (generate/sharded.py): no data parallelism, no expert parallelism."""
    dp = dims.dp_replicate * dims.dp_shard
    if dp > 1 or dims.head * dims.ctx != nproc:
        raise ConfigError(f"--mode generate under --nproc {nproc} needs --parallel.head x --parallel.ctx = {nproc} "
                          f"(the layout is data-parallel {dp} x head {dims.head} x ctx {dims.ctx}): generation "
                          f"shards the KV cache over head x ctx ranks and every rank holds the full weights, so "
                          f"there is no data parallelism to split prompts over. Use --nproc "
                          f"{dims.head * dims.ctx}, or --parallel.head/--parallel.ctx whose product is {nproc}.")
    if dims.expert > 1 or dims.window:
        which = "--parallel.expert" if dims.expert > 1 else "--parallel.window"
        raise ConfigError(f"--mode generate: {which} does not apply (every rank holds the full weights and the cache "
                          f"is sharded over head x ctx only); drop it.")
    if dims.head > 1:
        from ..job.checks import check_heads

        check_heads(cfg.model.heads, cfg.model.kv_heads, dims.head)




def _say_threads(cfg) -> None:
    """One process alone: its threads fit to the idle cores, said when it runs on the CPU."""
    from ..job.devices import resolve_device

    threads.fit_to_idle_cores()
    if resolve_device(cfg.train.device).type == "cpu":
        say(f"eval: {threads.describe()}")


def main(args, overrides) -> int:
    from ..job.launch import argv_without_nproc, relaunch, under_launcher

    nproc = int(__import__("os").environ["WORLD_SIZE"]) if under_launcher() else args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}.")
    plan = prepare(args, overrides, nproc)
    if not under_launcher():  # (once: in the launcher, or the one process)
        for note in plan.notes:
            say(f"eval: note: {note}")
    if nproc > 1 and not under_launcher():
        relaunch(nproc, argv_without_nproc(args.argv))
        return 0
    if not under_launcher():
        _say_threads(plan.cfg)
    result = evaluate(plan, args)
    if result is None:  # not rank 0
        return 0
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
        say(f"eval: wrote {args.output}")
    else:
        print(text)
    plot = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else "")
    if plot:
        from .plots import write_plot

        write_plot(result, plot)
        say(f"eval: wrote {plot}")
    return 0


def _note_routing(out: dict, model, main_rank: bool) -> None:
    """How the model routes where that depends on its step (a DTS-Gate checkpoint: as training did at
    its step), in the JSON and said once."""
    from ..models.moe import eval_routing_note

    note = eval_routing_note(model)
    if note:
        out["routing"] = note
        if main_rank:
            say(f"eval: {note}")


def evaluate(plan: Plan, args) -> dict | None:
    """Score every length's sequences on this rank's part of the layout; the result on rank 0."""
    if plan.mode == "generate":
        return evaluate_generate(plan, args)
    import torch

    from ..job.devices import resolve_dtype
    from ..job.join import join_job
    from ..job.launch import finish_distributed
    from ..progress import phase, progress_bar, said
    from ..train.model import build_training_model, resolve_offload
    from .runner import score

    cfg = plan.cfg
    rt, device = join_job(cfg)
    world = rt.world
    log = say if rt.is_main else (lambda *_: None)
    dtype = resolve_dtype(cfg.train.dtype, device)
    with phase(f"eval: building the model from {args.checkpoint}"):
        cfg = resolve_offload(cfg, device, rt, log)
        model = build_training_model(cfg, device, rt, log)
    model.eval()
    layout = {"world": world, **{k: getattr(rt.dims, k) for k in ("dp_replicate", "dp_shard", "head", "ctx")}}
    out = {"task": plan.task, "mode": plan.mode, "checkpoint": args.checkpoint, "model": cfg.model.label,
           "layout": layout, "data": plan.source, "tokenizer": plan.tokenizer,
           "dtype": str(dtype).removeprefix("torch."),
           "rope": {"theta": cfg.model.rope_theta, "scaling": cfg.model.rope_scaling}, "results": []}
    _note_routing(out, model, rt.is_main)
    total = sum(len(s) for s in plan.sequences.values())
    bar = progress_bar(total, f"eval {plan.task}", "seq", rt.is_main)
    start_all = time.perf_counter()
    try:
        with phase(f"eval {plan.task}", done_line=False):
            for which, length in enumerate(plan.lengths):
                seqs = plan.sequences[length]
                t0 = time.perf_counter()
                # (each length's own line follows it: no closing line from the phase)
                with phase(_length_phase(plan, which), len(seqs), "sequences", done_line=False, bar=bar) as progress:
                    scores = score(model, rt, seqs, plan.batch, args.buckets, device,
                                   dtype if dtype != torch.float32 else None, progress)
                out["results"].extend(_summarise(plan, length, seqs, scores, args.buckets, time.perf_counter() - t0))
                if rt.is_main and bar is None:
                    say(f"eval: {plan.task} at {length} tokens: {_headline(out['results'], length)}")
                    said()
    finally:
        if bar is not None:
            bar.close()
    out["seconds"] = round(time.perf_counter() - start_all, 2)
    if plan.task != "ppl":
        done = out["results"]
        out["accuracy"] = sum(r["correct"] for r in done) / max(1, sum(r["samples"] for r in done))
    finish_distributed()
    return out if rt.is_main else None


def _length_phase(plan: Plan, i: int) -> str:
    """'4,096 tokens (length 1 of 2)': what a heartbeat line says of the length being evaluated."""
    n = len(plan.lengths)
    return f"{plan.lengths[i]:,} tokens" + (f" (length {i + 1} of {n})" if n > 1 else "")


def _summarise(plan: Plan, length: int, seqs: list[Sequence], s: dict, buckets: int, seconds: float) -> list[dict]:
    if plan.task == "ppl":
        # position p is in bucket p * buckets // length: bucket i holds [ceil(i L / B), ceil((i + 1) L / B))
        rows = [{"start": -(-i * length // buckets), "end": -(-(i + 1) * length // buckets),
                 "loss": s["nll_sum"][i] / s["tokens"][i] if s["tokens"][i] else None, "tokens": int(s["tokens"][i])}
                for i in range(buckets)]
        total = sum(s["tokens"])
        return [{"length": length, "sequences": len(seqs), "loss": sum(s["nll_sum"]) / max(total, 1),
                 "tokens": int(total), "buckets": rows, "seconds": round(seconds, 2)}]
    results = []
    for depth in plan.depths:
        idx = [i for i, q in enumerate(seqs) if q.depth == depth]
        correct = [s["misses"][i] == 0 for i in idx]
        results.append({"length": length, "depth": depth, "samples": len(idx), "correct": sum(correct),
                        "accuracy": sum(correct) / len(idx),
                        "answer_nll": sum(s["nll"][i] for i in idx) / max(1.0, sum(s["scored"][i] for i in idx)),
                        "per_sample": correct, "seconds": round(seconds / len(plan.depths), 2)})
    return results


def answer_start(seq: Sequence) -> int:
    """Where the answer's tokens begin: one past the first scored position (labels[i] is tokens[i + 1])."""
    import numpy as np

    from ..data.samples import IGNORE

    return int(np.flatnonzero(seq.labels != IGNORE)[0]) + 1


def parse_answer(text: str) -> str:
    """The answer a generation gives: its first run of digits ('' when it has none)."""
    found = re.search(r"[0-9]+", text)
    return found.group() if found else ""


def evaluate_generate(plan: Plan, args) -> dict | None:
    """--mode generate: each prompt (the sequence up to its answer) continued greedily by the answer's
    length + EXTRA_NEW_TOKENS tokens, on one device or sharded over head x ctx (every rank the same
    tokens); right when the first run of digits generated is the answer. The result on rank 0."""
    from ..data.tokenizer import load_tokenizer
    from ..generate.engine import GREEDY, generate
    from ..generate.loading import backend_for as _backend
    from ..generate.loading import eos_ids, load_model
    from ..generate.sampling import derive_seed
    from ..job.devices import resolve_dtype
    from ..job.launch import finish_distributed
    from ..progress import phase, progress_bar, said

    cfg = plan.cfg
    try:
        backend, device, main_rank = _backend(cfg)
        log = say if main_rank else (lambda *_: None)
        dtype = resolve_dtype(cfg.train.dtype, device)
        with phase(f"eval: loading the model from {args.checkpoint}"):
            model = load_model(cfg, device, dtype)
        tokenizer = load_tokenizer(plan.tokenizer)
        eos = eos_ids(cfg.model.init_from, tokenizer)
        p = cfg.parallel
        layout = {"world": p.head * p.ctx, "dp_replicate": 1, "dp_shard": 1, "head": p.head, "ctx": p.ctx}
        out = {"task": plan.task, "mode": plan.mode, "checkpoint": args.checkpoint, "model": cfg.model.label,
               "layout": layout, "data": plan.source, "tokenizer": plan.tokenizer,
               "dtype": str(dtype).removeprefix("torch."),
               "rope": {"theta": cfg.model.rope_theta, "scaling": cfg.model.rope_scaling}, "results": []}
        _note_routing(out, model, main_rank)
        if plan.sampling is not None:
            out["sampling"] = {k: v for k, v in vars(plan.sampling).items() if k not in ("seed", "min_new_tokens")}
        index = 0  # each sequence's draws seeded from --seed and its index here, whatever the batch
        total = sum(len(s) for s in plan.sequences.values())
        bar = progress_bar(total, f"eval {plan.task} (generate)", "seq", main_rank)
        start_all = time.perf_counter()
        try:
            with phase(f"eval {plan.task} (generate)", done_line=False):
                for which, length in enumerate(plan.lengths):
                    seqs = plan.sequences[length]
                    t0 = time.perf_counter()
                    texts = []
                    what = _length_phase(plan, which)
                    with phase(what, len(seqs), "sequences", done_line=False, bar=bar) as progress:
                        for start in range(0, len(seqs), plan.batch):
                            group = seqs[start:start + plan.batch]
                            cuts = [answer_start(q) for q in group]
                            results = generate(model, [q.tokens[:c].tolist() for q, c in zip(group, cuts)],
                                               max_new_tokens=[q.length - c + EXTRA_NEW_TOKENS
                                                               for q, c in zip(group, cuts)],
                                               eos_ids=eos, device=device, backend=backend,
                                               sampling=plan.sampling or GREEDY,
                                               seeds=[derive_seed(args.seed, index + i) for i in range(len(group))])
                            index += len(group)
                            texts += [tokenizer.decode(r.tokens) for r in results]
                            progress.update(len(group))
                    out["results"].extend(_summarise_generated(plan, length, seqs, texts, time.perf_counter() - t0))
                    if bar is None:
                        log(f"eval: {plan.task} (generate) at {length} tokens: {_headline(out['results'], length)}")
                        said()
        finally:
            if bar is not None:
                bar.close()
        out["seconds"] = round(time.perf_counter() - start_all, 2)
        done = out["results"]
        out["accuracy"] = sum(r["correct"] for r in done) / max(1, sum(r["samples"] for r in done))
    finally:
        finish_distributed()
    return out if main_rank else None


def _summarise_generated(plan: Plan, length: int, seqs: list[Sequence], texts: list[str],
                         seconds: float) -> list[dict]:
    results = []
    for depth in plan.depths:
        idx = [i for i, q in enumerate(seqs) if q.depth == depth]
        correct = [parse_answer(texts[i]) == seqs[i].answer for i in idx]
        results.append({"length": length, "depth": depth, "samples": len(idx), "correct": sum(correct),
                        "accuracy": sum(correct) / len(idx), "per_sample": correct,
                        "answers": [seqs[i].answer for i in idx],
                        "generated": [texts[i][:TEXT_CHARS] for i in idx],
                        "seconds": round(seconds / len(plan.depths), 2)})
    return results


def _headline(results: list[dict], length: int) -> str:
    mine = [r for r in results if r["length"] == length]
    if "loss" in mine[0]:
        return f"loss {mine[0]['loss']:.4f} over {mine[0]['tokens']:,} tokens"
    correct, n = sum(r["correct"] for r in mine), sum(r["samples"] for r in mine)
    return f"{correct}/{n} correct ({100 * correct / n:.0f}%)"
