"""`longctx bench decode`: speculative decoding against plain decoding, same models, prompts and run.

    longctx bench decode --target runs/T/checkpoints --draft runs/D/checkpoints --lengths 1024,8192 \\
        --max-new-tokens 128 [--cape [true|false|both]] [--speculate-adaptive [true|false|both]] \\
        [--prompts FILE.jsonl | --data STORE] [--temperature T]

For each prompt: plain decoding (generate/engine.py) and speculative decoding (generate/speculative.py,
the draft a plain model with its own cache or a GliDe draft reading the target's; with --cape, CaPE's
tree; with --cape both, the chain and CaPE; with --speculate-adaptive, K chosen each round up to
--speculate: generate/spec_length.py; with --speculate-adaptive both, fixed and adaptive K, and with
both flags `both`, all four), timed one after the other on one device, --repeats
times in turn, the best of each (modes compared in one process: separate processes differ by up to
~15% at equal work). Prompts: --prompts (text, tokenized with the target's
tokenizer), else the first documents of --data's eval split (default: the default corpus; or a glob of
held-out text files, each one document) that hold the longest of --lengths, one span each, cut to
every length by its last tokens: the prompts of every length continue the same text.
JSON on stdout, per length and overall:
- tau: tokens emitted per target pass, the replaced or bonus token included; tau_without_bonus: kept
  proposals emitted per pass (not a last pass's kept past the end); acceptance_rate: kept proposals
  (all) over proposals made;
- tokens_per_s (speculative) and baseline_tokens_per_s (plain): new tokens per second of decoding
  (all but the first, which the prefill's logits give), i.e. over the wall time after the target's
  prefill (the same work in both; a draft's own pass over the prompt comes after it and counts), and
  their ratio `speedup`; `speedup_with_prefill`: the ratio of the whole generations' wall times,
  which a long prompt's prefill pulls toward 1;
- identical: at temperature 0, whether every prompt's tokens equal plain decoding's; null when
  sampling (speculative sampling keeps plain sampling's distribution, not its seeded tokens: issue 34's
  chi-square test is the check there);
- mean_k: the K chosen per target pass (--speculate every pass for a fixed K; the proposals made,
  proposals_per_pass, are fewer where a confidence stop ends a round); plain_step_share: the passes
  adaptive K made plain decoding steps (K = 0: no K paid, by --draft-cost and --verify-cost);
- with_cape (--cape both): CaPE's table (`cape`), figures and by_length; the top level is the chain's;
  with_adaptive (--speculate-adaptive both): adaptive K's figures and by_length (draft_cost: its c),
  the top level fixed K's; with_cape_adaptive: CaPE with adaptive K (both flags `both`);
- by_length[i].per_prompt: each prompt's tau, acceptance_rate, tokens/s, speedup and identical.
With --compile, plain decoding, the target's verifications and a plain draft's steps run through the
compiled static-shape step (models/static_decode.py), compiled before the timings; `identical` then
compares compiled speculative decoding with compiled plain decoding.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date
from types import SimpleNamespace

import torch

from .. import strict_json
from ..errors import ConfigError
from ..job.devices import code_record
from ..progress import speaker


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="DIR|hf:DIR", help="the target model's checkpoint")
    p.add_argument("--draft", required=True, metavar="DIR|hf:DIR", help="the draft model's checkpoint")
    p.add_argument("--speculate", type=int, default=4,
                   help="proposals per target pass (default 4); with --speculate-adaptive, the most")
    p.add_argument("--speculate-adaptive", nargs="?", const="true", default="false", choices=("true", "false", "both"),
                   help="each round's K chosen up to --speculate from the proposals kept so far "
                        "(generate/spec_length.py); `both`: fixed and adaptive K in turn, each against the same "
                        "plain runs (adaptive's figures under with_adaptive)")
    p.add_argument("--draft-cost", type=float, default=None, metavar="C",
                   help="with --speculate-adaptive: a draft step's cost over one target pass (default: the models' "
                        "forward FLOPs per token ratio)")
    p.add_argument("--verify-cost", type=float, default=None, metavar="W",
                   help="with --speculate-adaptive: a verification's cost per token past the first, in target "
                        "passes (default 0; K = 0, a plain step, where no K pays)")
    p.add_argument("--confidence-stop", type=float, default=0.0, metavar="P",
                   help="end a round's proposals after one the draft gives below P (0 = always --speculate)")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="a GliDe draft's own pass over only the last N prompt tokens (0 = all; default: the length "
                        "it was trained on)")
    p.add_argument("--cape", nargs="?", const="true", default="false", choices=("true", "false", "both"),
                   help="CaPE's tree instead of the chain (temperature 0); `both`: the chain and CaPE in turn, "
                        "each against the same plain runs (CaPE's figures under with_cape)")
    p.add_argument("--cape-table", default="0.3:3,0.6:2,0.9:1,1:0", help="CaPE's confidence table")
    p.add_argument("--prompts", default="", metavar="FILE.jsonl", help='prompts, one {"prompt": ...} per line')
    p.add_argument("--data", default="", help="a store (its eval split), a text file or a quoted glob of text files "
                                             "('DIR/**/*.py') for prompts (default: the default corpus)")
    p.add_argument("--lengths", default="1024", help="prompt lengths in tokens, comma-separated, e.g. 1K,8K (without "
                                                        "--prompts); a document's prompts all end at the same token")
    p.add_argument("--samples", type=int, default=2, help="prompts per length, one per document (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each, the best counts (default 1)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where both models run (auto: a GPU when there is one)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the models' dtype (fp32: `identical` then compares like with like)")
    p.add_argument("--tokenizer", default="", help="the tokenizer (default: the target checkpoint's)")
    p.add_argument("--compile", nargs="?", const="true", default="false", choices=("true", "false"),
                   help="plain decoding, the target's verifications and a plain draft's steps through the compiled "
                        "static-shape step (models/static_decode.py; CUDA graphs on a GPU), compiled by an untimed "
                        "first run of each mode")


say = speaker("[bench decode] ")


def _models(args):
    """The target's and the draft's configs (the draft checked against the target), the tokenizer."""
    from ..config import load_config
    from ..config.checkpoint_paths import check_weights_flag
    from ..config.tokenizer import checkpoint_tokenizer, model_tokenizer, unchecked_tokenizer
    from ..data.tokenizer import load_tokenizer
    from ..generate.drafts import draft_config
    from ..generate.prompts import check_tokenizer_vocab
    from ..generate.spec_length import check_adaptive_flags

    check_weights_flag(args.target, "--target")  # (in the flag's words, not as model.init_from)
    cfg = load_config(None, {"model": {"init_from": args.target}, "train": {"seq_len": 2, "eval_interval": 0}})
    # --tokenizer, else the target's; refused when it is not the one the target's weights trained with (generate's)
    spec = checkpoint_tokenizer(cfg.model.init_from, args.tokenizer or None, model_tokenizer(cfg.model.init_from))
    unchecked = unchecked_tokenizer(cfg.model.init_from, args.tokenizer or None)
    if unchecked:
        say(f"note: {unchecked}")
    if spec is None:
        raise ConfigError(f"--target {args.target} names no tokenizer; pass --tokenizer byte|PATH/tokenizer.json.")
    check_adaptive_flags(args.draft, args.speculate, args.speculate_adaptive != "false", args.draft_cost,
                         args.verify_cost)
    draft = draft_config(args.draft, args.target, args.speculate, cfg, spec, args.confidence_stop, args.draft_window,
                         args.compile == "true")
    tokenizer = load_tokenizer(spec)
    # (generate's: its ids past the embedding are not the model's)
    check_tokenizer_vocab(tokenizer, spec, cfg.model, f"--target {args.target}")
    return cfg, draft, tokenizer, spec


def _prompts(args, tokenizer, spec, m=None) -> dict[int | str, list[list[int]]]:
    """The prompts, by length (or "prompts": --prompts'); with `m` (the target's ModelConfig), each with its ids
    within the target's vocabulary (generate/prompts.py check_prompt_ids) and --max-new-tokens checked within the
    window of its weights (the decode loop's rule, generate/loading.py check_window), so that it is said before
    any weight is read, and a note on lengths past the positions the target reaches (config/positions.py; eval's
    note): decoded there, its tokens are extrapolation."""
    from ..eval.request import reach_notes
    from ..generate.loading import check_window
    from ..generate.prompts import check_prompt_ids

    prompts = _read_prompts(args, tokenizer, spec)
    if m is not None:
        for length, rows in prompts.items():  # (generate's check: an id past the embedding, after both models load)
            for i, ids in enumerate(rows):
                check_prompt_ids(f"prompt {i + 1}" + (f" of length {length}" if length != "prompts" else ""), ids,
                                 spec, m)
        longest = max(len(ids) for rows in prompts.values() for ids in rows)
        check_window(m, longest + args.max_new_tokens, "bench decode")
        lengths = sorted({len(ids) for rows in prompts.values() for ids in rows})
        # (bench decode takes no --model.* flags: no RoPE scaling to suggest)
        for note in reach_notes(m, lengths, args.max_new_tokens, "figure", extend=False):
            say(f"note: {note}")
    return prompts


def _read_prompts(args, tokenizer, spec) -> dict[int | str, list[list[int]]]:
    from ..data.default_store import default_store
    from ..errors import ConfigError, DataError
    from ..eval.tasks import load_source, parse_lengths
    from ..generate.prompts import not_text, read_prompts

    if args.prompts:
        from ..config.tokenizer import model_text_prefix

        rows = read_prompts(SimpleNamespace(prompt=None, prompts=args.prompts))
        for i, row in enumerate(rows):  # (generate's check: the byte tokenizer read it as '?', an HF one raised)
            if bad := not_text(row["text"]):
                raise ConfigError(f"--prompts {args.prompts}: prompt {i + 1} {bad}; give it as UTF-8 text.")
        prefix = model_text_prefix(args.target, tokenizer)  # (as `longctx generate` prompts it: its BOS, say)
        prompts = [prefix + list(map(int, tokenizer.encode(r["text"]))) for r in rows]
        if not all(prompts):  # (else the prefill's ValueError, after both models have loaded)
            raise ConfigError(f"--prompts {args.prompts}: prompt {prompts.index([]) + 1} has no tokens; give each "
                              f"line some text.")
        return {"prompts": prompts}

    def store():
        from ..config import DataConfig
        from ..data.default_store import trained_grid

        # held out on the grid of the target's own training data (eval/inputs.py): prompts it never trained on
        return default_store(DataConfig(tokenizer=spec), 1024, progress=False, log=say, announce_cached=False,
                             holdout_tokens=trained_grid(args.target))

    lengths = parse_lengths(args.lengths)
    if args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: ask for at least one prompt per length.")
    source = load_source(args.data, "eval", tokenizer, store)
    if source.tokenizer_spec:  # (a store's ids: the target's tokenizer's, by content, as eval checks them)
        from ..eval.inputs import check_store_tokenizer

        check_store_tokenizer(args.data or "(default corpus)", source, spec)
    longest, spans = max(lengths), []
    for doc in source.documents():  # one span per document: prompts as unlike as the texts allow
        if len(doc) >= longest:
            spans.append(doc[:longest].tolist())
            if len(spans) == args.samples:
                break
    if not spans:
        raise DataError(f"bench decode at {longest} tokens needs a document of that many tokens; "
                        f"{source.description} has none. Pass --data with longer texts or shorter --lengths.")
    if len(spans) < args.samples:  # (the JSON's "prompts" says so too; a silent shortfall reads as noise)
        say(f"{source.description} holds {len(spans)} documents of {longest} tokens or more, not the "
             f"{args.samples} asked; pass --data with more or longer texts (a glob of held-out files) for more")
    # every length's prompt ends where the longest one does: all continue the same text, so lengths
    # differ only in how much context comes before it
    return {n: [span[-n:] for span in spans] for n in lengths}


def main(args) -> int:
    from ..generate.drafts import draft_label, draft_notes, load_draft
    from ..generate.engine import generate
    from ..generate.loading import dropless_notes, load_model
    from ..generate.sampling import Sampling
    from ..generate.spec_length import draft_cost_ratio
    from ..job.devices import resolve_device, resolve_dtype

    if args.repeats < 1:  # (0 timed runs: no figure, only an empty minimum or an infinite time)
        raise ConfigError(f"--repeats {args.repeats}: time at least one run (e.g. --repeats 3).")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    dtype = resolve_dtype(args.dtype, device)
    cfg, draft_cfg, tokenizer, spec = _models(args)
    modes = _modes(args)
    sampling = Sampling(args.temperature, seed=args.seed)
    sampling.check()
    if any(cape is not None for cape, _ in modes) and not sampling.greedy:
        raise ConfigError("--cape verifies greedily: use --temperature 0.")
    prompts = _prompts(args, tokenizer, spec, cfg.model)
    longest = max(len(ids) for rows in prompts.values() for ids in rows)
    notes = [*dropless_notes("model", cfg.model), *dropless_notes("draft", getattr(draft_cfg, "model", None)),
             *draft_notes(draft_cfg, longest + args.max_new_tokens)]  # (generate's notes: figures they qualify)
    for note in notes:
        say(f"note: {note}")
    target = load_model(cfg, device, dtype)
    draft = load_draft(draft_cfg, target, device, dtype)
    args.cost = args.draft_cost if args.draft_cost is not None else draft_cost_ratio(target, draft)
    n, d = cfg.model.layers, len(draft.layers)
    say(f"target {cfg.model.label} ({n} layer{'s' * (n != 1)}), draft {draft_label(draft_cfg)} "
         f"({d} layer{'s' * (d != 1)}), K = {args.speculate}{_MODE_SAID[args.cape]}"
         f"{_ADAPTIVE_SAID[args.speculate_adaptive].format(c=args.cost)}")
    first = next(iter(prompts.values()))[0]
    generate(target, [first[:8]], max_new_tokens=2)  # kernels' first-call setup, outside the timings
    tables = [cape for cape, _ in modes if cape is not None]
    args.compiled = _compiled_step(args, target, draft, tables[0] if tables else None) \
        if args.compile == "true" else None
    if args.compiled is not None:  # the plain runs' step, its choice in the graph (generate/blocks.py), untimed
        generate(target, [first[:8]], max_new_tokens=2, sampling=sampling, compile=args.compiled)
    groups, everything = _run_lengths(args, target, draft, prompts, sampling, modes)
    print(strict_json.dumps(_result(args, device, draft, modes, groups, everything), indent=1))
    return 0


def _result(args, device, draft, modes: list[tuple], groups: list, everything: list) -> dict:
    """The JSON: the run's settings, the first mode's figures and each other mode's (the same plain runs)."""
    from ..generate.drafters import draft_window
    from ..models.clover import CloverDraft
    from ..models.glide import GlideDraft

    result = {"benchmark": "decode", "date": date.today().isoformat(), "machine": platform.machine(),
              "torch": torch.__version__, "code": code_record(), "threads": torch.get_num_threads(),
              "device": _device_name(device), "dtype": args.dtype, "target": args.target, "draft": args.draft,
              "speculate": args.speculate, "cape": args.cape_table if modes[0][0] else None,
              "speculate_adaptive": modes[0][1], "draft_cost": args.cost if modes[0][1] else None,
              "verify_cost": (args.verify_cost or 0.0) if modes[0][1] else None,
              "confidence_stop": args.confidence_stop,
              "draft_window": (draft_window(draft, args.draft_window) if isinstance(draft, (GlideDraft, CloverDraft))
                               else args.draft_window),
              "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "compile": args.compile,
              **_figures(everything[0]), "by_length": groups[0]}
    for m, (cape, adaptive) in enumerate(modes[1:], 1):  # each other mode's figures (same plain runs)
        key = "with_cape_adaptive" if cape and adaptive else "with_cape" if cape else "with_adaptive"
        result[key] = {**({"cape": args.cape_table} if cape else {}),
                       **({"draft_cost": args.cost, "verify_cost": args.verify_cost or 0.0} if adaptive else {}),
                       **_figures(everything[m]),
                       "by_length": groups[m]}
    return result


def _modes(args) -> list[tuple]:
    """The speculative modes timed, each against the same plain runs: (CaPE's table or None for the
    chain, adaptive K or not); the first is the JSON's top level."""
    from ..generate.cape import CapeTable

    table = CapeTable.parse(args.cape_table) if args.cape != "false" else None
    capes = {"false": [None], "true": [table], "both": [None, table]}[args.cape]
    adaptive = {"false": [False], "true": [True], "both": [False, True]}[args.speculate_adaptive]
    return [(cape, a) for cape in capes for a in adaptive]


def _run_lengths(args, target, draft, prompts: dict, sampling, modes: list) -> tuple[list, list]:
    """Every prompt of every length in each mode: per mode, its by_length entries and its totals."""
    groups, everything = [[] for _ in modes], [dict(_ZERO) for _ in modes]
    for length, rows in prompts.items():
        g, each = [dict(_ZERO) for _ in modes], [[] for _ in modes]
        for ids in rows:
            for m, timed in enumerate(_time_prompt(args, target, draft, ids, sampling, modes)):
                # (per prompt too: a length's figure can rest on a few prompts' very different texts)
                each[m].append({k: v for k, v in _figures(timed).items() if k in _PER_PROMPT})
                for acc in (g[m], everything[m]):
                    for key, value in timed.items():
                        acc[key] = _all_identical(acc[key], value) if key == "identical" else acc[key] + value
        for m, (cape, adaptive) in enumerate(modes):
            groups[m].append({"prompt_tokens": length, "prompts": len(rows), **_figures(g[m]), "per_prompt": each[m]})
            said = f"{' CaPE' if cape else ''}{' adaptive' if adaptive else ''}"
            say(f"{length}{said}: tau {groups[m][-1]['tau']:.2f}, mean K {groups[m][-1]['mean_k']:.2f}, speedup "
                 f"{groups[m][-1]['speedup']:.2f}x, identical {groups[m][-1]['identical']}")
    return groups, everything


def _compiled_step(args, target, draft, table):
    """--compile: one CompiledStep with every bucket a verification (chain or CaPE tree) and the plain
    draft's steps use compiled before any timing (a GliDe draft decodes eagerly; generate/speculative.py
    warm_up, as `longctx generate --compile --draft` does)."""
    from ..generate.speculative import warm_up
    from ..models.static_decode import CompiledStep

    step = CompiledStep()
    warm_up(step, target, draft, args.speculate, table, adaptive=args.speculate_adaptive != "false")
    return step


def _clock(device: torch.device):
    """time.perf_counter, after the device's queued work (a GPU's kernels run after their launch)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"


_PER_PROMPT = ("tau", "acceptance_rate", "mean_k", "tokens_per_s", "baseline_tokens_per_s", "speedup", "identical")
_MODE_SAID = {"false": "", "true": ", CaPE", "both": ", the chain and CaPE"}
_ADAPTIVE_SAID = {"false": "", "true": " (at most: adaptive, draft cost {c:.3g})",
                  "both": ", fixed and adaptive (draft cost {c:.3g})"}
_ZERO = {"kept": 0, "unused": 0, "proposed": 0, "chosen": 0, "plain_steps": 0, "passes": 0, "spec_s": 0.0,
         "plain_s": 0.0, "spec_all": 0.0, "plain_all": 0.0, "tokens": 0, "plain_tokens": 0, "identical": True}


def _time_prompt(args, target, draft, ids: list[int], sampling, modes: list) -> list[dict]:
    """One prompt, plain then each speculative mode ((CaPE's table or None, adaptive K)), --repeats
    times in turn, the best of each: what the figures sum, per mode. A run's decoding time is its
    wall time less the target's prefill (the same work in every run)."""
    # (imported when run, as in main: the CLI's parser imports this module)
    from ..generate.drafters import drafter_for
    from ..generate.engine import generate
    from ..generate.spec_length import AdaptiveLength
    from ..generate.speculative import speculative_generate

    clock = _clock(target.tok_embeddings.weight.device)
    compiled = getattr(args, "compiled", None) or False  # (main's CompiledStep under --compile)
    plain_s = plain_all = float("inf")
    spec_s, spec_all, specs = [float("inf")] * len(modes), [float("inf")] * len(modes), [None] * len(modes)
    chosen, plain_steps = [0] * len(modes), [0] * len(modes)
    for _ in range(args.repeats):
        t0 = clock()
        plain = generate(target, [ids], max_new_tokens=args.max_new_tokens, sampling=sampling,
                         compile=compiled)[0]
        elapsed = clock() - t0
        plain_all, plain_s = min(plain_all, elapsed), min(plain_s, elapsed - plain.prefill_seconds)
        for m, (cape, adaptive) in enumerate(modes):
            length = AdaptiveLength(args.speculate, args.cost, verify_cost=args.verify_cost or 0.0) \
                if adaptive else False
            t0 = clock()
            drafter = drafter_for(target, draft, len(ids) + args.max_new_tokens + args.speculate + 2,
                                  window=args.draft_window, compile=compiled)
            specs[m] = speculative_generate(target, drafter, ids, max_new_tokens=args.max_new_tokens,
                                            k=args.speculate, sampling=sampling, cape=cape,
                                            stop_below=args.confidence_stop, compile=compiled, adaptive=length)
            elapsed = clock() - t0
            spec_all[m], spec_s[m] = min(spec_all[m], elapsed), min(spec_s[m], elapsed - specs[m].prefill_seconds)
            # the K of every pass (one per round: the policy's choices, or --speculate each time)
            chosen[m] = sum(length.chosen) if adaptive else args.speculate * specs[m].passes
            plain_steps[m] = length.chosen.count(0) if adaptive else 0  # adaptive K's K = 0 rounds
    return [{"kept": sum(spec.accepted), "unused": spec.unused, "proposed": sum(spec.proposed), "chosen": chosen[m],
             "plain_steps": plain_steps[m], "passes": spec.passes,
             "spec_s": spec_s[m], "plain_s": plain_s, "spec_all": spec_all[m], "plain_all": plain_all,
             "tokens": _decoded(spec), "plain_tokens": _decoded(plain),
             "identical": spec.tokens == plain.tokens if sampling.greedy else None}
            for m, spec in enumerate(specs)]


def _decoded(r) -> int:
    """Tokens a run's decoding produced after the prefill: all but the first, which the prefill's logits
    give (an EOS counts), as generate/results.py's decode_tokens_per_s counts them; the rates divide
    them by the time after the prefill, which does not include the first token's forward."""
    return max(0, len(r.tokens) + (r.finish_reason == "eos") - 1)


def _all_identical(so_far: bool | None, this: bool | None) -> bool | None:
    """Prompts' `identical` together: None (not compared: sampling) stays None."""
    return None if so_far is None or this is None else so_far and this


def _figures(acc: dict) -> dict:
    passes = max(acc["passes"], 1)
    spec_rate = acc["tokens"] / acc["spec_s"] if acc["spec_s"] else 0.0
    plain_rate = acc["plain_tokens"] / acc["plain_s"] if acc["plain_s"] else 0.0
    emitted = acc["kept"] - acc["unused"]  # (tau: tokens emitted; the acceptance rate: every kept proposal)
    return {"tau": (emitted + acc["passes"]) / passes, "tau_without_bonus": emitted / passes,
            "acceptance_rate": acc["kept"] / max(acc["proposed"], 1), "proposals_per_pass": acc["proposed"] / passes,
            "mean_k": acc["chosen"] / passes, "plain_step_share": acc["plain_steps"] / passes,
            "tokens_per_s": spec_rate,
            "baseline_tokens_per_s": plain_rate, "speedup": spec_rate / plain_rate if plain_rate else 0.0,
            "speedup_with_prefill": acc["plain_all"] / acc["spec_all"] if acc["spec_all"] else 0.0,
            "identical": acc["identical"]}
