"""The decoding settings of `longctx generate` and `longctx eval --mode generate`: their flags, and
where each value comes from, resolved in one place.

Every sampling flag defaults to "unset" (None). An unset flag takes, for an hf:DIR checkpoint, the
value its generation_config.json gives (the keys below, as its authors meant the model to be
sampled), else longctx's default (greedy, no limits, no penalties, 256 new tokens). A flag given
always wins. The file is read as transformers reads it:
- `do_sample` false or absent means greedy whatever its temperature (transformers' rule); true means
  sampling at its `temperature` (1.0 when absent). Its `top_k`, `top_p`, `min_p` apply whenever
  decoding samples (do_sample true, or --temperature > 0: transformers' do_sample=True takes them);
- `repetition_penalty` applies at any temperature (transformers applies it to greedy decoding too);
- `max_new_tokens` when it has one (`max_length`, a total, is not read);
- a key the file does not write keeps longctx's default, as vLLM does (transformers would fill an
  absent `top_k` with its global 50 when sampling; longctx does not).
Which values came from the file is said once on stderr, and so are the keys it sets that would change
transformers' choice of tokens but that longctx does not apply (UNAPPLIED: no_repeat_ngram_size,
typical_p, num_beams, min_new_tokens, ...), so that a run never silently differs from the model's
intended decoding. `eval --mode generate` reads no file: a benchmark stays greedy unless its flags
say otherwise.
"""

from __future__ import annotations

import json
import os

from ..durable import check_output_path
from ..errors import ConfigError

# (flag, type, help) of the sampling flags generate and eval share
SAMPLING_FLAGS = (
    ("--temperature", float, "0 = greedy (default); > 0 samples"),
    ("--top-k", int, "sample among the k most likely tokens (0 = all, the default)"),
    ("--top-p", float, "sample among the most likely tokens whose probability reaches p, in (0, 1] (1 = all)"),
    ("--min-p", float, "sample among the tokens of at least p x the top token's probability, in [0, 1] (0 = all; "
                       "transformers' MinPLogitsWarper, after top-k and top-p)"),
    ("--repetition-penalty", float, "> 0; divide a positive logit (multiply a negative one) of every token in the "
                                    "prompt or generated so far (transformers'; 1 = none, the default)"),
    ("--presence-penalty", float, "in [-2, 2]: subtract it from the logit of every token generated so far "
                                  "(vLLM's / OpenAI's; 0 = none)"),
    ("--frequency-penalty", float, "in [-2, 2]: subtract it x the times a token was generated so far (vLLM's / "
                                   "OpenAI's; 0 = none)"),
)
# generation_config.json keys read, and the Sampling field (or max_new_tokens) each sets
FILE_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH = 8  # --batch: prompts decoded together
DEFAULT_PREFILL_CHUNK = 4096  # --prefill-chunk: prompt tokens per forward
# generation_config.json keys that change the tokens transformers' generate chooses and that longctx does
# not apply, with the value that changes nothing (transformers' default; None: absent); True: a
# sampling warper (it matters only when decoding samples)
UNAPPLIED = {"min_new_tokens": (0, False), "min_length": (0, False), "no_repeat_ngram_size": (0, False),
             "bad_words_ids": (None, False), "sequence_bias": (None, False), "suppress_tokens": (None, False),
             "begin_suppress_tokens": (None, False), "forced_bos_token_id": (None, False),
             "forced_eos_token_id": (None, False), "exponential_decay_length_penalty": (None, False),
             "num_beams": (1, False), "penalty_alpha": (0, False), "guidance_scale": (1, False),
             "dola_layers": (None, False), "stop_strings": (None, False), "watermarking_config": (None, False),
             "typical_p": (1.0, True), "epsilon_cutoff": (0.0, True),
             "eta_cutoff": (0.0, True), "top_h": (None, True)}


def add_sampling_flags(p) -> None:
    """The sampling flags (default unset: resolved by `resolve`)."""
    for flag, kind, text in SAMPLING_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=text)


def generation_config(file, data: dict) -> dict:
    """The keys of FILE_KEYS a generation_config.json (`file`, its keys `data`: read_generation_config)
    writes, nulls dropped, their types checked; {} without a file."""
    found = {k: data[k] for k in FILE_KEYS if data.get(k) is not None}
    for key, kinds in (("do_sample", (bool,)), ("top_k", (int,)), ("max_new_tokens", (int,)),
                       ("temperature", (int, float)), ("top_p", (int, float)), ("min_p", (int, float)),
                       ("repetition_penalty", (int, float))):
        if key in found and (not isinstance(found[key], kinds) or (bool not in kinds and isinstance(found[key], bool))):
            raise ConfigError(f"{file}: {key} is {found[key]!r}, not a {'/'.join(k.__name__ for k in kinds)}.")
    return found


def read_generation_config(checkpoint: str) -> tuple[object, dict]:
    """(the path, the keys) of an hf:DIR checkpoint's generation_config.json; (None, {}) for a longctx
    checkpoint or a directory without the file."""
    if not checkpoint.startswith("hf:"):
        return None, {}
    from ..config.hf import hf_dir

    file = hf_dir(checkpoint) / "generation_config.json"
    if not file.is_file():
        return None, {}
    try:
        return file, json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{file} is not JSON ({e}).") from None


def unapplied(data: dict, sampling: bool, min_new_tokens: int = 0) -> list[str]:
    """'key value' of each UNAPPLIED key a generation_config.json's keys `data` set to a value that
    changes transformers' tokens (a sampling warper only when `sampling`; min_new_tokens unless the
    flag gave one): what the run will not follow, to be said."""
    out = []
    for key, (neutral, warper) in UNAPPLIED.items():
        value = data.get(key)
        if value is None or value == neutral or value in ([], {}) or (warper and not sampling):
            continue
        if key == "min_new_tokens" and min_new_tokens:
            continue
        out.append(f"{key} {json.dumps(value)}")
    return out


def greedy_filter_problem(args, temperature: float) -> str | None:
    """The filter flags given (--top-k, --top-p, --min-p) when decoding is greedy, where they would do
    nothing: said as a problem rather than dropped (transformers warns of the same)."""
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # (a value that filters nothing is no mistake)
    given = [f"--{name.replace('_', '-')}" for name, none in off.items()
             if getattr(args, name, None) not in (None, none)]
    if temperature > 0 or not given:
        return None
    return (f"{', '.join(given)} filter{'s' if len(given) == 1 else ''} what is sampled, but decoding is greedy "
            f"(temperature 0), where {'it does' if len(given) == 1 else 'they do'} nothing: add --temperature T > 0, "
            f"or drop {'it' if len(given) == 1 else 'them'}")


def resolve(args, file: dict) -> tuple[dict, int, list[str]]:
    """(the Sampling fields, max_new_tokens, the values taken from the file as 'key value') from the
    flags (args.temperature, ...; None = unset) and the file's keys (generation_config)."""
    fields, taken = {}, []
    temperature = getattr(args, "temperature", None)
    if temperature is None:
        temperature = 0.0
        if file.get("do_sample") is True:
            temperature = file.get("temperature", 1.0)
            said = f"do_sample true, temperature {temperature}"
            if temperature == 0:  # (decoded greedily here, where transformers' generate raises: said)
                said += " (greedy: transformers' generate refuses to sample at temperature 0)"
            taken.append(said)
        elif "do_sample" in file:
            taken.append("do_sample false (greedy)")
    fields["temperature"] = temperature
    for name, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        given = getattr(args, name, None)
        # the filters apply whenever decoding samples (the file's do_sample, or --temperature > 0, as
        # transformers' do_sample=True would take them); the repetition penalty at any temperature
        applies = name == "repetition_penalty" or (temperature > 0 and name in ("top_k", "top_p", "min_p"))
        if given is None and applies and name in file:
            given = file[name]
            taken.append(f"{name} {given}")
        fields[name] = default if given is None else given
    fields = {k: int(v) if k == "top_k" else float(v) for k, v in fields.items()}
    new = getattr(args, "max_new_tokens", None)
    if new is None:
        new = file.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if "max_new_tokens" in file:
            taken.append(f"max_new_tokens {new}")
    return fields, new, taken


def check_run_flags(args) -> None:
    """`longctx generate`'s flags that no setting above checks, before any weight is read: adaptive
    speculation's (generate/spec_length.py), a flag that would do nothing in this run (said, never
    silently dropped: a --speculate without --draft, an --infllm-* size without --context-memory infllm,
    ...), and --output, whose open would fail only after the model has loaded, or would write over
    the --prompts file it reads."""
    from .cape import DEFAULT_TABLE
    from .spec_length import check_adaptive_flags

    check_adaptive_flags(args.draft, args.speculate, args.speculate_adaptive, args.draft_cost, args.verify_cost)
    for unused, need in (
            ([] if args.draft else given_flags(args, {"speculate": 4, "confidence_stop": 0.0, "draft_window": None}),
             "--draft DIR (speculative decoding)"),
            ([] if args.cape else given_flags(args, {"cape_table": DEFAULT_TABLE}),
             "--cape (CaPE's tree, with --draft)"),
            (unused_memory_flags(args), "--context-memory infllm (InfLLM's context memory)")):
        if unused:
            one = len(unused) == 1
            raise ConfigError(f"{', '.join(unused)} {'does' if one else 'do'} nothing without {need}: add it, or "
                              f"drop {'it' if one else 'them'}.")
    memory = getattr(args, "context_memory", "none") == "infllm"
    alone = "--draft" if args.draft else "--context-memory infllm" if memory else None
    batch = given_flags(args, {"batch": DEFAULT_BATCH})
    if alone and batch and args.batch > 1:  # (as eval refuses it with the memory; 1 is what runs)
        raise ConfigError(f"{batch[0]} does nothing with {alone}, which decodes one prompt at a time: drop it.")
    # a sharded prefill runs each rank's share of the prompt in one call (generate/sharded.py): --prefill-chunk
    # then does nothing (a draft's own prefill and InfLLM's chunks still read it)
    chunk = given_flags(args, {"prefill_chunk": DEFAULT_PREFILL_CHUNK})
    if chunk and getattr(args, "nproc", 1) > 1 and not args.draft and not memory:
        raise ConfigError(f"{chunk[0]} does nothing with --nproc {args.nproc}: the sharded prefill runs each rank's "
                          f"share of the prompt in one call (a chunked sharded prefill is not built); drop it.")
    if getattr(args, "ignore_eos", False) and getattr(args, "min_new_tokens", 0):
        raise ConfigError(f"--min-new-tokens {args.min_new_tokens} holds back EOS, which --ignore-eos already never "
                          f"ends a row on: it does nothing; drop one of them.")
    check_output_path("--output", args.output, {"--prompts": args.prompts})
    from .output_paths import partial_path  # (the lines go there until the last is in)

    if args.output and args.prompts and os.path.realpath(partial_path(args.output)) == os.path.realpath(args.prompts):
        raise ConfigError(f"--output {args.output} is written as {partial_path(args.output)} until done, which is "
                          f"--prompts {args.prompts}: that would destroy it. Pass another --output.")


def check_logprobs(logprobs: int | None, vocab_size: int) -> None:
    """--logprobs N within the model's vocabulary of `vocab_size` tokens: no position has more than that to
    list, and a larger N would be cut to it without a word (a reader counting on N entries would not get them)."""
    if logprobs is not None and logprobs > vocab_size:
        raise ConfigError(f"--logprobs {logprobs} asks for the {logprobs} most likely tokens per position, but the "
                          f"model's vocabulary has {vocab_size} tokens, and no position has more: pass --logprobs "
                          f"{vocab_size} or less (0: the chosen token's only).")


def given_flags(args, defaults: dict) -> list[str]:
    """'--flag value' of each of `defaults` (attribute: its default) set to another value in `args`;
    as greedy_filter_problem, a flag given its default changes nothing and is no mistake."""
    return [f"--{name.replace('_', '-')} {getattr(args, name)}" for name, default in defaults.items()
            if getattr(args, name, default) != default]


def unused_memory_flags(args) -> list[str]:
    """The --infllm-* sizes given without --context-memory infllm (generate and eval), which would size
    nothing."""
    from .context_memory import DEFAULTS

    if getattr(args, "context_memory", "none") == "infllm":
        return []
    return given_flags(args, {f"infllm_{name}": value for name, value in DEFAULTS.items()})


# what a --prompts line may hold that names a run's setting (transformers', vLLM's and OpenAI's per-request names
# too: OpenAI's max_completion_tokens, top_logprobs and echo, vLLM's min_tokens and ignore_eos, transformers'
# num_return_sequences): longctx reads "prompt", "messages", "id" and "seed" only, so a line's own limit or
# temperature would be silently decoded with the flags' instead. Other keys (a line's metadata) are left alone.
PER_RUN_KEYS = {"max_new_tokens": "--max-new-tokens", "max_tokens": "--max-new-tokens",
                "max_completion_tokens": "--max-new-tokens", "min_new_tokens": "--min-new-tokens",
                "min_tokens": "--min-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                "top_p": "--top-p", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
                "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                "stop": "--stop", "n": "--num-samples", "num_samples": "--num-samples",
                "num_return_sequences": "--num-samples", "logprobs": "--logprobs", "top_logprobs": "--logprobs",
                "do_sample": "--temperature", "ignore_eos": "--ignore-eos", "echo": "--echo"}


def check_prompt_keys(row: dict, where: str) -> None:
    """A --prompts line (`row`, at `where`) that sets a run's setting for itself, which no line can."""
    found = [k for k in row if k in PER_RUN_KEYS]
    if found:
        flags = ", ".join(dict.fromkeys(PER_RUN_KEYS[k] for k in found))
        raise ConfigError(f"{where} sets {', '.join(map(repr, found))}: decoding settings are the run's, not a "
                          f"line's (a line holds \"prompt\" or \"messages\", and \"id\" and \"seed\"); give them as "
                          f"{flags} (one run per setting), or drop them from the line.")
