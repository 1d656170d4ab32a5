"""`longctx plan` with an override of a setting it chooses, given at that setting's default value."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request

ARGS = ["--model", "debug", "--gpus", "8", "--seq-len", "64K", "--hardware", "h100"]


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("override, flag", [
    ("--memory.recompute=none", "--recompute"), ("--parallel.head=1", "--gpus"),
    ("--train.global_batch=4", "--global-batch"), ("--train.data_parallel=sync", "--allow co2")])
def test_an_override_at_its_default_the_plan_would_overwrite_is_refused(override, flag):
    """The check compared values with the defaults: `--memory.recompute none` passed, and the written plan said
    recompute = "selective" (llama3-8b at 128K on 8 GPUs) without a word; `--memory.recompute full` is refused."""
    with pytest.raises(ConfigError, match=f"the plan chooses .*{override.split('=')[0][2:]} \\(its flag: {flag}"):
        build_request(_args(ARGS), [override])
