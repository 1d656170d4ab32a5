"""What one `longctx eval` computes (EvalRequest), prepared from its flags: the run config its model is
built from (the checkpoint's [model] without a MoE capacity, said by models/moe_eval_routing.py
`dropless_note`; the layout, the longest length), --mode generate's sampling, the notes on lengths past the
model's reach, and each length's sequences (eval/inputs.py). The launching process prepares it once, so that
bad input stops the command before any rank starts, and every rank prepares the same again (cheap,
deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.tokenizer import unchecked_tokenizer
from ..errors import ConfigError
from ..generate.settings import SAMPLING_FLAGS
from .defaults import DEFAULT_BUCKETS, EXTRA_NEW_TOKENS
from .inputs import _load_source, _load_tokenizer, _sequences
from .layout_checks import _check_layout
from .task_list import default_plot

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .tasks import Sequence


@dataclass
class EvalRequest:
    """What one eval computes, prepared identically in the launcher and on every rank."""
    cfg: object
    task: str
    lengths: list[int]
    depths: list[float]
    sequences: Mapping[int, list[Sequence]]  # built per length when asked for (inputs.py LengthSequences)
    source: str
    tokenizer: str
    batch: int
    mode: str = "score"
    sampling: object = None  # --mode generate: generate/sampling.py's Sampling (None: greedy)
    notes: tuple = ()        # said once before work (lengths past the model's reach, a capacity left out)
    memory: object = None    # --context-memory infllm: models/context_memory.py's InfLLMShape (None: plain)
    routing: str | None = None  # how the model routes, when eval changes it (a MoE capacity scored dropless)
    place: str = ""  # in a run of several tasks, which this is ("task 2 of 3"), said as it starts; "" alone
    # rank 0's result while it is built (score_mode / generate_mode): a run stopped part-way keeps its finished
    # lengths from it (eval/stopped.py); None on the other ranks and before the task starts
    result: dict | None = None


def _config(args, overrides: list[str], lengths: list[int], nproc: int):
    """(the run config eval builds its model from, the batch, the MoE capacity factor left out): the
    checkpoint's [model] (extension keys may be overridden) without a capacity (`dropless_note`), the layout
    and memory flags given, and the longest length."""
    from ..config import load_config, parse_overrides
    from ..config.checkpoint_paths import check_weights_flag
    from ..config.layout import cache_layout, default_layout
    from ..config.positions import unread_ms_poe_settings

    check_weights_flag(args.checkpoint)  # (in the flag's words, before the config reads it as model.init_from)
    given = parse_overrides(overrides)
    allowed = {"model", "parallel", "memory", "train"}
    other = sorted(set(given) - allowed)
    if other:
        raise ConfigError(f"longctx eval takes --model.* (extension keys such as rope_theta), --parallel.*, "
                          f"--memory.* and --train.device/dtype overrides; [{', '.join(other)}] does not apply.")
    if "init_from" in given.get("model", {}):
        raise ConfigError("longctx eval takes the weights from --checkpoint; drop --model.init_from.")
    # (the rest were overwritten or unread; compile: score mode's model is parallelised, blocks compiled)
    extra = sorted(set(given.get("train", {})) - {"device", "dtype", "compile"})
    if extra:
        raise ConfigError(f"longctx eval takes only --train.device, --train.dtype and --train.compile of [train]; "
                          f"{', '.join('train.' + k for k in extra)} does not apply (the lengths are --lengths, "
                          f"the batch --batch, the seed --seed).")
    p = given.get("parallel", {})
    if nproc > 1 and not any(k in p for k in ("dp_replicate", "dp_shard", "head", "ctx")):
        infllm = getattr(args, "context_memory", "none") == "infllm"  # (its memory shards over ctx ranks only)
        if infllm:
            layout = {"ctx": nproc}
        else:  # (generation has no data parallelism: an odd --nproc shards the cache over ctx ranks)
            pick = cache_layout if getattr(args, "mode", "score") == "generate" else default_layout
            layout = pick(nproc, *_heads(args.checkpoint))
        given.setdefault("parallel", {}).update(layout)
    given.setdefault("model", {})["init_from"] = args.checkpoint
    train = given.setdefault("train", {})
    # the checkpoint's own model and the layout's data-parallel degree, before the lengths are set
    probe = load_config(None, {**given, "train": {**train, "seq_len": 2, "eval_interval": 0}})
    dp = _dp(probe, nproc)
    batch = args.batch or dp
    if batch % dp:
        raise ConfigError(f"--batch {batch} must be a multiple of the data-parallel degree {dp}.")
    seq_len = _longest(args, probe, lengths, nproc)
    if seq_len > probe.model.max_seq_len:  # evaluating past the trained length is the point
        given["model"]["max_seq_len"] = seq_len
    capacity = probe.model.moe_capacity_factor
    if capacity > 0:  # (a TRAINING_KEY: free to differ from the weights' config)
        given["model"]["moe.capacity_factor"] = 0.0
    train.update(seq_len=_layout_length(args, probe, seq_len, nproc), global_batch=batch, grad_accum=1,
                 eval_interval=0)
    cfg = load_config(None, given)
    unread = unread_ms_poe_settings(cfg.model, given["model"])
    if unread:  # (the scores would be plain RoPE's, not those of the positions asked for: as generate refuses it)
        raise ConfigError(unread)
    return cfg, batch, capacity


def _layout_length(args, probe, longest: int, nproc: int) -> int:
    """train.seq_len: the longest length; under --mode generate, which reads no train.seq_len and pads its
    prompts over the ranks itself (generate/sharded.py), the nearest multiple of training's zigzag unit
    (2 x head x ctx) at or below it, so the layout checks refuse no length generation can run."""
    return _unit_floor(probe, longest, nproc) if getattr(args, "mode", "score") == "generate" else longest


def _unit_floor(probe, length: int, nproc: int) -> int:
    """The multiple of the layout's zigzag unit (2 x head x ctx) at or below `length` (at least one unit)."""
    from ..job.dims import ParallelDims

    dims = ParallelDims.from_config(probe, world_size=nproc)
    unit = 2 * dims.head * dims.ctx
    return max(unit, length // unit * unit)


def _longest(args, probe, lengths: list[int], nproc: int) -> int:
    """The length eval builds its config for (train.seq_len; model.max_seq_len raised to it): the longest of
    --lengths, but under InfLLM's context memory on windowed weights no further than the model's max_seq_len
    (their window by default): the memory keeps every distance within it (generate/context_memory.py check_reach),
    and a max_seq_len past the window is refused (config/hf_families.py check_sliding_window), so eval raised
    itself into that refusal."""
    from ..generate.loading import init_window

    longest, cap = max(lengths), probe.model.max_seq_len
    if longest <= cap or getattr(args, "context_memory", "none") != "infllm" or not init_window(args.checkpoint):
        return longest
    return _unit_floor(probe, cap, nproc)


def _heads(checkpoint: str) -> tuple[int, int]:
    """The checkpoint's (heads, kv_heads), for the default layout."""
    from ..config import load_config

    m = load_config(None, {"model": {"init_from": checkpoint}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    return m.heads, m.kv_heads


def _dp(cfg, nproc: int) -> int:
    from ..job.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size=nproc)
    return dims.dp_replicate * dims.dp_shard


def prepare(args, overrides: list[str], nproc: int) -> EvalRequest:
    """Check every input and build the sequences to evaluate (the same in the launcher and on every rank)."""
    from ..models.moe_eval_routing import dropless_note  # (here: the module stays free of torch)
    from .tasks import parse_depths, parse_lengths

    mode = getattr(args, "mode", "score")
    if mode == "generate" and args.task == "ppl":
        raise ConfigError("--mode generate lets the model answer a retrieval question (--task passkey or needle); "
                          "--task ppl asks none (it is the loss of every token): drop --mode generate.")
    sampling = _sampling(args, mode)
    _check_flags(args)
    lengths = parse_lengths(args.lengths)
    depths = parse_depths(args.depths) if args.task != "ppl" else []
    for flag, value in (("--samples", args.samples), ("--buckets", args.buckets), ("--batch", args.batch)):
        # (--samples 0 asks for no sequences: refused, not the task's default, which the flag left out gives)
        if value is not None and (value < 0 or (flag != "--batch" and value == 0)):
            raise ConfigError(f"{flag} must be positive, got {value}.")
    if args.seed < 0:  # (numpy's seed words are non-negative: a negative one would stop the run with its ValueError)
        raise ConfigError(f"--seed must be a non-negative integer, got {args.seed}; pass e.g. --seed {-args.seed}.")
    # (the default is capped at each length shorter than it, per length: score_mode.py)
    if args.task == "ppl" and args.buckets != DEFAULT_BUCKETS and args.buckets > min(lengths):
        raise ConfigError(f"--buckets {args.buckets} is more than the {min(lengths):,} positions of --lengths "
                          f"{min(lengths):,}: a bucket holds at least one position; pass --buckets {min(lengths)} "
                          f"or fewer.")
    _check_window_lengths(args, lengths, mode)
    cfg, batch, capacity = _config(args, overrides, lengths, nproc)
    # (a capacity shared by a forward's tokens: a sequence's score would depend on --batch, the unscored copies
    # filling the last batch, and the layout)
    routing = dropless_note(capacity, "the model is evaluated",
                            "a sequence's score depend on what it is batched with and on the layout")
    _check_layout(cfg, lengths, mode, nproc)
    # (before the text: the default corpus's first build, or a --data file's tokenization, is work)
    memory = _memory(args, cfg, mode, lengths, batch, nproc)
    spec, tokenizer = _load_tokenizer(args, cfg)
    source = _load_source(args, cfg, spec, tokenizer)
    sequences = _sequences(args, source, tokenizer, lengths, depths)
    # (under the memory no length is past the reach: every distance a query sees stays within it)
    unchecked = unchecked_tokenizer(cfg.model.init_from, args.tokenizer)  # (a --tokenizer nothing could check)
    # (generate mode reads a prompt after the special-token prefix, so its answer ends that many positions later;
    # score mode keeps a sequence `length` tokens: generate_mode.with_prefix)
    prefix = _prompt_prefix(cfg, tokenizer, spec or source.tokenizer_spec) if mode == "generate" else 0
    notes = ((unchecked,) if unchecked else ()) + \
        (() if memory is not None else reach_notes(cfg.model, lengths, prefix=prefix)) + \
        ((routing,) if routing else ()) + short_ppl_notes(args, sequences)
    return EvalRequest(cfg, args.task, lengths, depths, sequences, source.description,
                       spec or source.tokenizer_spec, batch, mode, sampling, notes, memory, routing)


# what matplotlib's savefig writes (it would add .png to a name without one, and refuse another suffix after the
# whole evaluation has run)
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf", "raw", "rgba")


def _check_flags(args) -> None:
    """Before any work: a flag the run would ignore (--depths for ppl, --buckets for passkey/needle, an
    --infllm-* size without --context-memory infllm, --split of a text --data), and --output and --plot,
    written only once the evaluation has run: each must be writable, neither the --data file nor the other."""
    from pathlib import Path

    from ..durable import check_output_path
    from ..generate.settings import given_flags, unused_memory_flags
    from .defaults import DEFAULT_DEPTHS

    unused = given_flags(args, {"depths": DEFAULT_DEPTHS} if args.task == "ppl" else {"buckets": DEFAULT_BUCKETS})
    if unused:
        which = "the needle's depths" if args.task == "ppl" else "ppl's position buckets"
        raise ConfigError(f"{unused[0]} sets {which}, which --task {args.task} does not have; drop it.")
    memory = unused_memory_flags(args)
    if memory:
        # (ppl has no generate mode, so no memory to size: only the drop applies)
        use = "" if args.task == "ppl" else "add --mode generate --context-memory infllm, or "
        raise ConfigError(f"{', '.join(memory)} size{'s' * (len(memory) == 1)} InfLLM's context memory, which this "
                          f"run does not use: {use}drop {'it' if len(memory) == 1 else 'them'}.")
    if args.split != "eval" and args.data and not Path(args.data).is_dir():  # (a store's split; text has none)
        raise ConfigError(f"--split {args.split} picks a store's split, but --data {args.data} is text, read whole; "
                          f"drop --split, or pass a store built by `longctx data build`.")
    plot = default_plot(args)
    if plot and Path(plot).suffix[1:].lower() not in PLOT_FORMATS:
        raise ConfigError(f"--plot {plot}: the plot's format is its suffix, one of .{', .'.join(PLOT_FORMATS)}; "
                          f"pass e.g. --plot {Path(plot).with_suffix('.png')}.")
    data = args.data if args.data and Path(args.data).is_file() else ""
    check_output_path("--output", args.output, {"--data": data}, create_parents=True,
                      renames=True)  # (command.py: write_text_durably, a rename over the path)
    label = getattr(args, "plot_label", None) or ("--plot" if args.plot else "the plot (--output's name with .png)")
    check_output_path(label, plot,
                      {"--data": data, "--output": args.output}, create_parents=True)


def _memory(args, cfg, mode: str, lengths: list[int], batch: int, nproc: int):
    """--context-memory infllm's shape (None without it), checked as generate checks it (head 1: one
    process or ctx ranks; its sizes within the model's reach) and for eval: --mode generate, one
    sequence at a time, a window no longer than the shortest sequence."""
    import argparse

    if getattr(args, "context_memory", "none") != "infllm":
        return None
    from ..config.positions import model_reach
    from ..generate.context_memory import check_reach, memory_shape

    if mode != "generate":
        how = ("drop --context-memory: --task ppl scores every token in one teacher-forced pass, which "
               "attends to every position" if args.task == "ppl" else
               "add --mode generate (--mode score's one teacher-forced pass attends to every position)")
        raise ConfigError(f"--context-memory infllm is a way of decoding: {how}.")
    shape = memory_shape(argparse.Namespace(**{**vars(args), "nproc": nproc, "draft": "", "compile": False}), cfg)
    check_reach(shape, model_reach(cfg.model))
    if batch != 1:
        raise ConfigError(f"--context-memory infllm generates one sequence at a time; drop --batch {batch}.")
    if min(lengths) < shape.window:
        n = min(lengths)
        fit = n // shape.block * shape.block  # (a window of whole units; none fits a sequence shorter than a unit)
        fix = f"--infllm-window {fit}" if fit else f"an --infllm-block and --infllm-window of at most {n:,}"
        raise ConfigError(f"--infllm-window {shape.window} is larger than the {n:,}-token sequences: the memory would "
                          f"never hold anything. Use {fix}, or evaluate those lengths without --context-memory.")
    return shape


def short_ppl_notes(args, sequences) -> tuple[str, ...]:
    """ppl at a length the data holds fewer spans of than --samples asks for (the result's `sequences`
    counts them; its loss is over those alone). `sequences`: LengthSequences (its counts, nothing built)."""
    asked = args.samples or 8
    return tuple(f"ppl at {length} tokens: {n} span{'s' * (n != 1)} of the {asked} asked for "
                 f"(the data holds no more that long; pass a longer text with --data for more)"
                 for length, n in sequences.counts.items() if args.task == "ppl" and n < asked)


def _check_window_lengths(args, lengths: list[int], mode: str) -> None:
    """--lengths past the sliding window of the weights: refused before work, naming --lengths (the config's
    own rule would refuse it too, naming the model.max_seq_len eval sets from them, a key the user never typed).
    --mode score: its one teacher-forced pass attends to every earlier position, a window's attention only
    within the window, so past it each figure is O(1) off the model's (generate/loading.py check_window), and
    InfLLM's context memory, a way of decoding, does not apply. --mode generate: _check_generate_window (lengths
    within the window whose new tokens pass it: generate_mode.py _check_window)."""
    from ..generate.loading import init_window, window_off

    window = init_window(args.checkpoint)
    past = [n for n in lengths if n > window]
    if not window or not past:
        return
    if mode == "generate":
        _check_generate_window(args, past, window)
        return
    fit = ", ".join(f"{n:,}" for n in lengths if n <= window)
    raise ConfigError(f"--lengths {', '.join(f'{n:,}' for n in past)}: past the {window:,}-token sliding window "
                      f"that the weights' config.json gives their attention. --mode score reads a sequence in one "
                      f"pass that attends to every earlier position (longctx has no sliding-window attention), the "
                      f"same as the window only up to {window:,} positions, so past them the {args.task} figures "
                      f"would not be this model's (InfLLM's context memory, a way of decoding, does not apply to "
                      f"--mode score). Evaluate --lengths up to {window:,}" + (f" (here {fit})" if fit else "") +
                      f"; or, to score the weights with full attention, {window_off(args.checkpoint)}.")


def _check_generate_window(args, past: list[int], window: int) -> None:
    """--mode generate at `past` (of --lengths) beyond the `window` of the weights, refused before the config is
    built, which would refuse the model.max_seq_len eval raises to the longest length, a key the user never typed
    (lengths within the window whose new tokens pass it: generate_mode.py _check_window, which knows the prompts'
    special tokens). InfLLM's context memory keeps every distance within the window: a way out here."""
    from ..generate.loading import window_ways_out

    if getattr(args, "context_memory", "none") == "infllm":
        return
    room = window - EXTRA_NEW_TOKENS
    raise ConfigError(f"--lengths {', '.join(f'{n:,}' for n in past)}: past the {window:,}-token sliding window that "
                      f"the weights' config.json gives their attention. longctx attends to every earlier position, "
                      f"the same as the window only up to {window:,} positions, so past them the answers would not "
                      f"be this model's. Evaluate --lengths of at most {room:,} (the window less the "
                      f"{EXTRA_NEW_TOKENS} new tokens decoded after a prompt, and less its special tokens); or "
                      f"{window_ways_out(window, args.checkpoint)}.")


def _prompt_prefix(cfg, tokenizer, tokenizer_spec) -> int:
    """The special tokens generate mode puts before a prompt (config/tokenizer.py model_text_prefix), by the
    tokenizer loaded for the text (None: the store's, `tokenizer_spec`, loaded here)."""
    from ..config.tokenizer import model_text_prefix
    from ..data.tokenizer import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_spec)
    return len(model_text_prefix(cfg.model.init_from, tokenizer))


def reach_notes(m, lengths: list[int], new_tokens: int = 0, figure: str = "score",
                extend: bool = True, prefix: int = 0) -> tuple[str, ...]:
    """Lengths past the positions the model reaches (config/positions.py): evaluating there is what an
    extension study does, so it runs, but it is said once, with the scaling that would cover them (`extend`:
    a command that takes --model.* flags). `new_tokens`: decoded past each length (bench decode's note), the
    positions counted with them; `prefix`: special tokens read before each length (eval generate mode's
    prompts), counted too; `figure`: what each length measures."""
    from ..config.positions import model_reach

    reach = model_reach(m)
    extra = prefix + new_tokens
    past = [n for n in lengths if n + extra > reach.positions]
    if not past:
        return ()
    many = len(past) > 1
    decoded = (f" (after {prefix} special token{'s' * (prefix > 1)})" if prefix else "") + \
        (f" (+ {new_tokens:,} new tokens)" if new_tokens else "")
    measure = f"their {figure}s measure" if many else f"its {figure} measures"
    return (f"length{'s' * many} {', '.join(f'{n:,}' for n in past)}{decoded} run{'' if many else 's'} past the "
            f"{reach.positions:,} positions the model reaches ({reach.said()}): {measure} extrapolation, not what the "
            f"model learned" +
            ("" if reach.window or not extend else  # (no scaling moves a window)
             f"; {reach.extension_flags(max(past) + extra)} would cover {'them' if many else 'it'}"),)


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
