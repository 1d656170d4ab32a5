"""`longctx generate`: continue prompts with a checkpoint, with a KV cache, on one device or sharded.

    longctx generate --checkpoint hf:DIR --prompt "Once upon a time" --max-new-tokens 64
    longctx generate --checkpoint runs/X/checkpoints --prompts prompts.jsonl --output out.jsonl \\
        --temperature 0.8 --top-p 0.95 --seed 1 --stop $'\\n\\n'
    longctx generate --checkpoint hf:DIR --prompts long.jsonl --nproc 4 --parallel.head 2 --parallel.ctx 2

With --nproc N the cache is sharded over head x ctx ranks as training shards the sequence
(generate/sharded.py): each rank holds the full weights and 1/(head x ctx) of the cache, and
the ranks return the same tokens (one process's in fp32; in bf16 up to rounding, which can flip a near-tie:
docs/generate.md); rank 0 writes them.

Input: `--prompt TEXT` or `--prompts FILE.jsonl` (one `{"prompt": ...}` object per line, blank lines skipped; an "id"
field is copied to the output, a "seed" seeds that prompt's draws; with --chat a line may hold
`{"messages": [...]}` instead, rendered by the tokenizer's chat template: data/chat_template.py).
Decoding settings: flags over hf:DIR's generation_config.json over longctx's defaults
(generate/settings.py); processors as transformers orders them (generate/sampling.py). Output: one
JSON line per prompt and sample (--num-samples; a "sample" index), in input order, to --output or
stdout: prompt_tokens, tokens (the new ids), text, finish_reason (eos / stop / length),
prefill_tokens_per_s, decode_tokens_per_s, and with --logprobs the chosen tokens' and the top N's
log-probabilities. On a terminal, one prompt's text streams to stderr as it is generated (never a
character the line's text cuts); several prompts show a progress bar there instead.

Everything that can be wrong with the input is said before the weights are read: both or neither of
--prompt / --prompts, a bad prompts file, an empty prompt, a prompt past the positions the model was
trained on (config/positions.py: raising --model.max_seq_len does not move that, RoPE scaling does;
--allow-extrapolation runs it anyway), a checkpoint that names no tokenizer, sampling settings out of range.

The model is the checkpoint's own [model] (extension keys may be overridden: --model.rope_scaling,
--model.rope_factor, --model.max_seq_len ...), built on one device (--train.device / --train.dtype);
weights from hf:DIR's safetensors or a longctx checkpoint (checksums verified); EOS: hf:DIR's
generation_config.json or config.json eos_token_id, else the tokenizer's end-of-document token (both
generate/loading.py, which eval and bench decode load through too); with --chat the tokenizer's eos_token
(its end of turn) too (generate/prompts.py with_turn_end). The prompt is tokenized as the
model saw text (generate/prompts.py): with a Hugging Face tokenizer's special tokens (e.g. BOS) for
hf:DIR, as transformers does by default; without them for a longctx checkpoint (training data
carries none). This module is the command alone: its request and the run; its flags are generate/flags.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import threads
from ..config.checkpoint_paths import check_weights_flag, step_read
from ..errors import ConfigError
from ..progress import phase, say


@dataclass
class GenerateRequest:
    """What one generate run does (its config, tokenizer, prompts, limits, sampling, draft), checked
    before any weight is read."""
    cfg: object
    tokenizer: object
    tokenizer_spec: str
    prompts: list[dict]          # {"text", "ids", "id"?}
    limits: list[int]            # new tokens per prompt (max_new_tokens, capped at the model's reach)
    eos_ids: list[int]
    sampling: object
    notes: list[str] = field(default_factory=list)
    draft_cfg: object = None     # the draft model's config, or a GliDe draft's record (--draft), checked
    cape: object = None          # --cape's table (generate/cape.py CapeTable)
    memory: object = None        # --context-memory infllm's shape (models/context_memory.py InfLLMShape)


def _config(args, overrides: list[str]):
    from ..config import load_config, parse_overrides
    from ..config.layout import cache_layout
    from ..config.positions import unread_ms_poe_settings

    check_weights_flag(args.checkpoint)  # (in the flag's words, before the config reads it as model.init_from)
    given = parse_overrides(overrides)
    allowed = {"model", "train", "parallel"}
    other = sorted(set(given) - allowed)
    if other:
        raise ConfigError(f"longctx generate takes --model.* (extension keys such as rope_theta, rope_scaling, "
                          f"max_seq_len), --parallel.head/ctx and --train.device/dtype overrides; "
                          f"[{', '.join(other)}] does not apply.")
    layout = given.get("parallel", {})
    wrong = sorted(set(layout) - {"head", "ctx", "timeout_s"})
    if wrong:
        raise ConfigError(f"longctx generate shards the cache over --parallel.head and --parallel.ctx only; "
                          f"{', '.join('parallel.' + k for k in wrong)} does not apply (every rank holds the weights).")
    nproc = args.nproc
    if nproc > 1 and not layout.keys() & {"head", "ctx"} and getattr(args, "context_memory", "none") == "infllm":
        given["parallel"] = {**layout, "ctx": nproc}  # (InfLLM's memory is sharded over ctx ranks only)
    elif nproc > 1 and not layout.keys() & {"head", "ctx"}:
        probe = load_config(None, {"model": {"init_from": args.checkpoint}, "train": {"seq_len": 2,
                                                                                   "eval_interval": 0}}).model
        given["parallel"] = {**layout, **cache_layout(nproc, probe.heads, probe.kv_heads)}
    degrees = given.get("parallel", {})
    if int(degrees.get("head", 1)) * int(degrees.get("ctx", 1)) != nproc:
        raise ConfigError(f"--nproc {nproc} must equal --parallel.head x --parallel.ctx = "
                          f"{int(degrees.get('head', 1))} x {int(degrees.get('ctx', 1))}: generation shards the "
                          f"cache over those ranks (no data parallelism).")
    extra = sorted(set(given.get("train", {})) - {"device", "dtype"})
    if extra:
        raise ConfigError(f"longctx generate takes only --train.device and --train.dtype of [train]; "
                          f"{', '.join('train.' + k for k in extra)} does not apply.")
    if "init_from" in given.get("model", {}):
        raise ConfigError("longctx generate takes the weights from --checkpoint; drop --model.init_from.")
    given.setdefault("model", {})["init_from"] = args.checkpoint
    # (training's length rule, which the job's layout check asks; prompts are padded to it inside)
    unit = 2 * int(degrees.get("head", 1)) * int(degrees.get("ctx", 1))
    given.setdefault("train", {}).update(seq_len=unit, eval_interval=0)
    cfg = load_config(None, given)
    unread = unread_ms_poe_settings(cfg.model, given["model"])
    if unread:  # (the tokens would be plain RoPE's, not those of the positions asked for)
        raise ConfigError(unread)
    return cfg


def prepare(args, overrides: list[str]) -> GenerateRequest:
    """Check every input and tokenize the prompts, before any weight is read."""
    from .context_memory import check_prompts, memory_reach, memory_shape
    from .loading import check_window, dropless_notes, eos_ids
    from .output_paths import replacing_note
    from .prompts import read_prompts, tokenize_prompts, tokenizer_spec, with_turn_end
    from .settings import check_logprobs, check_run_flags

    sampling = _sampling(args)
    check_run_flags(args)  # (speculation's, a flag this run would ignore, --output)
    prompts = read_prompts(args)
    replacing = replacing_note(args.output)  # (said with the notes: before the weights, a Ctrl-C keeps the file)
    cfg = _config(args, overrides)
    check_logprobs(args.logprobs, cfg.model.vocab_size)
    spec = tokenizer_spec(args, cfg)
    if cfg.parallel.head > 1:
        from ..job.checks import check_heads

        check_heads(cfg.model.heads, cfg.model.kv_heads, cfg.parallel.head)
    memory = memory_shape(args, cfg)
    # InfLLM keeps every distance below its shape's reach: that sum, not the prompt, meets the model's
    reach = memory_reach(memory, cfg.model) if memory is not None else None
    tokenizer, limits, notes = tokenize_prompts(args, prompts, spec, cfg.model, reach)
    longest = max(len(p["ids"]) + n for p, n in zip(prompts, limits))  # (positions a prompt and its new tokens take)
    if memory is not None:
        check_prompts(memory, prompts)
    else:  # (the decode loop's rule, said before any weight is read: --allow-extrapolation does not move a window)
        check_window(cfg.model, longest, "generate")
    notes += dropless_notes("model", cfg.model) + ([replacing] if replacing else [])
    if args.stop:  # (a stop that could never match is refused here, not after the weights: output.py)
        from .output import StopStrings

        StopStrings(tokenizer, args.stop)
    eos = eos_ids(cfg.model.init_from, tokenizer)
    if args.chat and not args.ignore_eos:  # (an instruct model's end of turn ends the answer: prompts.py with_turn_end)
        eos, note = with_turn_end(eos, spec, tokenizer)
        notes += [note] if note else []
    request = GenerateRequest(cfg, tokenizer, spec, prompts, limits, eos, sampling, notes, memory=memory)
    if args.draft:
        from .drafts import draft_config, draft_notes

        request.draft_cfg = draft_config(args.draft, args.checkpoint, args.speculate, cfg, spec, args.confidence_stop,
                                      args.draft_window, args.compile)
        request.notes += dropless_notes("draft", getattr(request.draft_cfg, "model", None))  # (GliDe: no MoE)
        request.notes += draft_notes(request.draft_cfg, longest)
    if args.cape:
        request.cape = _cape_table(args, sampling)
    return request


def _sampling(args):
    """The sampling settings (flags over hf:DIR's generation_config.json over longctx's defaults,
    generate/settings.py; args.max_new_tokens resolved too, args.generation_defaults says what came
    from the file), with every out-of-range value said at once."""
    from .sampling import Sampling
    from .settings import generation_config, greedy_filter_problem, read_generation_config, resolve, unapplied

    file, data = read_generation_config(args.checkpoint)
    fields, args.max_new_tokens, taken = resolve(args, generation_config(file, data))
    args.generation_defaults = ", ".join(taken)
    sampling = Sampling(**fields, seed=args.seed, min_new_tokens=args.min_new_tokens)
    # (keys the file sets that transformers would follow and longctx does not: said, never silently dropped)
    args.generation_unapplied = ", ".join(unapplied(data, not sampling.greedy, args.min_new_tokens))
    problems = sampling.problems()
    inert = greedy_filter_problem(args, sampling.temperature)
    if inert:
        problems.append(inert)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--prefill-chunk", args.prefill_chunk),
                        ("--batch", args.batch), ("--nproc", args.nproc), ("--num-samples", args.num_samples)):
        if value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if args.num_samples > 1 and sampling.greedy:
        problems.append(f"--num-samples {args.num_samples} with greedy decoding would write {args.num_samples} copies "
                        f"of one continuation (as transformers, which refuses it); sample with --temperature > 0")
    if args.min_new_tokens > args.max_new_tokens >= 1:  # (a --max-new-tokens below 1 is said above)
        problems.append(f"--min-new-tokens {args.min_new_tokens} is more than --max-new-tokens {args.max_new_tokens}")
    if args.logprobs is not None and args.logprobs < 0:
        problems.append(f"--logprobs must be >= 0 (0: the chosen token's only), got {args.logprobs}")
    if any(s == "" for s in args.stop):
        problems.append("--stop needs a non-empty text")
    from .prompts import not_text

    problems += [f"--stop {s!r} {bad}, so no generated text could hold it; give it as UTF-8 text"
                 for s in args.stop if (bad := not_text(s))]
    if problems:
        if taken:
            problems.append(f"(from generation_config.json: {args.generation_defaults}; a flag overrides each)")
        raise ConfigError("; ".join(problems) + ".")
    return sampling


def _cape_table(args, sampling):
    """--cape's table; CaPE needs a draft to expand and greedy decoding to verify its tree."""
    from .cape import CapeTable

    if not args.draft:
        raise ConfigError("--cape expands a draft's proposals; give the draft with --draft DIR.")
    if not sampling.greedy:
        raise ConfigError("--cape verifies its tree greedily: use --temperature 0 (plain --draft speculation "
                          "also samples).")
    return CapeTable.parse(args.cape_table)


def main(args, overrides) -> int:
    from ..job.launch import check_launcher_env, refuse_scheduler_tasks, under_launcher
    from ..job.relaunch import argv_without_nproc, relaunch

    if under_launcher():  # a rank: the layout's size is the job's (its launcher's variables checked first)
        args.nproc = check_launcher_env()[1]
    else:
        refuse_scheduler_tasks()  # (`srun -n N longctx generate`: N whole jobs)
    request = prepare(args, overrides)  # every input error, before the weights are read (once, in the launcher)
    if args.nproc > 1 and not under_launcher():
        for note in request.notes:
            say(f"generate: note: {note}")
        relaunch(args.nproc, argv_without_nproc(args.argv))
        return 0
    if not under_launcher():
        for note in request.notes:
            say(f"generate: note: {note}")
        threads.fit_to_idle_cores()  # one process alone: as many threads as cores are idle
    return run(request, args)


def run(request: GenerateRequest, args) -> int:
    from ..job.launch import end_one_rank_group, finish_distributed
    from ..job.relaunch import note_finished

    try:
        code = _run(request, args)
    except BaseException:
        # (no barrier: an error of rank 0 alone, its stdout's reader gone, left the other ranks in the next step's
        # collective, and a barrier here waited for them for good; the error ends the job through the launcher)
        end_one_rank_group()
        raise
    note_finished()  # (a rank of `--nproc N`: its lines are out; a signal to the launcher from here on stops nothing)
    finish_distributed()
    return code


def _run(request: GenerateRequest, args) -> int:
    """Generate every prompt on this rank (every rank the same tokens); rank 0 writes the lines."""
    import torch

    from ..models.recompiles import RecompileWatch
    from .engine import generate
    from .loading import backend_for
    from .output import Output
    from .run_phase import counting, prompts_phase
    from .sampling import derive_seed, sample_seed

    backend, device, main_rank = backend_for(request.cfg)
    memory = None
    if request.memory is not None:  # (the warm-up below stays plain: 8 tokens hold no memory)
        from .context_memory import describe, memory_backend

        memory = memory_backend(request.memory, backend)
    model, step, draft = _models(request, args, device, backend, main_rank, memory is not None)
    samples = args.num_samples
    if memory is not None and main_rank:
        say(describe(memory, args.prefill_chunk))
    # --compile: a compile after the warm-up is a line (said) and counts in the output lines' compile_recompiles
    watch = RecompileWatch() if step else None
    # speculation and InfLLM (rows of one length): one prompt at a time
    size = 1 if draft is not None or memory is not None else args.batch
    eos = [] if args.ignore_eos else request.eos_ids
    # (--output is FILE.partial until the last line is in: output.py)
    # (and a phase: the prompts said while they run, their new tokens counted; run_phase.py)
    with Output(request.tokenizer, args.stop, args.output, len(request.prompts) * samples,
                sum(request.limits) * samples, main_rank, args.echo) as output, \
            prompts_phase(request.prompts, request.limits, samples) as progress:
        for start in range(0, len(request.prompts), size):
            batch = request.prompts[start:start + size]
            # each prompt's own seed, else one from the run's and its index in the file (generate/sampling.py)
            seeds = [p.get("seed", derive_seed(args.seed, start + i)) for i, p in enumerate(batch)]
            output.rows([p["ids"] for p in batch], 1 if draft is not None else samples)
            if draft is not None:
                results = [_speculate(request, args, model, draft, start, output.stops, backend,
                                      sample_seed(seeds[0], s), eos, s, step) for s in range(samples)]
            else:
                results = generate(model, [p["ids"] for p in batch], max_new_tokens=request.limits[start:start + size],
                                   sampling=request.sampling, eos_ids=eos, prefill_chunk=args.prefill_chunk,
                                   stop=output.stops, on_token=counting(output.on_token, progress), device=device,
                                   backend=memory or backend,
                                   seeds=seeds, num_samples=samples, logprobs=args.logprobs, compile=step)
            _note_recompiles(watch, results, start, main_rank)
            for i, r in enumerate(results):  # (prompt-major: a prompt's samples together)
                output.write(batch[i // samples], r, speculative=draft is not None, samples=samples)
                progress.update(len(r.tokens) if draft is not None else 0)  # (plain decoding's counted as chosen)
            output.flush()
            del results
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.output and main_rank:
        say(f"generate: wrote {args.output}")
    return 0


def _models(request: GenerateRequest, args, device, backend, main_rank: bool, one_row: bool):
    """The model (read, said on rank 0, warmed up), --compile's step and --draft's model (or None)."""
    from ..job.devices import resolve_dtype
    from .loading import load_model

    dtype = resolve_dtype(request.cfg.train.dtype, device)
    # (a phase, as eval's: an 8B model's read is minutes; its checksums and hf:DIR's weights counted in MB inside)
    with phase(f"generate: loading the model from {args.checkpoint}{step_read(args.checkpoint)}"):
        model = load_model(request.cfg, device, dtype)
    if main_rank:
        _say_run(request, args, device, dtype)
    step = _warm_up(request, args, model, device, backend, main_rank, one_row)
    draft = _load_draft(request, args, model, device, dtype, main_rank)
    if step and draft is not None:  # (the verifications' buckets and the draft's steps, before the first timing)
        _warm_up_draft(step, model, draft, request, args, backend)
    return model, step, draft


def _warm_up_draft(step, model, draft, request: GenerateRequest, args, backend) -> None:
    """--compile with a draft: the verifications' buckets and the draft's steps compiled before the first timing."""
    from .local import LocalGeneration
    from .speculative import warm_up

    warm_up(step, model, draft, args.speculate, request.cape, isinstance(backend, LocalGeneration),
            args.speculate_adaptive)


def _note_recompiles(watch, results, start: int, main_rank: bool) -> None:
    """The compiles since the last batch (after the warm-up, which compiles what the run's shapes need): each
    said with its function and the guard that failed, their count on each of the batch's results. Past dynamo's
    recompile limit the step's copy decodes eagerly where its graphs do not serve (models/compiled_copies.py,
    which warns once): said as such. (watch None: no --compile.)"""
    from ..models.recompiles import recompile_limit

    if watch is None:
        return
    recompiles = watch.take()
    for r in results:
        r.compile_recompiles = len(recompiles)
    if not main_rank:
        return
    for r in recompiles:
        if r.limit_hit:
            say(f"generate: --compile: {r.function} reached torch._dynamo's recompile limit ({recompile_limit()}) "
                f"in the batch from prompt {start + 1} (the guard that failed: {r.reason}); it decodes eagerly from "
                f"now on wherever its compiled graphs do not serve a call: the same tokens, at eager speed.")
            continue
        say(f"generate: --compile: {r.function} compiled again for the batch from prompt {start + 1} (the guard "
            f"that failed: {r.reason}); the warm-up is meant to compile every graph the run needs, so each "
            f"recompile is a compile inside a timed generation (its decode_tokens_per_s) and counts towards "
            f"torch._dynamo's recompile limit ({recompile_limit()}). Without --compile the run decodes eagerly.")


def _warm_up(request: GenerateRequest, args, model, device, backend, main_rank: bool, one_row: bool = False):
    """One tiny generation first, so the first prompt's rates do not include the kernels' first-call
    setup; returns --compile's step (one for the run: its graphs shared by every prompt and the draft),
    else False. Compiled, a graph is made per batch size: one tiny generation per row count a batch of the
    run has (`one_row`: the run decodes one prompt at a time), else the first batch's timing held one."""
    from ..models.static_decode import CompiledStep
    from .engine import generate
    from .local import LocalGeneration

    step = CompiledStep() if args.compile else False
    ids, n = request.prompts[0]["ids"][:8], len(request.prompts)
    size = 1 if one_row or args.draft else args.batch
    rows = {min(size, n - start) * (1 if args.draft else args.num_samples) for start in range(0, n, size)}
    # (a cache sharded over ranks decodes eagerly: nothing to compile per row count)
    counts = sorted({1} | rows) if step and isinstance(backend, LocalGeneration) else [1]
    for count in counts:  # (the run's sampling and logprobs: plain decoding's compiled step chooses the token too)
        generate(model, [ids] * count, max_new_tokens=2, device=device, backend=backend, compile=step,
                 sampling=request.sampling, logprobs=args.logprobs)
    if step and main_rank:
        say(f"generate: --compile: {step.calls} decode step(s) ran compiled in the warm-up" if step.calls else
            "generate: --compile: this model decodes eagerly (MoE, or a cache sharded over ranks)")
    return step


def _say_run(request: GenerateRequest, args, device, dtype) -> None:
    """What rank 0 says before generating: the run (_describe), and the decoding settings generation_config.json
    gave or that longctx does not apply."""
    say(_describe(request, args, device, dtype))
    if getattr(args, "generation_defaults", ""):
        say(f"generate: defaults from generation_config.json: {args.generation_defaults} (a flag overrides each)")
    if getattr(args, "generation_unapplied", ""):
        say(f"generate: note: generation_config.json also sets {args.generation_unapplied}, which longctx does "
            f"not apply (transformers' generate would): the tokens may differ from the model's intended decoding")


def _describe(request: GenerateRequest, args, device, dtype) -> str:
    """The line rank 0 says before generating: the model (config/model_name.py model_line: its name, parameters and
    the checkpoint's step read), where, dtype, prompts, tokenizer."""
    from ..costs.model_states import model_said

    m, p = request.cfg.model, request.cfg.parallel
    where = f"{p.head * p.ctx} ranks (head {p.head} x ctx {p.ctx}, the cache sharded)" if p.head * p.ctx > 1 else \
        device.type
    cpu = f", {threads.describe()}" if device.type == "cpu" else ""
    return (f"generate: {model_said(m, args.checkpoint)}, on {where} "
            f"({str(dtype).removeprefix('torch.')}{cpu}), "
            f"{len(request.prompts)} prompt{'s' * (len(request.prompts) > 1)}, tokenizer {request.tokenizer_spec}")


def _load_draft(request: GenerateRequest, args, model, device, dtype, main_rank: bool):
    """--draft's model (None without one), said on rank 0."""
    if request.draft_cfg is None:
        return None
    from .drafts import draft_label, load_draft

    draft = load_draft(request.draft_cfg, model, device, dtype)
    if main_rank:
        per_pass = f"{args.speculate} proposals per target pass"
        if args.speculate_adaptive:
            from .spec_length import draft_cost_ratio

            cost = args.draft_cost if args.draft_cost is not None else draft_cost_ratio(model, draft)
            per_pass = (f"up to {args.speculate} proposals per target pass, each round's chosen from those kept so "
                        f"far (draft cost {cost:.3g} of a target pass, verification {args.verify_cost or 0:.3g} per "
                        f"extra token; 0 proposals, a plain step, where none pays)")
        say(f"generate: speculative decoding with {draft_label(request.draft_cfg, args.draft, draft)}, "
             f"{per_pass}, one prompt at a time")
    return draft


def _speculate(request: GenerateRequest, args, model, draft, index: int, stops, backend, seed: int, eos,
               sample: int = 0, step=False):
    """Prompt `index` generated by speculative decoding (--draft; CaPE's tree with --cape), its draws
    from `seed` (the prompt's, or its sample's)."""
    from .speculative import speculate_one

    result = speculate_one(model, draft, request.prompts[index]["ids"], request.limits[index], k=args.speculate,
                           sampling=request.sampling, eos_ids=eos, prefill_chunk=args.prefill_chunk, stop=stops,
                           backend=backend, cape=request.cape, stop_below=args.confidence_stop,
                           window=args.draft_window, seed=seed, logprobs=args.logprobs, compile=step,
                           adaptive=args.speculate_adaptive, draft_cost=args.draft_cost,
                           verify_cost=args.verify_cost or 0.0)
    result.sample = sample
    return result
