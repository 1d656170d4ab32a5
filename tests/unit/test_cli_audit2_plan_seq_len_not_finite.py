"""`longctx plan --seq-len inf` (or nan, 1e400) stopped with an OverflowError / ValueError traceback from
int(float): refused as a token count, like any other word."""

import pytest

from longctx.errors import ConfigError
from longctx.planner.request import parse_tokens


@pytest.mark.parametrize("text", ["inf", "nan", "1e400", "-inf", "infK"])
def test_a_length_that_is_no_number_of_tokens_is_refused(text):
    with pytest.raises(ConfigError, match="token"):
        parse_tokens(text)


def test_lengths_still_read():
    assert parse_tokens("1M") == 2**20 and parse_tokens("1.5K") == 1536 and parse_tokens("4096") == 4096
