"""InfLLM's context memory on a model with Ms-PoE, called as a library (generate(backend=...)): refused by
the memory itself, one process and sharded over ctx ranks, before any token is decoded.

The memory turns cached keys back to position 0 and queries on to `far` with ONE RoPE table; Ms-PoE caches
each kv head's keys at p / r. A far key of distance D was then seen at far - D (1 - 1 / r), not at far:
with r = 1.8, D = 10,000 and the default far of 2,303, at -2,141 (a key 2,141 positions in the query's
future), in every layer Ms-PoE applies to. The command refused the pair (generate/context_memory.py memory_shape); the
library ran it and returned tokens without a word, although models/context_memory.py says a library call
meets that limit in the memory."""

import pytest
import torch

from longctx.config import ModelConfig
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models.context_memory import InfLLMMemory, InfLLMShape
from longctx.models.llama import build_model

SHAPE = InfLLMShape(block=4, repr=2, topk=2, window=16, init=4)


def _model(ms_poe: bool):
    cfg = ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab_size=97, init_std=0.2,
                      rope_ms_poe=ms_poe, rope_ms_poe_skip_layers=0, rope_ms_poe_order="index")
    return build_model(cfg, seed=5).eval()


def _prompt():
    return torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(2)).tolist()


def test_one_process_memory_refuses_an_ms_poe_model():
    model = _model(True)
    with pytest.raises(ValueError, match="Ms-PoE"):
        generate(model, [_prompt()], max_new_tokens=4, backend=InfLLMGeneration(SHAPE))
    with pytest.raises(ValueError, match="rope_ms_poe"):
        InfLLMMemory(SHAPE, model, 1, 64)
    # the same model without Ms-PoE runs (the refusal is the option's, not the shape's)
    assert len(generate(_model(False), [_prompt()], max_new_tokens=4, backend=InfLLMGeneration(SHAPE))[0].tokens) == 4


def _sharded(ms_poe: bool):
    from longctx.config import load_config
    from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
    from longctx.job.runtime import Runtime

    torch.set_num_threads(1)
    rt = Runtime.create(load_config(overrides=["--parallel.ctx=2"]), torch.distributed.get_rank(), 2, "cpu")
    try:
        r = generate(_model(ms_poe), [_prompt()], max_new_tokens=4, backend=ShardedInfLLMGeneration(SHAPE, rt.mesh))
    except ValueError as e:
        return "error", str(e)
    return "ran", r[0].tokens


def test_sharded_memory_refuses_an_ms_poe_model():
    from longctx.job.spawn import run_spawned_many

    runs = run_spawned_many(2, [("poe", _sharded, (True,)), ("plain", _sharded, (False,))], timeout=300)
    for what, said in runs["poe"]:
        assert what == "error" and "Ms-PoE" in said, (what, said)
    assert all(what == "ran" and len(tokens) == 4 for what, tokens in runs["plain"])
