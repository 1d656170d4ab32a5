"""`longctx plan --validate` and `--anchors` run their own fixed cases (planner/validate.py's CPU cases,
planner/anchors.py's published requests) and read no request: `--model llama3-8b --gpus 64 --seq-len 1M
--validate` ran the debug cases on 4 CPU processes and reported them as if they validated that plan,
and wrote no plan.toml, without a word. A request flag or config override beside them is refused."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner import anchors, validate
from longctx.planner.cli import add_arguments, main


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def ran(monkeypatch):
    """Which fixed-case command ran (stubbed: the real ones spawn processes for minutes)."""
    calls = []
    monkeypatch.setattr(validate, "main", lambda args=None: calls.append("validate") or 0)
    monkeypatch.setattr(anchors, "main", lambda args=None: calls.append("anchors") or 0)
    return calls


@pytest.mark.parametrize("mode", ["--validate", "--anchors"])
@pytest.mark.parametrize("argv, overrides, named", [
    (["--model", "llama3-8b", "--gpus", "64", "--seq-len", "1M"], [], "--model, --gpus, --seq-len"),
    (["--hardware", "h200", "--out", "x.toml"], [], "--hardware, --out"),
    ([], ["--train.lr=0.001"], "--train.lr=0.001"),
])
def test_a_request_beside_the_fixed_cases_is_refused(mode, argv, overrides, named, ran):
    with pytest.raises(ConfigError, match=f"{mode} runs its own fixed cases .*ignore {named}"):
        main(_args([*argv, mode]), overrides)
    assert ran == []


def test_both_fixed_case_modes_at_once_are_refused(ran):
    with pytest.raises(ConfigError, match="--validate .* --anchors"):
        main(_args(["--validate", "--anchors"]), [])
    assert ran == []


@pytest.mark.parametrize("mode, name", [("--validate", "validate"), ("--anchors", "anchors")])
def test_a_fixed_case_mode_alone_runs(mode, name, ran):
    assert main(_args([mode]), []) == 0
    assert ran == [name]
