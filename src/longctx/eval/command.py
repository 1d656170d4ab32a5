"""`longctx eval`: loss by position (ppl), pass-key and multi-key needle retrieval, under any layout.

    longctx eval --checkpoint runs/X/checkpoints --task passkey --lengths 1K,4K --depths 0,0.5,1
    longctx eval --checkpoint hf:DIR --task ppl --lengths 16K,32K --nproc 4 --parallel.ctx 4
    longctx eval --checkpoint runs/X/checkpoints --task passkey --lengths 4K --mode generate --nproc 4
    longctx eval --checkpoint runs/X/checkpoints --task ppl,passkey,needle --lengths 4K,16K --depths 0,0.5,1

Several tasks (comma-separated) run in one launch, in the order given, on weights read once (eval/task_list.py:
each task reads its own flags; the JSON is {"tasks": {TASK: that task's own result}} with what they share at its
top; one task's JSON is its result alone, as it always was).

--mode score (the default) scores the answer in one teacher-forced forward pass (right when every
answer token is the argmax); --mode generate (passkey/needle) lets the model answer: free greedy
generation (or sampled: --temperature, --top-k, --top-p, --min-p and the penalties of `longctx
generate`, each sequence seeded from --seed, its length, depth and sample) from the question with the
KV cache (generate/engine.py), right when the first run of digits it writes is the key. Generation
runs on one process or sharded over head x ctx ranks (generate/sharded.py, every rank the full
weights), so its layout has no data parallelism.

Everything that can be wrong with the input (task, lengths the layout cannot split, depths, a
missing tokenizer, a too-short text) is found before any rank starts: the launching process
prepares the sequences once, and every rank prepares the same ones again (cheap, deterministic); each
length's are kept only while that length is evaluated (eval/inputs.py LengthSequences).
The JSON result goes to stdout or --output; plots next to --output (or to --plot).

The work is in eval/request.py (the flags checked and the sequences built: EvalRequest), eval/inputs.py,
eval/layout_checks.py, eval/score_mode.py, eval/generate_mode.py and eval/results.py. The imports inside
functions are on purpose: `longctx` builds this command's parser for every command, and what eval runs
loads torch, which `longctx data build` must not.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .. import strict_json, threads
from ..errors import ConfigError, DataError
from ..generate.context_memory import add_flags as add_context_memory_flags
from ..generate.settings import add_sampling_flags
from ..progress import say
from .defaults import DEFAULT_BUCKETS, DEFAULT_DEPTHS
from .stopped import drop_stale_incomplete, keep_stopped, kept_where, replacing_note, terminated_raises, write_output
from .task_list import TASKS, combined_result, default_plot, parse_tasks, task_args

if TYPE_CHECKING:
    from .request import EvalRequest

# (eval/tasks.py is imported only when a command runs: building the CLI's parser must not import it, and
# torch with it, or every `longctx` command, `data build` included, pays ~220 MB for it; TASKS is task_list's)
MODES = ("score", "generate")


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint at long lengths: loss by position, passkey, needle "
                                    "(forward only, under any layout)", allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, metavar="DIR|hf:DIR",
                   help="a longctx checkpoint (a step-* directory, or a checkpoints directory for its latest) or "
                        "hf:DIR, a Hugging Face model directory")
    p.add_argument("--task", required=True, metavar="TASK[,TASK...]",
                   help=f"one of {', '.join(TASKS)}, or several comma-separated (e.g. ppl,passkey,needle: one "
                        "launch, the weights read once, the tasks run in that order, those of one --mode together, "
                        "the JSON {\"tasks\": {TASK: that task's own result}} in that order with what they share at "
                        "its top; a flag reaches the tasks that "
                        "read it). ppl: loss per position bucket; passkey: a 5-digit key hidden at each depth; "
                        "needle: several keyed 7-digit numbers hidden, one asked for")
    p.add_argument("--lengths", required=True, help="sequence lengths in tokens, e.g. 1K,4K,16K (K = 1024)")
    p.add_argument("--depths", default=DEFAULT_DEPTHS,
                   help=f"passkey/needle: where the needle sits, fractions of the filler (default {DEFAULT_DEPTHS})")
    # (None, not 0, when left out: an explicit --samples 0 is refused, not read as the task's default)
    p.add_argument("--samples", type=int, default=None,
                   help="sequences per length (ppl, default 8) or per length and depth (passkey/needle, default 5)")
    p.add_argument("--data", default="",
                   help="text to evaluate on (ppl) and take filler from (passkey/needle): a store directory, a "
                        "text file, or '' for the default corpus (data.corpus, stdlib)")
    p.add_argument("--split", default="eval", choices=("eval", "train"), help="the store split to use (default eval)")
    p.add_argument("--tokenizer", default="",
                   help="'byte' or PATH/tokenizer.json; default: the checkpoint's (its manifest, or hf:DIR's "
                        "tokenizer.json)")
    p.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS,
                   help=f"ppl: position buckets per length (default {DEFAULT_BUCKETS})")
    p.add_argument("--mode", default="score", choices=MODES,
                   help="passkey/needle: score (default): one teacher-forced forward pass, right when every answer "
                        "token is the argmax; generate: free greedy generation from the question, right when the "
                        "first run of digits generated is the answer (one process, or --nproc = --parallel.head x "
                        "--parallel.ctx: the cache sharded, no data parallelism)")
    # --mode generate decodes greedily unless these say otherwise (generate/settings.py; no generation_config.json
    # defaults: a benchmark stays greedy); each sequence's draws are seeded from --seed and its length, depth and
    # sample
    add_sampling_flags(p.add_argument_group("--mode generate sampling (default greedy, as longctx generate's flags)"))
    # --mode generate past the trained window: InfLLM's context memory (generate/context_memory.py), one process
    add_context_memory_flags(p.add_argument_group("--mode generate context memory (as longctx generate's flags)"))
    p.add_argument("--batch", type=int, default=0, help="sequences per forward (score) or prompts generated together "
                                                       "(generate) over the whole job (default: one per "
                                                       "data-parallel rank)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for keys and filler offsets, and with --mode generate's sampling flags of each "
                        "sequence's draws (from it and the sequence's length, depth and sample)")
    p.add_argument("--output", default="", help="write the JSON here (and the plot next to it) instead of stdout")
    p.add_argument("--plot", default="", help="the PNG to write (default: --output with .png)")
    p.add_argument("--nproc", type=int, default=1, help="local processes through torchrun (default 1)")
    p.add_argument("--threads", type=int, default=None, help=threads.HELP)
    p.set_defaults(func=main)


def _say_threads(cfg) -> None:
    """One process alone: its threads fit to the idle cores, said when it runs on the CPU."""
    from ..job.devices import resolve_device

    threads.fit_to_idle_cores()
    if resolve_device(cfg.train.device).type == "cpu":
        say(f"eval: {threads.describe()}")


def main(args, overrides) -> int:
    import dataclasses
    import time

    from ..costs.model_states import model_said
    from ..job.launch import check_launcher_env, refuse_scheduler_tasks, under_launcher
    from ..job.relaunch import argv_without_nproc, note_finished, relaunch
    from .request import prepare

    tasks = parse_tasks(args.task)  # (first: an unknown or repeated task before anything is read)
    if not under_launcher():
        refuse_scheduler_tasks()  # (`srun -n N longctx eval`: N whole jobs)
    nproc = check_launcher_env()[1] if under_launcher() else args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}.")
    args_list = task_args(args, tasks)
    # (every task's input checked, and its sequences built once, before any rank starts)
    requests = [prepare(own, overrides, nproc) for own in args_list]
    if len(requests) > 1:  # (progress lines name the task running, counted in the order they run)
        ran = {i: n for n, i in enumerate(i for run in _mode_runs(requests) for i in run)}
        requests = [dataclasses.replace(r, place=f"task {ran[i] + 1} of {len(requests)}")
                    for i, r in enumerate(requests)]
    if not under_launcher():  # (once: in the launcher, or the one process; a note several tasks share, once)
        say(f"eval: model {model_said(requests[0].cfg.model, args.checkpoint)}")
        replacing = replacing_note(args.output)  # (before work: a Ctrl-C then still keeps the file)
        notes = [note for request in requests for note in request.notes] + ([replacing] if replacing else [])
        for note in dict.fromkeys(notes):
            say(f"eval: note: {note}")
        if len(_mode_runs(requests)) > 1:
            say("eval: note: ppl is scored (--mode score) and --mode generate answers passkey/needle on another "
                "model: the weights are read twice, once for each mode's tasks")
    if nproc > 1 and not under_launcher():
        relaunch(nproc, argv_without_nproc(args.argv), kept=kept_where(args.output))
        return 0
    if not under_launcher():
        _say_threads(requests[0].cfg)
    start = time.perf_counter()
    try:
        with terminated_raises():  # (a SIGTERM keeps the finished lengths too, as an error or Ctrl-C does)
            parts = evaluate_tasks(requests, args_list)
    except BaseException as e:  # (the lengths finished are kept, or it is said that none was: eval/stopped.py)
        keep_stopped(requests, args, e, time.perf_counter() - start)
        raise
    if parts is not None:  # rank 0
        _write(combined_result(parts, requests[0].lengths, time.perf_counter() - start), args)
        for part, own in zip(parts, args_list):
            _write_plot(part, own)
    note_finished()  # (a rank of `--nproc N`: its part is done; a signal to the launcher from here on stops nothing)
    return 0


def _write(result: dict, args) -> None:
    """The JSON result to --output (or stdout)."""
    text = strict_json.dumps(result, indent=1)
    if args.output:
        try:
            write_output(args.output, text + "\n")  # (a failed write leaves the previous file whole)
        except OSError as e:  # (a full disk after the whole evaluation: the figures printed, not lost with it)
            print(text)
            raise DataError(f"--output {args.output} could not be written ({e}); the result is printed on stdout "
                            f"instead (above). Save it from there; free space or pass another --output next "
                            f"time.") from None
        say(f"eval: wrote {args.output}")
        drop_stale_incomplete(args.output)
    else:
        print(text)


def _write_plot(result: dict, args) -> None:
    """A task's plot: --plot, or --output's name with .png (several tasks: each its own, task_list.task_plot)."""
    plot = default_plot(args)
    # (drawn after the whole evaluation and its JSON: without matplotlib, a note, not a traceback and exit 1)
    if plot and importlib.util.find_spec("matplotlib") is None:
        say(f"eval: note: no plot written to {plot}: it needs the matplotlib package (pip install matplotlib); "
            f"the result is kept{f' in {args.output}' if args.output else ''}.")
        return
    if plot:
        from .plots import write_plot

        write_plot(result, plot)
        say(f"eval: wrote {plot}")


def evaluate_tasks(requests: list[EvalRequest], args_list: list) -> list[dict] | None:
    """Each task's result (rank 0; None on the others), in the order given. The tasks of one mode share one
    model: --mode score's built in the training layout (score_mode.py), --mode generate's loaded whole on
    each rank (generate_mode.py); ppl is always scored, so ppl beside passkey/needle under --mode generate
    builds the other kind after the first mode's tasks (the weights read twice: said before work). The process
    groups are ended once, after the last task; after an error they are left to the process's exit (a barrier
    would wait for ranks still in a collective)."""
    import gc

    from ..job.launch import end_one_rank_group, finish_distributed

    parts: dict[int, dict] | None = {}
    for which, group in enumerate(_mode_runs(requests)):
        if which:  # (the previous mode's model, FSDP's reference cycles and all, freed before the next is built)
            gc.collect()
        run = _run_mode(requests[group[0]].mode)
        try:
            got = run([requests[i] for i in group], [args_list[i] for i in group])
        except BaseException:
            # (no barrier: an error of one rank alone, rank 0 stopped or out of memory, left the others in the next
            # decode step's collective, and finish_distributed's barrier here waited for them for good; the error
            # ends the job through the launcher, which stops the other ranks)
            end_one_rank_group()
            raise
        parts = None if got is None or parts is None else {**parts, **dict(zip(group, got))}
    finish_distributed()
    return None if parts is None else [parts[i] for i in range(len(requests))]


def _mode_runs(requests: list[EvalRequest]) -> list[list[int]]:
    """The requests' indices grouped by mode, each group in the order given, the groups in the order of their
    first task (`passkey,ppl,needle --mode generate`: passkey and needle on one model, then ppl)."""
    runs: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        runs.setdefault(request.mode, []).append(i)
    return list(runs.values())


def _run_mode(mode: str):
    """The function that evaluates a run of tasks in `mode` on one model."""
    if mode == "generate":
        from .generate_mode import generate_tasks

        return generate_tasks
    from .score_mode import score_tasks

    return score_tasks
