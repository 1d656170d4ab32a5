"""`longctx eval --task ppl,passkey,needle`: several tasks in one launch, on weights read once.

- parse_tasks: the --task list, refused before any work when an item is unknown, repeated or empty.
- task_args: each task's own flags, as that task alone would be run with them. A flag only some
  chosen tasks read (--depths, --buckets, --mode, the sampling and context-memory flags) goes to those
  and is put back to its default for the others, so that each task's part of the result is, number
  for number, what the task alone writes; a flag no chosen task reads is left on every task, which
  refuses it as it does today.
- combined_result: the one JSON object of several tasks (one task: its own result, unchanged).

Torch-free (imported when the command's flags are read).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config.data_rules import SYNTHETIC_TASKS
from ..durable import written_in_place
from ..errors import ConfigError
from ..generate.context_memory import DEFAULTS as MEMORY_DEFAULTS
from ..generate.settings import SAMPLING_FLAGS
from .defaults import DEFAULT_BUCKETS, DEFAULT_DEPTHS

TASKS = ("ppl", *SYNTHETIC_TASKS)

# the flags only some tasks read, with their defaults (command.py's parser): --depths is where a retrieval
# needle sits, --buckets ppl's position buckets; --mode, the sampling and the context-memory flags say how a
# retrieval answer is read (ppl is teacher-forced loss, scored whatever they say)
RETRIEVAL_ONLY = {"depths": DEFAULT_DEPTHS, "mode": "score", "context_memory": "none",
                  **{f"infllm_{name}": value for name, value in MEMORY_DEFAULTS.items()},
                  **{flag[2:].replace("-", "_"): None for flag, _, _ in SAMPLING_FLAGS}}
PPL_ONLY = {"buckets": DEFAULT_BUCKETS}

# the head keys of a task's result that the combined result repeats at its top when every task has the same
# (a run's what-and-on-what; a task's own figures and settings stay in its part only)
SHARED_KEYS = ("mode", "checkpoint", "model", "layout", "data", "tokenizer", "dtype", "rope", "seed")


def parse_tasks(text: str) -> list[str]:
    """'ppl,passkey' -> ['ppl', 'passkey'], in the order given; an unknown, repeated or empty item refused."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not item:
            raise ConfigError(f"--task {text!r} has an empty item; name each task once, comma-separated, from "
                              f"{', '.join(TASKS)} (e.g. --task ppl,passkey).")
        if item not in TASKS:
            raise ConfigError(f"--task {text!r}: {item!r} is not a task; choose from {', '.join(TASKS)}, "
                              f"comma-separated (e.g. --task ppl,passkey).")
    repeated = sorted({item for item in items if items.count(item) > 1}, key=items.index)
    if repeated:
        raise ConfigError(f"--task {text!r} names {', '.join(repeated)} more than once; each task runs once, on "
                          f"the same sequences: name it once.")
    return items


def task_args(args, tasks: list[str]) -> list[argparse.Namespace]:
    """Each task's flags: `args` with --task that task, the flags another chosen task reads and it does not
    at their defaults, and (several tasks) its own plot path (`task_plot`)."""
    retrieval = any(t != "ppl" for t in tasks)
    out = []
    for task in tasks:
        own = {**vars(args), "task": task}
        others = (RETRIEVAL_ONLY if retrieval else {}) if task == "ppl" else (PPL_ONLY if "ppl" in tasks else {})
        own.update({name: default for name, default in others.items() if hasattr(args, name)})
        if len(tasks) > 1:
            own["plot"] = task_plot(args, task)
            # (named in an error as what the user gave, not as a --plot they did not pass)
            own["plot_label"] = (f"the {task} plot (--plot's name with .{task})" if args.plot else
                                 f"the {task} plot (--output's name with .{task}.png)")
        out.append(argparse.Namespace(**own))
    return out


def default_plot(args) -> str:
    """The plot a run writes: --plot, else --output's name with .png ('' for none: no --output, or an --output
    that is a stream, /dev/stdout or a pipe, beside which a PNG would land in /dev or the pipe's directory)."""
    if args.plot:
        return args.plot
    if not args.output or written_in_place(args.output):
        return ""
    return str(Path(args.output).with_suffix(".png"))


def task_plot(args, task: str) -> str:
    """A task's plot in a run of several: the plot the run would write, named for the task
    (out.json -> out.ppl.png, --plot fig.svg -> fig.ppl.svg); '' when none is written."""
    plot = default_plot(args)
    if not plot:
        return ""
    path = Path(plot)
    return str(path.with_name(f"{path.stem}.{task}{path.suffix}"))


def combined_result(parts: list[dict], lengths: list[int], seconds: float) -> dict:
    """Several tasks' results as one object: the SHARED_KEYS every part agrees on, the lengths, the run's
    seconds (model loads included), then "tasks": each task's result as it alone writes it, in the order given.
    One task: its result, unchanged (the single-task JSON users' scripts read)."""
    if len(parts) == 1:
        return parts[0]
    return combine(parts, lengths, seconds)


def combine(parts: list[dict], lengths: list[int], seconds: float) -> dict:
    """The object of several tasks (combined_result), for any number of parts: a run of several tasks stopped
    part-way keeps this shape even when one task finished a length (eval/stopped.py)."""
    out = {key: parts[0][key] for key in SHARED_KEYS
           if all(key in part and part[key] == parts[0][key] for part in parts)}
    out.update(lengths=list(lengths), seconds=round(seconds, 2), tasks={part["task"]: part for part in parts})
    return out
