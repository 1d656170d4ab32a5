"""A request that spans no candidate at all (no layout divides the sequence, or no micro-batch size splits a
data-parallel rank's share of the global batch) is bad input: `longctx plan` searched it anyway, printed an empty
table with its legend (or JSON without plans) and only then failed saying that no plan "fits". Now it is one
error, before any search, and nothing on stdout."""

import re

import pytest

from longctx.cli import main as longctx_main

BASE = ["plan", "--model", "debug", "--hardware", "h100", "--no-write"]


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "4", "--seq-len", "4097"], r"nothing to plan .*4097 tokens must be divisible by 2 x head x ctx"),
    (["--gpus", "4", "--seq-len", "4097", "--json"], r"nothing to plan .*divisible"),
    (["--gpus", "1", "--seq-len", "4097"], r"one of \[2\]\); choose a sequence length that is a multiple of 2\.$"),
    # 4098 is a multiple of 2, but only dp1 (head x ctx = 4) divides the global batch of 3: the message said
    # "a multiple of 2 with fewer sequence-parallel ranks", which 4098 already is
    (["--gpus", "4", "--seq-len", "4098", "--global-batch", "3"],
     r"divides the sequence with a data-parallel degree dividing the global batch 3: .*one of \[8\]\); choose a "
     r"sequence length that is a multiple of 8\.$"),
    (["--gpus", "4", "--seq-len", "4K", "--global-batch", "2", "--micro-batch", "4"],
     r"nothing to plan .*no micro-batch of 4 divides"),
])
def test_no_candidate_is_one_error_before_any_output(capsys, argv, says):
    assert longctx_main([*BASE, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.search(says, " ".join(err.split())), err


def test_a_request_with_candidates_still_plans(capsys):
    assert longctx_main([*BASE, "--gpus", "4", "--seq-len", "4K", "--top", "1"]) == 0
    assert "dp4" in capsys.readouterr().out
