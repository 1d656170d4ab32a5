"""InfLLM's context memory sharded over ctx ranks (generate/sharded_infllm.py) against one process
(models/context_memory.py through generate/context_memory.py), on a random tiny model in fp32, with
a memory far smaller than the prompt (block 16, window 64, top-3 units, 8 initial tokens: 43 units
form from a 760-token prompt):
- greedy new tokens are token-identical under ctx 2 and ctx 4, on every rank, and the prefill's last
  logits agree to 1e-4;
- each memory unit is built only on the rank that holds its tokens (its representatives are zero on
  every other rank), each rank holds about 1 / ctx of the slots, and no call reads more keys on a rank
  than one process reads in all;
- a prompt's samples (rows copied after the prefill) decode as one process's;
- under both placements of the retrieved units (--infllm-positions shared and ordered)."""

import functools

import numpy as np
import pytest
import torch

from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.slow  # two spawned jobs (2 and 4 ranks), about a minute on a 2-core CPU

NEW, LENGTH = 24, 760


def _shape(positions="shared"):
    from longctx.models.context_memory import InfLLMShape

    return InfLLMShape(block=16, repr=2, topk=3, window=64, init=8, positions=positions)


def _model():
    from longctx.config import load_config
    from longctx.models.llama import build_model

    return build_model(load_config(overrides=["--model.layers=2"]).model, seed=3).eval()


def _prompt(seed=1):
    return torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(ctx: int, positions: str = "shared"):
    """(greedy tokens, the prefill's last logits, keys read per call at most, slots held, units built here,
    units each rank owns, sampled tokens of two samples at T = 1)."""
    from longctx.generate.engine import generate
    from longctx.generate.sampling import Sampling

    model = _model()
    if ctx == 1:
        from longctx.generate.context_memory import InfLLMGeneration

        backend = InfLLMGeneration(_shape(positions))
    else:
        from longctx.config import load_config
        from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
        from longctx.job.runtime import Runtime

        rt = Runtime.create(load_config(overrides=[f"--parallel.ctx={ctx}"]), torch.distributed.get_rank(), ctx, "cpu")
        backend = ShardedInfLLMGeneration(_shape(positions), rt.mesh)
    with torch.inference_mode():
        cache = backend.cache(model, 1, LENGTH + NEW)
        logits = backend.prefill(model, cache, torch.tensor([_prompt()]), 4096)[0]
    tokens = generate(model, [_prompt()], max_new_tokens=NEW, backend=backend)[0].tokens
    memory = backend.memory
    read = memory.keys_read
    if ctx == 1:
        held, built, owned = None, None, None  # (one process: not compared)
    else:
        held = memory.k.shape[3]
        built = (memory.reps[0, 0].abs().sum((1, 2)) > 0).nonzero().flatten().tolist()
        owned = memory.rank
    sampled = generate(model, [_prompt(2)], max_new_tokens=NEW, backend=backend, num_samples=2,
                       sampling=Sampling(temperature=1.0, seed=11))
    return tokens, logits, read, held, built, owned, [r.tokens for r in sampled]


@functools.cache
def _reference(positions: str):
    return _run(1, positions)


POSITIONS = ("shared", "ordered")  # (--infllm-positions: the placement of the chosen units differs per rank's share)


@pytest.fixture(scope="module")
def sharded():
    return {ctx: run_spawned_many(ctx, [(p, _run, (ctx, p)) for p in POSITIONS], timeout=900) for ctx in (2, 4)}


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("ctx", [2, 4])
def test_sharded_memory_answers_as_one_process(ctx, positions, sharded):
    from longctx.generate.sharded_infllm import owners

    tokens, logits, read, _, _, _, sampled = _reference(positions)
    shape = _shape(positions)
    units = (LENGTH + NEW - shape.window - shape.init) // shape.block
    for rank, (got, got_logits, got_read, held, built, owner, got_sampled) in enumerate(sharded[ctx][positions]):
        assert got == tokens, rank
        torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=1e-4)
        assert got_sampled == sampled, rank
        # each unit built only where its tokens are; the slots dealt about evenly
        mine = np.nonzero(owners(shape.init + np.arange(units) * shape.block, shape, ctx) == owner)[0].tolist()
        assert built == mine and len(mine) >= units // ctx
        assert held <= -(-(LENGTH + NEW) // ctx) + shape.init + shape.block
        assert got_read <= read  # a rank reads its share of the keys one process reads
