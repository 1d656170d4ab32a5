"""`longctx plan --train.dtype fp32` on bf16 hardware: the plan's activation and gather bytes are the
hardware's dtype_bytes (2), but the written config kept train.dtype = fp32, which holds twice the
activations: a plan reported as fitting that the run would not. Now refused, with the fix named."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


ARGS = ["--model", "debug", "--gpus", "8", "--seq-len", "64K", "--hardware", "h100"]


def test_fp32_config_on_bf16_hardware_is_refused():
    with pytest.raises(ConfigError, match="dtype_bytes=4"):
        build_request(_args(ARGS), ["--train.dtype=fp32"])


def test_matching_precisions_plan():
    req, base = build_request(_args([*ARGS, "--hw", "dtype_bytes=4"]), ["--train.dtype=fp32"])
    assert req.hardware.dtype_bytes == 4 and base.train.dtype == "fp32"
    req, base = build_request(_args(ARGS), ["--train.dtype=bf16"])
    assert req.hardware.dtype_bytes == 2
    req, base = build_request(_args(ARGS), [])
    assert base.train.dtype == "auto"
