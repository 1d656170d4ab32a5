"""Every environment variable longctx reads, walked with bad values (badenv114; test_badinput114 walks train's
keys, test_badflags114 the other commands' flags): each is refused, before any work, with a UserError whose
message names the variable, or accepted because it means something (ALLOWED says what); never a raw traceback,
never a value taken and then used wrongly.

The walk runs, in this process (test_newcomer's longctx_here), a command that reads the variable: `longctx train`
up to its first step (its preflight real, the step-taking train() and the launcher's relaunch replaced by a
stop), `longctx generate` up to its generation (generate.cli.run stopped) for the decode's variables, `longctx
bench train` up to its first case (run_one stopped) for OMP_NUM_THREADS, which it parses. Where a variable is read
lazily (a heartbeat's interval, a decode's graphs, the cache folder, a fault's plan, a bench case's threads), its
reader is walked directly as well: it refuses the same values with the same error.
Bad values: '', 'abc', '-1', '0', 'nan', 'inf', a huge number; a path that does not exist, a regular file and a
path under one where a folder is expected; malformed LONGCTX_FAULT specs; torchrun's variables out of range.

Wrong on HEAD (walk: 46 of 95 cases; readers: 26 of 53): LONGCTX_PROGRESS_S 'abc' read as 20 s, '-1' and 'nan' as
no lines, 'inf' as never; LONGCTX_DECODE_GRAPHS / LONGCTX_REUSE_CACHES 'false', 'abc', '-1', 'nan', 'inf', '1e300'
read as on (only '0' was off); LONGCTX_CACHE a regular file or a path under one: a raw NotADirectoryError when
preflight made the default data store's folder; LONGCTX_FAULT malformed ('abc', 'nonfinite@0', 'hang@x:3', ...) or
a hang of a rank the job lacks passed train's every check, refused only at the Trainer's set-up in the ranks
(after the data store and the launch), and 'nonfinite@\u00b2' (a digit to str.isdigit) was int()'s raw ValueError;
LONGCTX_ERROR_DIR (longctx's own: the folder its ranks hand errors to) missing, a file or '' was taken for a rank
of `--nproc N`'s without a word; bench train's OMP_NUM_THREADS 'abc', '0', '-1', 'nan', 'inf', '1e300' ran each
case on its share of the cores without a word, '\u00b2' was a raw ValueError in the first case."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_newcomer import longctx_here  # noqa: E402

from longctx.errors import UserError  # noqa: E402
from probes import DRAFT_QUIET, tiny_target_run  # noqa: E402

FILE, MISSING = "<file>", "<missing>"  # a regular file; a path that does not exist (under the test's folder)
UNDER_FILE = FILE + "/x"
COMMON = ["", "abc", "-1", "0", "nan", "inf", "1e300"]
FAULTS = [*COMMON, "nonfinite@", "nonfinite@0", "nonfinite@-1", "nonfinite@1.5", "nonfinite@\u00b2", "hang@1",
          "hang@x:3", "hang@5:1", "bogus@3", "nonfinite@3;spike@4", "nonfinite@99999999999999999999"]
PATHS = ["", "abc", MISSING, FILE, UNDER_FILE]
# variable -> (the command that reads it, the values walked, the other variables it is walked beside)
LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
VARS = {
    "LONGCTX_PROGRESS_S": ("train", COMMON, {}),
    "LONGCTX_HOST_MEMORY_BYTES": ("train", COMMON, {}),
    "LONGCTX_FAULT": ("train", FAULTS, {}),
    "LONGCTX_CACHE": ("train", PATHS, {}),
    "LONGCTX_ERROR_DIR": ("train", PATHS, {}),
    "LONGCTX_DECODE_GRAPHS": ("generate", [*COMMON, "false"], {}),
    "LONGCTX_REUSE_CACHES": ("generate", [*COMMON, "false"], {}),
    "RANK": ("train", ["", "abc", "-1", "1", "nan", "1e300"], {"WORLD_SIZE": "1"}),
    "WORLD_SIZE": ("train", ["", "abc", "-1", "0", "nan", "1e300"], {"RANK": "0"}),
    "LOCAL_RANK": ("train", ["", "abc", "-1", "1", "nan"], {"RANK": "0", "WORLD_SIZE": "1"}),
    "LOCAL_WORLD_SIZE": ("train", ["", "abc", "-1", "0", "2", "\u00b2"], {"RANK": "0", "WORLD_SIZE": "1"}),
    "MASTER_PORT": ("train", ["", "abc", "-1", "0", "nan", "99999"], {"RANK": "1", "WORLD_SIZE": "2", **LAUNCH}),
    "OMP_NUM_THREADS": ("bench train", [*COMMON, "\u00b2"], {}),  # (bench train's threads per process)
}
# (variable, value) accepted because it means something, and what
ALLOWED = {
    ("LONGCTX_PROGRESS_S", ""): "unset: 20 s",
    ("LONGCTX_PROGRESS_S", "0"): "no heartbeat lines (documented)",
    ("LONGCTX_PROGRESS_S", "1e300"): "a line after that much quiet: none in practice (0 says it)",
    ("LONGCTX_HOST_MEMORY_BYTES", ""): "unset: the free host memory",
    ("LONGCTX_HOST_MEMORY_BYTES", "1e300"): "a budget no run exceeds",
    ("LONGCTX_FAULT", ""): "unset: no fault",
    ("LONGCTX_FAULT", "nonfinite@99999999999999999999"): "a step past this run's end: a resume may reach it",
    ("LONGCTX_CACHE", ""): "unset: ~/.cache/longctx",
    ("LONGCTX_CACHE", "abc"): "a folder relative to the working directory, made on first use",
    ("LONGCTX_CACHE", MISSING): "made on first use",
    ("LONGCTX_DECODE_GRAPHS", ""): "unset: on",
    ("LONGCTX_DECODE_GRAPHS", "0"): "off (documented)",
    ("LONGCTX_REUSE_CACHES", ""): "unset: on",
    ("LONGCTX_REUSE_CACHES", "0"): "off (documented)",
    ("OMP_NUM_THREADS", ""): "unset: each process's share of the cores",
}
# a refusal that need not name the variable walked: a launcher's pair with the other one wrong
NAMED_OTHERWISE = {("RANK", "1"): "RANK=1 must be in [0, WORLD_SIZE=1)",
                   ("WORLD_SIZE", "0"): "RANK=0 must be in [0, WORLD_SIZE=0)",
                   ("WORLD_SIZE", "-1"): "RANK=0 must be in [0, WORLD_SIZE=-1)"}


class Reached(Exception):
    """The command got past every check to its work."""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("badenv114")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LONGCTX_CACHE", str(base / "cache"))  # (the store it builds, which the walk's runs reuse)
        corpus, checkpoints = tiny_target_run(base)
    (base / "file").write_text("a file\n")
    return base, corpus, checkpoints


@pytest.fixture
def walk(made, tmp_path, monkeypatch):
    """attempt(variable, value): 'accepted', or the refusal's message."""
    import longctx.bench.train as bench_train
    import longctx.generate.cli as generate_cli
    import longctx.job.relaunch as relaunch_module
    import longctx.threads as threads_module
    import longctx.train.trainer as trainer_module

    base, corpus, checkpoints = made

    def stop(*_a, **_k):
        raise Reached

    for module, name in ((trainer_module, "train"), (relaunch_module, "relaunch"), (generate_cli, "run"),
                         (bench_train, "run_one")):
        monkeypatch.setattr(module, name, stop)
    monkeypatch.setattr(threads_module, "fit_to_idle_cores", lambda *a, **k: None)  # (0.3 s of sampling each)
    monkeypatch.setenv("LONGCTX_CACHE", str(base / "cache"))  # (the stores built once for every attempt)
    for name in (*VARS, "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    runs = iter(range(10**6))

    def attempt(name: str, value: str) -> str:
        command, _, beside = VARS[name]
        value = value.replace(FILE, str(base / "file")).replace(MISSING, str(tmp_path / "missing" / "x"))
        argv = {"train": ["train", "--nproc", "1", f"--train.run_dir={tmp_path / str(next(runs))}", *DRAFT_QUIET,
                          *corpus, "--train.steps=3", "--metrics.peak_tflops=1"],
                "generate": ["generate", "--checkpoint", str(checkpoints), "--prompt", "ab cd",
                             "--max-new-tokens", "2"],
                "bench train": ["bench", "train", "--layouts", "single"]}[command]
        with monkeypatch.context() as m:
            for key, given in {**beside, name: value}.items():
                m.setenv(key, given)
            try:
                r = longctx_here(*argv, cwd=tmp_path)
            except Reached:
                return "accepted"
        said = " ".join(r.stderr.split())
        refusal = re.search(r"longctx( [a-z]+)*: error: ", said)  # (main's check of the environment: 'longctx:')
        if r.returncode != 0 and refusal and "Traceback" not in said:
            return said[refusal.end():]
        return f"exit {r.returncode} without a refusal: {said[-400:]}"

    return attempt


def _walked():
    return [pytest.param(name, id=name) for name in VARS]


@pytest.mark.parametrize("command", ["train", "generate", "bench train"])
def test_each_command_reaches_its_work(walk, command):
    """A base refused for its own sake would make the walk's refusals say nothing of the variable walked."""
    assert walk(next(n for n, v in VARS.items() if v[0] == command and not v[2]), "") == "accepted"


@pytest.mark.parametrize("name", _walked())
def test_every_bad_value_is_refused_naming_its_variable_or_means_something(walk, name):
    wrong = []
    for value in VARS[name][1]:
        try:
            said = walk(name, value)
        except Exception as e:  # noqa: BLE001 - a raw traceback is what the walk reports
            wrong.append(f"{name}={value!r}: {type(e).__name__} {e}")
            continue
        allowed = ALLOWED.get((name, value))
        if said == "accepted":
            if allowed is None:
                wrong.append(f"{name}={value!r}: accepted (not in ALLOWED)")
        elif said.startswith("exit "):
            wrong.append(f"{name}={value!r}: {said}")
        elif allowed is not None:
            wrong.append(f"{name}={value!r}: ALLOWED ({allowed}) but refused: {said}")
        elif name not in said and NAMED_OTHERWISE.get((name, value), "\0") not in said:
            wrong.append(f"{name}={value!r}: refused without naming the variable: {said}")
    assert not wrong, "\n".join(wrong)


def _reader(name: str):
    """The function that reads `name` where it is used (lazily: in a phase, a decode, a save)."""
    if name == "LONGCTX_PROGRESS_S":
        from longctx.progress import interval_s
        return interval_s
    if name == "LONGCTX_DECODE_GRAPHS":
        from longctx.generate.blocks import capture_for
        return lambda: capture_for("cpu")
    if name == "LONGCTX_REUSE_CACHES":
        from longctx.generate.cache_pool import reuse_enabled
        return reuse_enabled
    if name == "LONGCTX_CACHE":
        from longctx.cache_dir import cache_root
        return cache_root
    if name == "OMP_NUM_THREADS":
        from longctx.bench.train import threads_per_rank
        return lambda: threads_per_rank(1)
    from longctx.faults import planned
    return lambda: [planned(kind, 1, 2) for kind in ("nonfinite", "spike", "hang", "enospc")]


LAZY = ["LONGCTX_PROGRESS_S", "LONGCTX_DECODE_GRAPHS", "LONGCTX_REUSE_CACHES", "LONGCTX_CACHE", "LONGCTX_FAULT",
        "OMP_NUM_THREADS"]


@pytest.mark.parametrize("name", LAZY)
def test_each_lazy_reader_refuses_what_the_command_refuses(name, tmp_path, monkeypatch):
    """Where it is read, not only at the command's start: a library caller (a Trainer, a generation) meets the same
    refusal, never a value read as something else."""
    (tmp_path / "file").write_text("a file\n")
    read, wrong = _reader(name), []
    for value in VARS[name][1]:
        if name == "LONGCTX_FAULT" and value == "hang@5:1":
            continue  # (a rank the job lacks: the reader is asked with world 2 here; preflight asks with its own)
        monkeypatch.setenv(name, value.replace(FILE, str(tmp_path / "file")).replace(MISSING, str(tmp_path / "m")))
        try:
            read()
        except UserError as e:
            if (name, value) in ALLOWED or name not in str(e):
                wrong.append(f"{name}={value!r}: refused: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a raw traceback is what the walk reports
            wrong.append(f"{name}={value!r}: {type(e).__name__} {e}")
            continue
        if (name, value) not in ALLOWED:
            wrong.append(f"{name}={value!r}: read (not in ALLOWED)")
    assert not wrong, "\n".join(wrong)


def test_allowed_names_only_variables_and_values_the_walk_tries():
    """ALLOWED and NAMED_OTHERWISE stay honest: every entry is a value the walk gives its variable."""
    tried = {(name, value) for name, (_, values, _) in VARS.items() for value in values}
    assert set(ALLOWED) <= tried and set(NAMED_OTHERWISE) <= tried, (set(ALLOWED) | set(NAMED_OTHERWISE)) - tried
