"""memory.model_states = host on a device too small for what FSDP stages there (the largest unit
twice, its gradient, the root): one clear error before anything is sharded, with the figures."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.models.llama import Llama
from longctx.parallel.fsdp.shard import check_staging_fits

MODEL = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 4, "heads": 2, "kv_heads": 1,
                                     "ffn_dim": 32, "vocab_size": 64}}).model


def _need(model, groups, bf16):
    """The staging counted by hand from the modules."""
    block = [sum(p.numel() for p in b.parameters()) for b in model.layers]
    largest = max(sum(block[i] for i in g) for g in groups)
    root = sum(p.numel() for p in model.parameters()) - sum(block)
    g = 2 if bf16 else 4
    return 2 * largest * g + 4 * largest + root * (g + 4)


@pytest.mark.parametrize("groups", [[[0], [1], [2], [3]], [[0, 1], [2, 3]]])
@pytest.mark.parametrize("bf16", [True, False])
def test_staging_that_fits_passes_and_one_byte_less_is_refused(groups, bf16):
    model = Llama(MODEL)
    need = _need(model, groups, bf16)
    check_staging_fits(model, groups, bf16, need)
    with pytest.raises(ConfigError) as err:
        check_staging_fits(model, groups, bf16, need - 1)
    text = str(err.value)
    assert "memory.model_states=host" in text and "grad_bucket_blocks=1" in text
    assert f"{len(groups[0])} block(s)" in text

