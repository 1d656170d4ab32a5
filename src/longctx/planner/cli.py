"""`longctx plan`: the command (cli.py only registers it; planner/arguments.py holds its flags).

The words are the glossary's (docs/architecture.md): --seq-len (tokens per sequence),
--global-batch (sequences per optimizer step over the whole job), --micro-batch (sequences per
data-parallel rank in one forward/backward), --recompute (activation recomputation policies),
--hardware (a hardware preset or TOML file). The parser takes no abbreviations, so no other flag
(an old --seq, say) is ever read as one of these.

Imports beyond argparse are inside the functions on purpose: cli.py builds this parser for every
`longctx` command, and the planner's modules load torch (memory accounting), which would cost
every other command (`longctx data build` above all) its memory and seconds of startup.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

from ..errors import ConfigError
from .arguments import DEFAULT_OUT, add_arguments, expert_skew, int_list, offload_fractions, take_override


def build_request(args, overrides):
    from ..config import load_config, parse_overrides
    from ..costs.hardware import calibrate, load_hardware
    from .request import Request

    model = f"--model.init_from={args.model}" if args.model.startswith("hf:") else f"--model.preset={args.model}"
    overrides, replicas = _expert_replicas(args, overrides)
    overrides, ranks_per_node = _expert_ranks_per_node(overrides)
    named = [o for o in overrides if o.split("=")[0] in ("--model.preset", "--model.init_from")]
    if named:  # (the later one won: `--model llama3-8b --model.preset=debug` planned the debug model)
        raise ConfigError(f"longctx plan takes the model from --model ({args.model}); drop {named[0].split('=')[0]} "
                          f"(--model names a preset, or hf:DIR).")
    _check_model_flag(args.model)
    base = _with_store(getattr(args, "store", None), model, overrides, load_config(None, [model, *overrides]))
    if args.gpus is None:
        raise ConfigError("longctx plan needs --gpus N (the number of GPUs, i.e. ranks), e.g. --gpus 64.")
    seq_len = _seq_len(args.seq_len)
    if args.calibrate and args.hardware:
        raise ConfigError("give --calibrate (plan for this machine, measured) or --hardware, not both.")
    _check_outputs(args)
    # a calibration (--calibrate, or --hardware cpu-measured) is for the plan's ranks on this machine
    world = max(1, min(args.gpus, args.gpus_per_node))
    if args.calibrate:
        hw = calibrate(world=world)
        if args.calibrate_out:
            Path(args.calibrate_out).write_text(hw.to_toml())
        if args.hw:
            from ..costs.hardware import apply_overrides, parse_kv

            hw = apply_overrides(hw, parse_kv(args.hw))
    else:
        hw = load_hardware(args.hardware or "h100", args.hw, world=world)
        _check_calibration_world(hw, args, world)
    _check_precision(base.train.dtype, hw)
    settings = run_settings(base)
    _check_planned_keys(base, load_config(None, [model]), parse_overrides(overrides))
    chunks = int_list(args.loss_chunk, "--loss-chunk") if args.loss_chunk else (0, 4096)
    block_chunks = int_list(args.block_chunk, "--block-chunk")
    recomputes = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
    store = getattr(args, "store", None)  # (else the store the plan will train, when --data.path names one)
    doc_work, doc_work_source = _doc_work(store or base.data.path or None, seq_len, base.data.doc_mask,
                                          "--store" if store else "data.path", base.model.vocab_size)
    req = Request(base.model, hw, args.gpus, seq_len, gpus_per_node=args.gpus_per_node,
                  global_batch=args.global_batch, micro_batches=int_list(args.micro_batch, "--micro-batch", 1),
                  recomputes=recomputes,
                  model_states=tuple(x.strip() for x in args.model_states.split(",") if x.strip()),
                  offload_fractions=offload_fractions(args.offload), offload_skip_last=args.offload_skip_last,
                  loss_chunks=chunks, block_chunks=block_chunks, doc_mask=base.data.doc_mask,
                  doc_work=doc_work, doc_work_source=doc_work_source,
                  expert_degrees=int_list(args.expert, "--expert", 1) if args.expert else None,
                  expert_skew=expert_skew(args.expert_skew),
                  expert_chunks=int_list(args.expert_chunk, "--expert-chunk"), expert_replicas=replicas,
                  expert_ranks_per_node=ranks_per_node,
                  allow=tuple(x.strip() for x in args.allow.split(",") if x.strip()),
                  co2_local_steps=int_list(args.co2_local_steps, "--co2-local-steps", 1), settings=settings)
    return req, base


def _seq_len(given: str | None) -> int:
    """--seq-len's tokens ("1M", "131072"), refused with the flag named when missing or not a token count."""
    from .request import parse_tokens

    if given is None:
        raise ConfigError("longctx plan needs --seq-len TOKENS, e.g. --seq-len 1M or --seq-len 131072.")
    try:
        return parse_tokens(given)
    except ConfigError as e:  # (the flag named: "'4k8' is not a token count" said of which)
        raise ConfigError(f"--seq-len {e}") from None


def _check_model_flag(model: str) -> None:
    """--model is a preset or hf:DIR (refused as model.preset, a key this command does not take, by the config)."""
    from ..config.presets import MODEL_PRESETS

    if not model.startswith("hf:") and model not in MODEL_PRESETS:
        raise ConfigError(f"--model {model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor hf:DIR; pass one "
                          f"of those.")


def _expert_replicas(args, overrides: list[str]) -> tuple[list[str], tuple[int, ...]]:
    """(the overrides but parallel.expert_replicas, the copy slots to try): --expert-replicas, or the override
    itself, which fixes them (costed: planner/expert_copies.py). It is taken out of the base config, which has
    expert 1 and refused it ("set parallel.expert > 1"); the written plan carries the chosen value."""
    from ..config import parse_overrides

    rest, text = take_override(list(overrides), "parallel.expert_replicas")
    if text is None:
        return rest, int_list(getattr(args, "expert_replicas", "0"), "--expert-replicas")
    if getattr(args, "expert_replicas", "0") != "0":
        raise ConfigError(f"--parallel.expert_replicas={text} fixes the copy slots and --expert-replicas "
                          f"{args.expert_replicas} tries some: give one of them.")
    return rest, (parse_overrides([f"--parallel.expert_replicas={text}"])["parallel"]["expert_replicas"],)


def _expert_ranks_per_node(overrides: list[str]) -> tuple[list[str], int]:
    """(the overrides but parallel.expert_ranks_per_node, its value or 0): hierarchical dispatch, tried beside the
    flat exchange where it splits an expert degree into whole nodes (costed: planner/expert_nodes.py). Taken out of
    the base config, which has expert 1 and refused it ("set parallel.expert > 1"); the written plan carries it where
    the chosen layout is hierarchical."""
    from ..config import parse_overrides

    rest, text = take_override(list(overrides), "parallel.expert_ranks_per_node")
    if text is None:
        return rest, 0
    return rest, parse_overrides([f"--parallel.expert_ranks_per_node={text}"])["parallel"]["expert_ranks_per_node"]


def _check_calibration_world(hw, args, world: int) -> None:
    """A CPU calibration read back from a file (--calibrate-out, then --hardware FILE) gives each process the
    memory and FLOP/s of the number of processes it was measured for: reused for a plan of another number of
    ranks on this machine, each rank would be planned with another share of it (a 1-process calibration
    planned 2 ranks with all of the RAM each, a plan that train's preflight then refused). Refused unless
    --hw memory_gib says what each rank has."""
    from ..costs.hardware import calibrated_world, parse_kv

    measured = calibrated_world(hw)
    if measured is None or measured == world or "memory_gib" in parse_kv(args.hw):
        return
    raise ConfigError(
        f"--hardware {args.hardware} is a calibration of this machine for {measured} process(es) (each with 1/"
        f"{measured} of its memory, {hw.memory_gib:.4g} GiB, and of its cores), but this plan puts {world} ranks "
        f"on it: calibrate for them (--calibrate --gpus {args.gpus} --calibrate-out FILE, or --hardware "
        f"cpu-measured), or give each rank's memory with --hw memory_gib=GIB.")


def _with_store(store: str | None, model: str, overrides, base):
    """`base`, and with --store DIR the base that trains DIR: the plan's attention work is DIR's documents,
    so its written config reads them (data.path; data.tokenizer auto then is the store's). Without it the
    config trained data.corpus (the stdlib by default), not the documents the plan was costed on. A
    --data.path naming another store is refused: the plan would cost one store and the run train the other, as
    is a mix of stores (data/store_mix.py): the plan costs one store's documents."""
    from ..config.data_mix import is_mix

    if is_mix(base):
        raise ConfigError(f"--data.path={base.data.path} mixes several stores, but a plan costs the attention work of "
                          f"one store's documents: plan with --store naming the mix's store of longest documents (and "
                          f"no --data.path), then train the mix with the layout the plan writes.")
    if not store:
        return base
    from ..config import load_config

    root = Path(store).resolve()
    if base.data.path and Path(base.data.path).resolve() != root:
        raise ConfigError(f"--store {store} gives the plan the attention work of its documents, but --data.path="
                          f"{base.data.path} would train another store's: give --store alone (the written config "
                          f"then trains it, as data.path), or the same store to both.")
    return load_config(None, [model, *overrides, f"--data.path={root}"])


def _check_outputs(args) -> None:
    """--top, and the files written (--out, --calibrate-out), checked before planning or calibrating: a
    write that fails only after the search (a directory, a missing one) or a --calibrate-out that
    nothing would write."""
    top = getattr(args, "top", 10)
    if top < 1:  # (0 printed an empty table; -1 every row but the last)
        raise ConfigError(f"--top is the number of rows of the ranked table, at least 1; got {top}.")
    if getattr(args, "calibrate_out", None) and not args.calibrate:
        raise ConfigError(f"--calibrate-out {args.calibrate_out} writes what --calibrate measures; add --calibrate, "
                          f"or drop it.")
    if getattr(args, "no_write", False) and getattr(args, "out", DEFAULT_OUT) != DEFAULT_OUT:  # (else dropped)
        raise ConfigError(f"--out {args.out} names where the plan is written, and --no-write writes none; drop one "
                          f"of them.")
    from ..costs.hardware import is_hardware_file
    from ..durable import check_output_path

    hardware = getattr(args, "hardware", None)
    inputs = {"--hardware": hardware} if hardware and is_hardware_file(hardware) else {}
    calibrate_out = getattr(args, "calibrate_out", None)
    check_output_path("--calibrate-out", calibrate_out or "", inputs)
    if not getattr(args, "no_write", False):  # (the plan after the calibration: not over it)
        check_output_path("--out", getattr(args, "out", None) or "", {**inputs, "--calibrate-out": calibrate_out})


def run_settings(base):
    """The settings of the base config (the user's overrides) that the written plan keeps and that
    change its memory or time, as the cost model takes them; those it cannot cost are refused here,
    before planning, rather than written into a plan whose figures would not hold."""
    from .cost import RunSettings

    t, p = base.train, base.parallel
    if t.stages:
        raise ConfigError(
            f"train.stages = {t.stages!r} would train other lengths and batches than the plan's one --seq-len, "
            f"which is all it costs. Plan the longest stage (--seq-len and --global-batch of that stage), then "
            f"add train.stages to the written config yourself (dropping its train.seq_len), or plan without it.")
    if p.grad_bucket_blocks == 0:
        raise ConfigError(
            "parallel.grad_bucket_blocks = 0 lets the run choose its blocks per FSDP unit when it starts, which the "
            "plan cannot cost (a larger unit gathers more weights at once); give the number of blocks per unit "
            "(the plan counts that many, 1 by default) or leave it out.")
    return RunSettings(async_checkpoint=base.checkpoint.async_save, co2_outer_momentum=t.co2_outer_momentum > 0,
                       co2_overlap_steps=t.co2_overlap_steps, grad_bucket_blocks=p.grad_bucket_blocks,
                       zero_pp_block=p.zero_pp_block)


# what the plan chooses and writes (output.py plan_config) -> the plan's own flag for it
PLANNED_KEYS = {
    **{f"parallel.{k}": "--gpus and --gpus-per-node" for k in ("dp_replicate", "dp_shard", "head", "ctx", "window",
                                                                "placement", "zero_pp", "ranks_per_node", "hpz_ranks")},
    "parallel.expert": "--expert", "memory.recompute": "--recompute", "memory.offload_fraction": "--offload",
    "memory.offload_skip_last": "--offload-skip-last", "memory.loss_chunk": "--loss-chunk",
    "memory.block_chunk": "--block-chunk", "memory.expert_chunk": "--expert-chunk",
    **{f"memory.{k}": "none: it tries its own" for k in ("attention_chunk", "attention_offload", "grad_sync")},
    "memory.model_states": "--model-states", "train.seq_len": "--seq-len", "train.global_batch": "--global-batch",
    "train.grad_accum": "--micro-batch", "train.data_parallel": "--allow co2",
    "train.co2_local_steps": "--co2-local-steps",
}


def _check_planned_keys(base, default, overrides: dict | None = None) -> None:
    """An override of a setting the plan chooses would be overwritten in the written config without a
    word (a `--train.data_parallel=co2` written as a sync plan, say): refused, with the plan's own flag.
    `default`: the model's config without the overrides; `overrides`: the ones given ({section: {key: value}}),
    refused at their default value too (`--memory.recompute none` was written as the plan's selective)."""
    from ..config import to_dict

    given, default = to_dict(base), to_dict(default)
    named = {f"{section}.{key}" for section, values in (overrides or {}).items() for key in values}
    changed = [key for key in PLANNED_KEYS if key in named
               or given[key.split(".")[0]][key.split(".")[1]] != default[key.split(".")[0]][key.split(".")[1]]]
    if changed:
        raise ConfigError("the plan chooses " + "; ".join(f"{k} (its flag: {PLANNED_KEYS[k]})" for k in changed)
                          + ": an override of it would be overwritten in the written config. Drop "
                          + ("it" if len(changed) == 1 else "them") + ".")


DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # train.dtype -> bytes per activation element and gathered parameter


def _check_precision(dtype: str, hw) -> None:
    """Every activation and gather figure of the plan is in the hardware's dtype_bytes, and the written
    config keeps train.dtype as given: one given in another precision would hold other bytes than
    predicted (fp32 on bf16 hardware: twice the activations), so it is refused."""
    if DTYPE_BYTES.get(dtype, hw.dtype_bytes) != hw.dtype_bytes:
        raise ConfigError(f"train.dtype = {dtype} trains with {DTYPE_BYTES[dtype]} bytes per activation, but "
                          f"hardware {hw.name} is planned with dtype_bytes = {hw.dtype_bytes}: pass --hw "
                          f"dtype_bytes={DTYPE_BYTES[dtype]} (and the peak of that precision, --hw peak_tflops=...), "
                          f"or leave train.dtype auto.")


def _doc_work(store: str | None, seq_len: int, doc_mask: bool, flag: str = "--store",
              vocab_size: int | None = None) -> tuple[float, str]:
    """(doc_work, where it comes from) for the request: measured on the samples of the store `flag` names
    (--store, or the data.path the plan trains), else 1.0. The store is checked to fit the run the plan
    writes (its length and the model's vocabulary) with or without document masks."""
    if store:
        from .documents import store_manifest

        store_manifest(store, seq_len, vocab_size, flag)
    if not doc_mask:
        return 1.0, "data.doc_mask = false: plain causal attention" + (f", {flag} not used" if store else "")
    if not store:
        return 1.0, "no --store: one document per sequence assumed"
    from .documents import store_doc_work

    work, used, total = store_doc_work(store, seq_len, flag=flag)
    return work, f"from {flag} {store}: {used:,} of {total:,} train samples of {seq_len:,} tokens"


def _write_best(res, base, args) -> tuple[str | None, str]:
    """(where the best plan `longctx train` accepts was written, or None; a note when a better predicted
    plan does not pass the config and layout checks)."""
    from ..config import load_config
    from .output import plan_config, runnable, toml_text

    req, note = res.request, ""
    for est in res.feasible:
        cfg = plan_config(est, req, base)
        why = runnable(cfg, est.mesh_shape.world)
        if not why:
            if args.no_write:
                return None, note
            Path(args.out).write_text(toml_text(cfg, est, req))
            load_config(args.out, [])  # what we wrote loads (the config validates it)
            return str(args.out), note
        if not note:
            note = (f"the best predicted plan ({est.mesh_shape.describe()}, {est.policy.describe()}) cannot run "
                    f"in this version: {why}")
    return None, note


def _check_fixed_cases(args, overrides) -> None:
    """--validate and --anchors run their own fixed cases (planner/validate.py, planner/anchors.py) and read
    no request: a --model / --gpus / --seq-len (or a config override) beside them was ignored without a word,
    and their figures read as if they were of that request. Refused, naming what would be ignored."""
    modes = [flag for flag, on in (("--validate", args.validate), ("--anchors", args.anchors)) if on]
    if not modes:
        return
    if len(modes) > 1:
        raise ConfigError("--validate and --anchors are two separate runs of fixed cases: give one of them.")
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = [f"--{key.replace('_', '-')}" for key, value in defaults.items()
             if key not in ("validate", "anchors") and getattr(args, key, value) != value]
    cases = ("planner/validate.py: small models on CPU processes" if args.validate else
             "planner/anchors.py: published requests")
    if given or overrides:
        raise ConfigError(f"{modes[0]} runs its own fixed cases ({cases}) and would ignore "
                          f"{', '.join([*given, *overrides])}: run `longctx plan {modes[0]}` alone, or plan the "
                          f"request without {modes[0]}.")


def main(args, overrides) -> int:
    _check_fixed_cases(args, overrides)
    if args.validate:
        from .validate import main as validate_main

        return validate_main(args)
    if args.anchors:
        from .anchors import main as anchors_main

        return anchors_main(args)
    # a plan is hundreds of thousands of small objects that live to the end (footprints, the ranking's heap) and
    # make no reference cycles: the cyclic collector's passes over them were a quarter of a large plan's time
    # (qwen3-30b-a3b on 512 GPUs: 14.9 -> 11.2 CPU s) and freed nothing; it runs again once the plan is printed
    with paused_gc():
        return _plan(args, overrides)


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off inside, as it was after (reference counting still frees everything
    that is not in a cycle; a cycle made inside is collected by the first pass after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(args, overrides) -> int:
    """`longctx plan` for a request: search, print the table (or JSON), write the best plan."""
    from ..costs.hardware import hardware_names
    from .link_report import report_text
    from .output import memory_legend, micro_batch_note, table, to_json
    from .search import plan, request_error

    req, base = build_request(args, overrides)
    if not args.hardware and not args.calibrate:
        # stderr: stdout stays the table or pure JSON
        print(f"plan: no --hardware given, planning for {req.hardware.name} (the default); pass --hardware with a "
              f"preset ({', '.join(hardware_names())}) or a TOML file, or --calibrate to plan for this machine",
              file=sys.stderr)
    if req.seq_len > base.model.max_seq_len and any(o.startswith("--model.max_seq_len") for o in overrides):
        raise ConfigError(f"--seq-len {req.seq_len} exceeds the --model.max_seq_len you gave "
                          f"({base.model.max_seq_len}).")
    why = request_error(req)
    if why:  # (not "fits": no candidate exists to fit)
        raise ConfigError(f"nothing to plan for {req.model.label} at {req.seq_len:,} tokens on {req.gpus} GPUs: {why}.")
    res = plan(req)
    best = res.best
    written, note = _write_best(res, base, args) if best is not None else (None, "")
    if args.json:
        print(to_json(res, args.top, written, note))
    else:
        print(table(res, args.top))
        print(memory_legend(res, args.top))
        mb_note = micro_batch_note(res, args.top)  # (a MoE objective that depends on the micro-batch's size)
        if mb_note:
            print(mb_note)
        if req.gpus > req.gpus_per_node or req.allow:
            print("\n".join(report_text(res)))
        if note:
            print(f"note: {note}")
        if written:
            print(f"wrote the best runnable plan to {written}")
    if best is None:
        why = "; ".join(res.suggestions) or "no layout fits"
        raise ConfigError(
            f"no plan for {req.model.label} at {req.seq_len:,} tokens fits on {req.gpus} x {req.hardware.name}: "
            f"{why}.")
    return 0
