"""Every flag of every command but train's config keys (test_badinput114 walks those), walked with bad values
(badflags114): each is refused, before any work, by argparse or with a UserError whose message names the flag,
or accepted because it means something (ALLOWED says what); never a raw traceback, never a value taken and then
used wrongly.

The walk reads each command's argparse actions (cli.build_parser, its sub-parsers) and runs `longctx ...` in this
process (test_newcomer's longctx_here) from a minimal valid command line with the one flag replaced, the
command's work replaced by a stop (STOPS: the first call past its checks). Bad values by type: an integer -1, 0
and 'abc'; a number nan, inf, -1.0 and 'abc'; a flag with choices 'bogus'; any other string 'bogus', and '' where
the flag has a value by default; a path the command reads, one that does not exist; a path it writes, one under
a file.

Wrong on HEAD (18 of 262 cases): raw tracebacks from bench train --seq-len '' (ValueError: invalid literal for
int()) and bench memory --probe bogus (ValueError on unpacking); taken and then used wrongly: plan
--offload-skip-last -1, bench memory --seq-len '' (exit 0 with no measurement), --policies '' and --preset bogus
(refused only inside the measurement, as model.preset), bench moe --seq-len '' with --memory-seq-len '' (timed and
measured nothing), data build --embed-model with no such directory (found after the scan and dedup, as a missing
sentence-transformers package); refused without naming the flag: plan --model, --hardware, --seq-len,
--recompute and --model-states (model.preset = ..., 'hardware file', 'unknown recompute policy'), data build
--tokenizer (data.tokenizer=byte, train's key), generate --prompt '' ('the prompt is empty'), generate and bench
decode --draft (model.init_from = ...)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_newcomer import longctx_here  # noqa: E402

from probes import tiny_target_run  # noqa: E402

MISSING = "/nonexistent-badflags114/x"
UNDER_FILE = "<file>/x"  # a path under a regular file: no directory can be made there
CKPT, RUN, DOCS, SCAN, OUT = "<ckpt>", "<run>", "<docs>", "<scan>", "<out>"

# command -> the minimal valid arguments after it (OUT: a fresh path per attempt)
BASE = {
    "generate": ["--checkpoint", CKPT, "--prompt", "ab cd", "--max-new-tokens", "2"],
    "eval": ["--checkpoint", CKPT, "--task", "passkey", "--lengths", "64"],
    "data build": ["--input", DOCS, "--seq-len", "64", "--out", OUT],
    "data merge": [SCAN, "--out", OUT],
    "plan": ["--gpus", "8", "--seq-len", "4096", "--out", OUT + ".toml"],
    "checkpoint": ["export", CKPT, OUT],
    "report": [RUN],
    "bench attention": [],
    "bench train": [],
    "bench memory": [],
    "bench moe": [],
    "bench generate": [],
    "bench decode": ["--target", CKPT, "--draft", CKPT],
    "bench comm": ["--cluster", "2x2"],
}
# command -> the first calls past its checks (module, name): the work, replaced by a stop
STOPS = {
    "generate": [("longctx.generate.cli", "run"), ("longctx.job.relaunch", "relaunch")],
    "eval": [("longctx.eval.command", "evaluate_tasks"), ("longctx.job.relaunch", "relaunch")],
    "data build": [("longctx.data.builder.scan", "write_plan")],  # (the inputs listed, none read)
    "data merge": [("longctx.data.builder.pipeline", "Assembly")],
    "plan": [("longctx.planner.search", "plan")],
    "checkpoint": [("longctx.checkpoint.export", "build_model")],
    "report": [("longctx.train.report", "_loss_plot")],
    "bench attention": [("longctx.bench.attention", "machine_load"), ("longctx.bench.attention_docs", "machine_load")],
    "bench train": [("longctx.bench.train", "run_one")],
    "bench memory": [("longctx.bench.memory", "run_spawned"), ("longctx.bench.memory", "measure"),
                     ("longctx.bench.memory", "_probe_step")],
    "bench moe": [("longctx.bench.moe", "measured_active_params"), ("longctx.bench.moe_cluster", "run_spawned")],
    "bench generate": [("longctx.bench.generate", "_measure"), ("longctx.bench.generate", "measure_compile")],
    "bench decode": [("longctx.generate.loading", "load_model")],
    "bench comm": [("longctx.bench.comm_cluster", "run_spawned")],
}
# (command, flag) -> the values that a path flag takes: a path read, MISSING; a path written, UNDER_FILE
READ_PATHS = {("generate", "--checkpoint"), ("generate", "--prompts"), ("generate", "--tokenizer"),
              ("generate", "--draft"), ("eval", "--checkpoint"), ("eval", "--data"), ("eval", "--tokenizer"),
              ("data build", "--input"), ("data build", "--tokenizer"), ("data build", "--embed-model"),
              ("data merge", "scans"), ("plan", "--hardware"), ("plan", "--store"), ("checkpoint", "path"),
              ("report", "run_dir"), ("bench decode", "--target"), ("bench decode", "--draft"),
              ("bench decode", "--prompts"), ("bench decode", "--data"), ("bench decode", "--tokenizer")}
WRITTEN_PATHS = {("generate", "--output"), ("eval", "--output"), ("eval", "--plot"), ("data build", "--out"),
                 ("data merge", "--out"), ("plan", "--out"), ("plan", "--calibrate-out"), ("checkpoint", "out"),
                 ("checkpoint", "--out"), ("bench memory", "--out"), ("bench comm", "--plot")}
BY_MEANING = {"--top-p": ["1.5"], "--min-p": ["1.5"], "--confidence-stop": ["1.0"], "--skew-share": ["1.5"]}
POSITIONAL = {("checkpoint", "path"): 1, ("checkpoint", "out"): 2, ("data merge", "scans"): 0,
              ("report", "run_dir"): 0}  # (command, argument) -> its place in BASE[command]
SKIPPED = {("checkpoint", "action")}  # (verify and import: walked by their own tests; export is the base)

# (command, flag, value) accepted because it means something, and what
SEED = "a seed like any other"
ALLOWED = {
    ("generate", "--prompt", "bogus"): "a prompt",
    ("generate", "--stop", "bogus"): "a stop string",
    ("generate", "--top-k", "0"): "0 = all tokens (the default)",
    ("generate", "--presence-penalty", "-1.0"): "in [-2, 2] (vLLM's / OpenAI's): negative favours repeats",
    ("generate", "--frequency-penalty", "-1.0"): "in [-2, 2] (vLLM's / OpenAI's): negative favours repeats",
    ("generate", "--min-new-tokens", "0"): "no minimum (the default)",
    ("generate", "--logprobs", "0"): "the chosen token's log-probability only",
    ("generate", "--seed", "0"): SEED,
    ("generate", "--seed", "-1"): "a seed: derive_seed takes it modulo 2^64, torch's generators take negatives",
    ("eval", "--batch", "0"): "0 = one per data-parallel rank (the default)",
    ("eval", "--seed", "0"): SEED,
    ("data build", "--text-field", "bogus"): "a field name (text files have none: read whole)",
    ("data build", "--response-field", "bogus"): "a field name (text files have none: read whole)",
    ("data build", "--holdout-tokens", "0"): "0 = --seq-len",
    ("data build", "--seed", "0"): SEED,
    ("data build", "--clusters", "0"): "0 = automatic",
    ("data build", "--max-docs", "0"): "0 = all",
    ("data merge", "--workers", "0"): "0 = the shard builds' --workers",
    ("plan", "--global-batch", "0"): "0 = --gpus (the default)",
    ("plan", "--offload", ""): "no offload fractions (help: 'or none')",
    ("plan", "--offload-skip-last", "0"): "every block may be offloaded",
    ("plan", "--loss-chunk", ""): "'' = the default (0 and 4096 tried)",
    ("plan", "--expert", ""): "'' = the default (1 and the largest degree whose expert group stays in one node)",
    ("bench attention", "--window", "0"): "a plain ring",
    ("bench attention", "--first-sample", "0"): "the first sample (the default)",
    ("bench attention", "--imbalance-samples", "0"): "no imbalance summary (the default)",
    ("bench memory", "--layers", "0"): "0 = the preset's",
    ("bench memory", "--skip-last", "0"): "every block may be offloaded",
    ("bench memory", "--loss-chunk", "0"): "never chunk the loss",
    ("bench memory", "--block-chunk", "0"): "whole blocks",
    ("bench memory", "--time-steps", "0"): "no timing",
    ("bench memory", "--attention-chunk", "0"): "the attention core at once",
    ("bench memory", "--doc-len", "0"): "0 = --docs documents per sequence",
    ("bench moe", "--expert-dim", "0"): "0 = --dim",
    ("bench moe", "--seed", "0"): SEED,
    ("bench moe", "--seed", "-1"): "torch's generators take negative seeds",
    ("bench moe", "--seq-len", ""): "the saved bytes only (--memory-seq-len); both '' are refused",
    ("bench moe", "--memory-seq-len", ""): "timed only (docs/benchmarks.md's dispatch runs); both '' are refused",
    ("bench generate", "--seed", "0"): SEED,
    ("bench generate", "--seed", "-1"): "torch's generators take negative seeds",
    ("bench generate", "--memory-lengths", ""): "'' = none (its help)",
    ("bench generate", "--sharded-lengths", ""): "read only with --sharded",
    ("bench decode", "--seed", "0"): SEED,
    ("bench decode", "--seed", "-1"): "a seed: derive_seed takes it modulo 2^64",
    ("bench comm", "--group-ranks", "0"): "0 = two link levels",
    ("bench comm", "--co2-overlap-steps", "0"): "0 = the local steps (CO2's full overlap)",
    ("bench comm", "--steps", "0"): "no training run (the default)",
}


def _commands(parser: argparse.ArgumentParser, name: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _commands(p, f"{name} {sub}".strip())
            return
    yield name, parser


def walked_flags() -> list[tuple[str, str, argparse.Action]]:
    from longctx.cli import build_parser

    out = []
    for command, parser in _commands(build_parser()):
        if command == "train" or command not in BASE:
            continue
        for action in parser._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue  # (a switch takes no value)
            flag = action.option_strings[0] if action.option_strings else action.dest
            if (command, flag) not in SKIPPED:
                out.append((command, flag, action))
    return out


def bad_values(command: str, flag: str, action: argparse.Action) -> list[str]:
    if (command, flag) in READ_PATHS:
        return [MISSING]
    if (command, flag) in WRITTEN_PATHS:
        return [UNDER_FILE]
    if action.choices:
        return ["bogus"]
    if action.type is int:
        return ["-1", "0", "abc"]
    if action.type is float:
        return ["nan", "inf", "-1.0", "abc", *BY_MEANING.get(flag, [])]
    return ["bogus"] + ([""] if action.default not in ("", []) else [])


class Reached(Exception):
    """The command got past every check to its work."""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The placeholders' paths: a tiny target checkpoint, its documents, a one-shard scan of them, a file."""
    base = tmp_path_factory.mktemp("badflags114")
    corpus, checkpoints = tiny_target_run(base)
    docs = corpus[0].split("=", 1)[1]
    scan = base / "scan"
    r = longctx_here("data", "build", "--input", docs, "--seq-len", "64", "--out", scan, "--shard", "0/1",
                     "--no-progress")
    assert r.returncode == 0, r.stderr
    (base / "file").write_text("a file\n")
    return {CKPT: str(checkpoints), RUN: str(checkpoints.parent), DOCS: docs, SCAN: str(scan),
            "<file>": str(base / "file")}


@pytest.fixture
def walk(made, tmp_path, monkeypatch):
    """attempt(command, flag, action, value): 'accepted', or the refusal ('argparse: ...' / 'error: ...')."""
    import importlib

    def stop(*_a, **_k):
        raise Reached

    for command_stops in STOPS.values():
        for module, name in command_stops:
            monkeypatch.setattr(importlib.import_module(module), name, stop)
    import longctx.threads as threads_module

    monkeypatch.setattr(threads_module, "fit_to_idle_cores", lambda *a, **k: None)  # (0.3 s of sampling each)
    runs = iter(range(10**6))

    def fill(word: str, out: str) -> str:
        for key, path in made.items():
            word = word.replace(key, path)
        return word.replace(OUT, out)

    def attempt(command: str, flag: str, action: argparse.Action | None, value: str | None) -> str:
        out = str(tmp_path / f"out{next(runs)}")
        argv = [fill(a, out) for a in BASE[command]]
        if action is not None and action.option_strings:
            argv += [flag, fill(value, out)]  # (the last of a flag given twice is the one read)
        elif action is not None:
            argv[POSITIONAL[command, flag]] = fill(value, out)
        try:
            r = longctx_here(*command.split(), *argv)
        except Reached:
            return "accepted"
        said = " ".join(r.stderr.split())
        refusal = re.search(r"longctx( [a-z]+)*: error: ", said)
        if r.returncode == 2 and "error: argument" in said:
            return f"argparse: {said[said.index('error: argument'):]}"
        if r.returncode != 0 and refusal:
            return f"error: {said[refusal.end():]}"
        return f"exit {r.returncode} without a refusal: {said[-400:]}"

    return attempt


@pytest.mark.parametrize("command", list(BASE))
def test_each_command_line_reaches_the_work(walk, command):
    """A base refused for its own sake would make the walk's refusals say nothing of the flag walked."""
    assert walk(command, "", None, None) == "accepted"


def _walked():
    return [pytest.param(command, flag, action, id=f"{command}:{flag}") for command, flag, action in walked_flags()]


@pytest.mark.parametrize("command,flag,action", _walked())
def test_every_bad_value_is_refused_naming_its_flag_or_means_something(walk, command, flag, action):
    wrong = []
    for value in bad_values(command, flag, action):
        try:
            said = walk(command, flag, action, value)
        except Exception as e:  # noqa: BLE001 - a raw traceback is what the walk reports
            wrong.append(f"{command} {flag} {value!r}: {type(e).__name__} {e}")
            continue
        allowed = ALLOWED.get((command, flag, value))
        if said == "accepted":
            if allowed is None:
                wrong.append(f"{command} {flag} {value!r}: accepted (not in ALLOWED)")
        elif allowed is not None:
            wrong.append(f"{command} {flag} {value!r}: ALLOWED ({allowed}) but refused: {said}")
        elif not said.startswith(("argparse:", "error:")):
            wrong.append(f"{command} {flag} {value!r}: {said}")
        elif not _names(said, flag, action, value):
            wrong.append(f"{command} {flag} {value!r}: refused without naming the flag: {said}")
    assert not wrong, "\n".join(wrong)


def _names(said: str, flag: str, action: argparse.Action, value: str) -> bool:
    """A refusal names an option by its flag; a positional argument by its name or the value given."""
    if action.option_strings:
        return any(option in said for option in action.option_strings)
    return (action.metavar or action.dest.upper()) in said or value.replace("<file>", "/file") in said


def test_allowed_names_only_flags_and_values_the_walk_tries():
    """ALLOWED stays honest: every entry is a value the walk gives its flag."""
    tried = {(c, f, v) for c, f, a in walked_flags() for v in bad_values(c, f, a)}
    assert set(ALLOWED) <= tried, set(ALLOWED) - tried


@pytest.mark.parametrize("action", ["verify", "import"])
def test_checkpoint_verify_and_import_refuse_a_missing_path_naming_it(walk, made, tmp_path, action):
    """The walk's checkpoint base is export; verify and import read PATH too."""
    r = longctx_here("checkpoint", action, MISSING, *([tmp_path / "out"] if action == "import" else []))
    said = " ".join(r.stderr.split())
    assert r.returncode != 0 and "longctx checkpoint: error: " in said and MISSING in said, said
    assert "Traceback" not in said, said
