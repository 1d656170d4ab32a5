"""`longctx bench comm`'s link ratios: the emulated links slow down outwards (a ring is timed at the link
of the widest level it spans), so an --inter-ratio or --middle-ratio above 1, or nodes linked faster than a
node's groups, timed rings that cross the slower inner links at the outer one's speed and reported those
figures as the requested cluster's. Each is one clear error before any rank starts."""

import argparse

import pytest

from longctx.bench.arg_checks import check_bench_args
from longctx.errors import ConfigError


def _args(*argv):
    from longctx.bench import comm_cluster

    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    return p.parse_args(["--cluster", "2x4", *argv])


@pytest.mark.parametrize("argv, says", [
    (["--inter-ratio", "2"], "--inter-ratio 2 is above 1"),
    (["--group-ranks", "2", "--middle-ratio", "1.5"], "--middle-ratio 1.5 is above 1"),
    (["--group-ranks", "2", "--middle-ratio", "0.1", "--inter-ratio", "0.2"], "--inter-ratio 0.2 is above --middle"),
    (["--inter-ratio", "0"], "--inter-ratio must be > 0"),
])
def test_a_link_faster_than_the_one_inside_it_is_refused(argv, says):
    with pytest.raises(ConfigError, match=says):
        check_bench_args("comm", _args(*argv))


@pytest.mark.parametrize("argv", [[], ["--inter-ratio", "1"], ["--group-ranks", "2", "--middle-ratio", "0.25",
                                                                   "--inter-ratio", "0.125"],
                                  ["--middle-ratio", "3"]])  # (without --group-ranks no middle level is used)
def test_links_that_slow_down_outwards_are_accepted(argv):
    check_bench_args("comm", _args(*argv))
