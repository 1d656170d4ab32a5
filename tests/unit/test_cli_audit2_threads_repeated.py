"""--threads given twice: the process ran the first count while argparse (and every other repeated flag: --nproc,
a --section.key override) takes the last, so `--threads 2 --threads 4` ran 2 threads, and bench moe / attention set
torch to 4 beside an OpenMP pool of 2. The last one given is the count, as for every other flag."""

import pytest

from longctx.errors import ConfigError
from longctx.threads import threads_given


def test_the_last_threads_flag_is_the_count():
    assert threads_given(["train", "--threads", "2", "--threads", "4"]) == 4
    assert threads_given(["train", "--threads=2", "--threads", "3"]) == 3
    assert threads_given(["train", "--threads", "3", "--threads=1"]) == 1


def test_a_bad_count_is_refused_wherever_it_stands():
    with pytest.raises(ConfigError, match="--threads takes a positive number"):
        threads_given(["train", "--threads", "2", "--threads", "0"])
    with pytest.raises(ConfigError, match="--threads takes a positive number"):
        threads_given(["train", "--threads", "x", "--threads", "2"])
