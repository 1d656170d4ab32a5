"""distributed_attention's up-front checks (check_inputs, pure: no mesh) say what is wrong and how to fix it."""

import pytest
import torch

from longctx.errors import ConfigError
from longctx.parallel.context.attention import check_inputs


def test_an_odd_local_shard_names_the_lengths_that_would_split():
    q = torch.randn(1, 7, 2, 8)  # 7 tokens on each of 2 context ranks: 14, not a multiple of 2 x 2 x 1
    with pytest.raises(ConfigError, match=r"sequence length 14 .* not divisible by 2 x ctx x head = 4") as e:
        check_inputs(q, q, q, None, 1, 2, 0)
    assert "Use 12 or 16 tokens" in str(e.value) and "mask the padding out of the loss" in str(e.value)
    one = torch.randn(1, 1, 4, 8)  # one token per shard on head 2 x ctx 2: the shortest length is the unit
    with pytest.raises(ConfigError, match="Use 8 tokens"):
        check_inputs(one, one, one, None, 2, 2, 0)


def test_tensors_without_heads_are_refused_as_such():
    q, empty = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 0, 8)
    for qq, kk in ((q, empty), (empty, empty)):
        with pytest.raises(ValueError, match="at least one query head and one key/value head"):
            check_inputs(qq, kk, kk, None, 2, 1, 0)
