"""`longctx` command line: train, eval, generate, data, report, checkpoint, plan, bench.

Config overrides are passed as `--section.key=value` (or `--section.key value`) after the
subcommand; `longctx train --help` lists every key with its default.

Every command's modules are imported inside the functions here, on purpose: the parser is built for
every command, and most of them load torch (~220 MB, seconds), which `longctx data build` in
bounded memory must not.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from . import threads
from .errors import ConfigError, Preempted, UserError


def _config_help() -> str:
    from .config import SECTIONS, Config, fields_by_key, to_dict

    defaults = to_dict(Config())
    lines = ["config keys (override with --section.key=value):"]
    for section, cls in SECTIONS.items():
        for key, f in fields_by_key(cls).items():
            choices = f.metadata.get("choices")
            extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
            lines.append(f"  --{section}.{key} (default {defaults[section][key]!r}){extra}: {f.metadata['help']}")
    return "\n".join(lines)


def _cmd_train(args, overrides) -> int:
    from .config import to_toml
    from .config.layout import resolve_layout
    from .job.launch import check_launcher_env, default_nproc, launched_by_us, refuse_scheduler_tasks, under_launcher

    if args.nproc is not None and args.nproc < 1:  # (0 read as "not given" ran the default 4 ranks)
        raise ConfigError(f"--nproc must be >= 1 (1 = this process), got {args.nproc}.")
    if len(args.config or []) > 1:  # (argparse kept the last: `--config base.toml --config mine.toml` lost base)
        raise ConfigError(f"--config takes one file, got {len(args.config)}: {', '.join(args.config)}; files are "
                          f"not merged (put every key in one file, or give the others as --section.key=value).")
    args.config = args.config[0] if args.config else None
    launcher = under_launcher()
    if launcher:
        check_launcher_env()  # (a rank outside the world waited on the rendezvous until its timeout)
    else:
        refuse_scheduler_tasks()  # (`srun -n N longctx train`: N whole jobs in one run directory)
    if launcher and args.nproc:
        print(f"longctx train: note: --nproc {args.nproc} is ignored under torchrun, which started "
              f"{os.environ['WORLD_SIZE']} ranks", file=sys.stderr)
    if not launcher and not args.print_config:  # (an explicit resume of a step a killed re-save left moved aside:
        from .config.load import read_raw  # put back before the config, layout and preflight read it: moved_aside.py)
        from .train.moved_aside import put_back_resumed

        put_back_resumed(read_raw(args.config, overrides).get("checkpoint", {}).get("resume"))
    # the layout rule (config/layout.py): the saved run's on a resume unless this command names one,
    # else the command line's, completed by the default layout; what a resume prints is what runs
    run = resolve_layout(args.config, overrides, args.nproc, world=int(os.environ["WORLD_SIZE"]) if launcher else None,
                         saved_world=_saved_world, default_nproc=lambda c: default_nproc(c.train.device))
    cfg, overrides, nproc = run.cfg, run.overrides, run.nproc
    from .config.positions import refuse_ms_poe_in_training

    refuse_ms_poe_in_training(cfg.model)  # (a position option of generate and eval only)
    launching = not launcher and not args.print_config
    said = run.resumed.describe() if run.resumed is not None else run.unfound
    if said and not (launcher and (os.environ["RANK"] != "0" or launched_by_us())):
        # once: by the launching process, or rank 0 under torchrun directly (--print-config: stdout is the TOML)
        print(said, file=sys.stderr if args.print_config else sys.stdout)
    if run.note and launching:
        print(f"longctx train: note: {run.note}", file=sys.stderr)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    from .train.preemption import command_clock

    with command_clock():  # checkpoint.exit_after_minutes counts from the command's start, preflight included
        return _train(args, overrides, cfg, nproc, launching, run.resumed is not None)


def _train(args, overrides, cfg, nproc: int, launching: bool, resumed: bool) -> int:
    """`longctx train` once its config is known: the preflight and a relaunch on `nproc` ranks, or this rank's run."""
    from .job.relaunch import note_finished, relaunch
    from .train.trainer import train

    if launching and resumed:
        finished = _finished_run(cfg)
        if finished:  # said before any data or model is built
            print(finished)
            return 0
    if launching:
        from .train.preflight import preflight

        preflight(cfg, nproc)  # every error that can be found before a rank starts, found once, here
        if nproc > 1:
            from .config.rules import parse_signals

            relaunch(nproc, ["train", *(["--config", args.config] if args.config else []), *overrides],
                     forward=parse_signals(cfg.checkpoint.on_signal))  # (the launcher passes them on to the ranks)
            return 0
    from .job.launch import finish_distributed

    threads.fit_to_idle_cores()  # one process alone (ranks have their share): as many threads as cores are idle
    try:
        train(cfg, preflighted=launching)  # (a rank of a relaunch, launching False, is under the launcher)
    except Preempted:
        finish_distributed()  # every rank stopped at the same step, after the same save
        raise
    note_finished()  # (a rank of `--nproc N`: its run is whole; a signal to the launcher from here on stops nothing)
    finish_distributed()
    return 0


def _saved_manifest(cfg) -> tuple[object, dict] | tuple[None, None]:
    """(the checkpoint a resume continues from, its manifest), or (None, None); what is wrong with
    it, if anything, preflight says."""
    import json
    from pathlib import Path

    from .config.checkpoint_paths import MANIFEST, moved_aside
    from .train.setup import resume_target

    try:
        target = resume_target(cfg, Path(cfg.train.run_dir))
        return (target, json.loads((target / MANIFEST).read_text())) if target else (None, None)
    except UserError:  # (a step a killed re-save moved aside: the run puts it back first, moved_aside.py, so its
        old = moved_aside(cfg.checkpoint.resume)  # manifest is the one --print-config and the ranks go by)
    except (OSError, ValueError):
        return None, None
    try:
        return (Path(cfg.checkpoint.resume), json.loads((old / MANIFEST).read_text())) if old else (None, None)
    except (OSError, ValueError):
        return None, None


def _saved_world(cfg) -> int | None:
    """The number of ranks that wrote the checkpoint a resume continues from (a resume without
    --nproc runs on as many, so the saved layout fits)."""
    try:
        return int(_saved_manifest(cfg)[1]["layout"]["world"])
    except (KeyError, TypeError, ValueError):
        return None


def _finished_run(cfg) -> str | None:
    """The done line of a resume with nothing left to train (its checkpoint is at train.steps)."""
    target, manifest = _saved_manifest(cfg)
    try:
        step = int(manifest["step"])
    except (KeyError, TypeError, ValueError):
        return None
    if step < cfg.train.steps:
        return None
    return (f"done: nothing to train: {target} is step {step}, and train.steps is {cfg.train.steps}; a larger "
            f"--train.steps continues the run from there.")


def _cmd_report(args, overrides) -> int:
    if overrides:
        raise UserError(f"longctx report takes only a run directory; unexpected arguments: {' '.join(overrides)}.")
    from .train.report import write_plots

    try:
        written = write_plots(args.run_dir)
    except OSError as e:  # (a run directory this user may read but not write: another's, or a read-only copy)
        raise UserError(f"{e.filename or args.run_dir}: {e.strerror or e}. `longctx report` reads the run's metrics "
                        f"and writes its plots into the run directory; copy the run somewhere writable and report "
                        f"that copy.") from e
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_bench(args, overrides) -> int:
    if overrides:
        # (a usage error, as argparse's own for a flag it does not know: exit code 2)
        raise ConfigError(f"unexpected arguments for longctx bench {args.bench}: {' '.join(overrides)}; "
                          f"`longctx bench {args.bench} --help` lists its flags.")
    from .bench import attention, comm_cluster, decode, generate, memory, moe, train
    from .bench.arg_checks import check_bench_args

    check_bench_args(args.bench, args)  # (every size, before a model is built or a rank started)
    return {"attention": attention.main, "train": train.main, "memory": memory.main, "moe": moe.main,
            "generate": generate.main, "decode": decode.main, "comm": comm_cluster.main}[args.bench](args)


def _cmd_checkpoint(args, overrides) -> int:
    if overrides:
        raise UserError(f"unexpected arguments for longctx checkpoint: {' '.join(overrides)}.")
    _refuse_unread_checkpoint_flags(args)
    if args.action == "verify":
        from .checkpoint.verify_command import run as verify_checkpoint

        return verify_checkpoint(args.path)
    out = _checkpoint_out(args)
    if args.action == "import":
        from .checkpoint.gguf_import import run as import_gguf

        return import_gguf(args.path, out, args.dtype, args.force)
    if args.dtype == "auto":
        raise UserError("--dtype auto is for longctx checkpoint import; export takes --dtype fp32 or bf16 and writes "
                        "into OUT.")
    if args.to != "hf":
        raise UserError(f"--to {args.to}: only 'hf' export is available.")
    if not out:
        raise UserError("longctx checkpoint export needs an output directory: "
                        "longctx checkpoint export PATH OUT --to hf.")
    _check_export_args(out, args.max_shard_gb)
    import torch

    from .checkpoint.export import export_hf
    from .config.checkpoint_paths import step_read

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or "fp32"]
    out, copied, why, notes = export_hf(args.path, out, dtype=dtype,
                                        max_shard_bytes=int(args.max_shard_gb * 2**30))
    # (the step exported, as generate and eval say it: a checkpoints directory whose `latest` names a step that is
    # missing or incomplete exports the newest complete one, an older step than asked, which was said nowhere)
    print(f"wrote {out} from {args.path}{step_read(args.path)} ({args.dtype or 'fp32'}; "
          + (f"tokenizer files: {', '.join(copied)})" if copied else f"no tokenizer files: {why})"))
    for note in notes:
        print(f"note: {note}")
    return 0


# the flags of `longctx checkpoint` that only some actions read: (attribute, default, the actions that read it); a
# flag at its default is no mistake (--dtype auto, which export does not take, is _cmd_checkpoint's to refuse)
EXPORT_FORMAT, MAX_SHARD_GB = "hf", 5.0
_ACTION_FLAGS = {"OUT": ("out", None, ("export", "import")), "--out": ("out_option", None, ("export", "import")),
                 "--dtype": ("dtype", None, ("export", "import")), "--force": ("force", False, ("import",)),
                 "--to": ("to", EXPORT_FORMAT, ("export",)),
                 "--max-shard-gb": ("max_shard_gb", MAX_SHARD_GB, ("export",))}


def _refuse_unread_checkpoint_flags(args) -> None:
    """A flag the action does not read, refused: `verify runs/a runs/b` verified a alone and printed OK (b was
    taken for OUT), and verify or import ran past --to, --max-shard-gb, ... without a word."""
    unread = [(flag, getattr(args, name), actions) for flag, (name, default, actions) in _ACTION_FLAGS.items()
              if args.action not in actions and getattr(args, name) != default]
    if not unread:
        return
    said = "; ".join((f"{value} (OUT, the output directory)" if flag == "OUT" else
                      flag if value is True else f"{flag} {value}") + f" is for {' and '.join(actions)}"
                     for flag, value, actions in unread)
    one = " (verify checks one checkpoint: verify each in a command of its own)" if args.action == "verify" else ""
    raise UserError(f"{said}, not {args.action}{one}: drop {'it' if len(unread) == 1 else 'them'}.")


def _check_export_args(out: str, max_shard_gb: float) -> None:
    """What export_hf would find wrong only after reading every weight (or never: --max-shard-gb 0 wrote
    each tensor to a file of its own)."""
    from .durable import file_in_the_way

    if not (0 < max_shard_gb < float("inf")):
        raise UserError(f"--max-shard-gb {max_shard_gb}: expected a size in GiB above 0, e.g. 5 (the default).")
    blocker = file_in_the_way(Path(out))
    if blocker is not None:
        raise UserError(f"export: OUT {out} cannot be a directory: {blocker} is a file. Pass a directory to write "
                        f"(it is created).")


def _checkpoint_out(args) -> str | None:
    """OUT of export / import, given as the second argument or as --out (not two different ones)."""
    if args.out and args.out_option and args.out != args.out_option:
        raise UserError(f"two output directories: {args.out} and --out {args.out_option}; pass one.")
    return args.out or args.out_option


def _cmd_plan(args, overrides) -> int:
    from .planner.cli import main as plan_main

    return plan_main(args, overrides)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command` given (the first argument), the `bench` subcommands' arguments are
    only declared when that command is bench: their modules import torch, which costs every other
    command (`data build` in bounded memory above all) ~220 MB and seconds of startup. (That is why
    the commands' modules are imported inside the functions of this file.)"""
    parser = argparse.ArgumentParser(prog="longctx", description="Train decoder LLMs on very long contexts.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    p = sub.add_parser("report", help="write PNG plots of loss and throughput for a run directory")
    p.add_argument("run_dir", help="a run directory written by `longctx train`")
    p.set_defaults(func=_cmd_report)
    _add_checkpoint(sub)
    from .planner.cli import add_arguments as plan_arguments

    p = sub.add_parser("plan", help="choose layout, recomputation, offload and micro-batch; write the best as a config",
                       allow_abbrev=False)
    plan_arguments(p)
    p.set_defaults(func=_cmd_plan)
    from .data.cli import add_parser as add_data_parser

    add_data_parser(sub)
    from .eval.command import add_parser as add_eval_parser

    add_eval_parser(sub)
    from .generate.flags import add_parser as add_generate_parser

    add_generate_parser(sub)
    if command not in (None, "bench") and not command.startswith("-"):
        sub.add_parser("bench", help="benchmarks; each prints JSON")
        return parser
    _add_bench(sub.add_parser("bench", help="benchmarks; each prints JSON").add_subparsers(dest="bench", required=True))
    return parser


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (the debug model on the Python standard library by default)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_config_help(),
        allow_abbrev=False,
    )
    p.add_argument("--config", action="append", help="TOML config file (e.g. configs/debug.toml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to start through torchrun (default: the checkpoint's on a resume, the "
                        "layout's when it names every degree, else 4 on CPU as head 2 x ctx 2 and every GPU on a "
                        "GPU machine; 1 = this process)")
    p.add_argument("--threads", type=int, default=None, help=threads.HELP)
    p.set_defaults(func=_cmd_train)


def _add_checkpoint(sub) -> None:
    p = sub.add_parser("checkpoint", help="verify a checkpoint, export it to Hugging Face format, or import a GGUF "
                       "file as a Hugging Face directory", allow_abbrev=False)
    p.add_argument("action", choices=("verify", "export", "import"))
    p.add_argument("path", help="verify / export: a step-* checkpoint directory, or a checkpoints directory (its "
                                "latest); import: a .gguf file (or hf:FILE.gguf, or a directory holding one)")
    p.add_argument("out", nargs="?", help="export / import: the output directory (or --out)")
    p.add_argument("--out", dest="out_option", metavar="DIR", help="export / import: the output directory")
    p.add_argument("--to", default=EXPORT_FORMAT, help="export format (hf)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "auto"),
                   help="weight precision; export: fp32 (default) or bf16; import: auto (default: bf16 when every "
                        "weight is exactly a bf16 value, else fp32), fp32 or bf16")
    p.add_argument("--force", action="store_true", help="import: replace a non-empty output directory")
    p.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_GB,
                   help="export: largest safetensors file in GiB; above it, shards with an index")
    p.set_defaults(func=_cmd_checkpoint)


def _add_bench(bench) -> None:
    from .bench import attention, comm_cluster, memory, moe
    from .bench import decode as decode_bench
    from .bench import generate as generate_bench
    from .bench import train as train_bench

    for name, module, what in (
        ("attention", attention, "2D sequence-parallel attention vs one attention call (gloo, CPU)"),
        ("train", train_bench, "training tokens/s and MFU of parallel layouts (same-run comparison)"),
        ("memory", memory, "activation bytes per block and token for each memory policy, measured vs analytic, "
                           "recompute FLOPs, step-time ratios"),
        ("moe", moe, "Mixture-of-Experts feed-forward vs the dense SwiGLU of the same active parameters: CPU "
                     "seconds per token, uniform and skewed routing, saved-for-backward bytes per token"),
        ("generate", generate_bench, "KV-cache decoding vs transformers' greedy generate on the same random model "
                                     "(decode and prefill tokens/s, same run); --compile both: the compiled decode "
                                     "step vs eager on the debug model"),
        ("decode", decode_bench, "speculative decoding (a draft model, optionally CaPE) vs plain decoding: tau, "
                                 "acceptance, tokens/s, speedup, identical output (same run)"),
        ("comm", comm_cluster, "the slow-link modes (fsdp, ZeRO++'s hpz / qwz / qgz, co2) on an emulated cluster: "
                               "step and exposed seconds, bytes across and inside nodes per step"),
    ):
        p = bench.add_parser(name, help=what, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(func=_cmd_bench)


def _check_environment() -> None:
    """The LONGCTX_ variables, each parsed by its reader's function (docs/running.md, "Environment variables"):
    a bad value refused here, before the command's work, not where it is read (a heartbeat, a decode, a save)."""
    from . import cache_dir, env_vars, faults, progress

    env_vars.check_environment()
    progress.interval_s()
    cache_dir.cache_root()
    faults.check()


def main(argv=None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        threads.configure(given)  # before anything loads torch: OpenMP reads its settings once
        if not {"-h", "--help"} & set(given):  # (help reads none of them: it is how to learn what they take)
            _check_environment()  # longctx's own variables, also those read lazily: refused before any work
    except UserError as e:
        print(f"longctx: error: {e}", file=sys.stderr)
        return e.exit_code
    parser = build_parser(given[0] if given else None)
    args, rest = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a relaunch on N ranks runs again
    try:
        return args.func(args, rest)
    except UserError as e:
        from .job.relaunch import hand_error_to_launcher

        if hand_error_to_launcher(str(e), e.exit_code):
            return e.exit_code  # `longctx train --nproc N` prints it, once for all the ranks that hit it
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        kind = "stopped" if isinstance(e, Preempted) else "error"  # a preemption is no failure
        command = f"{args.command} {args.bench}" if getattr(args, "bench", None) else args.command  # (bench X)
        text = f"{prefix}longctx {command}: {kind}: {e}"
        # (lines wrapped at spaces only: a path or flag in the message stays whole, to copy; broken at its hyphens,
        # a run directory such as runs/20261205-141302-debug read 'runs/20261205- 141302-debug')
        print("\n".join(textwrap.fill(line, width=100, break_on_hyphens=False, break_long_words=False)
                        for line in text.splitlines()), file=sys.stderr)
        return e.exit_code
    except Exception as e:
        from .job.lost_peer import lost_a_peer
        from .job.relaunch import another_rank_reported, note_crash, note_lost_peer

        if another_rank_reported():  # the launcher prints the error that stopped the job; this is its echo
            sys.stdout.flush()
            os._exit(1)  # at once: an interpreter teardown beside half-closed process groups can abort loudly
        if lost_a_peer(e) and note_lost_peer(e):  # a peer went away (a signal to it alone): the launcher names it
            print(f"[rank {os.environ.get('RANK')}] longctx {args.command}: lost a peer mid-collective "
                  f"({' '.join(str(e).split())[:300]}); the launcher says which rank ended first, and how.",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)  # (as the echo above)
        note_crash()  # (the launcher names the rank whose error came first: its traceback, printed next)
        raise
    except KeyboardInterrupt:
        from .job.launch import launched_by_us

        if not launched_by_us():  # (a rank of `--nproc N`: its launcher says it once, for every rank)
            print(f"longctx {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
