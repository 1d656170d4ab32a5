"""Review of 4262009e (compiled decode copies: models/compiled_copies.py, static_decode.model_key, generate/blocks.py).

- Past the recompile limit each copy was to warn once (CompiledDecodeFallback), but the warning's text named only the
  function and the device: two copies of one function (greedy's and a sampled setting's `next_token_1`) said the same
  text from the same line, and Python's default filter, which shows a text once per place, showed the first alone
  (2 copies fell back, 1 warning). The text now names the copy's variant.
- The graph key leaves out what reaches the graphs only as tensors: two models differing only in Ms-PoE's ratios and
  a YaRN setting (their attention factor fixed) share the copies, each its eager tokens.
"""

import dataclasses
import warnings

import pytest
import torch

from longctx.config import load_config
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep, model_key

PROMPTS = [[5, 6, 7, 11, 13, 17, 19, 23], [8, 9]]


class Runs:
    """A backend that counts its graphs (each run as captured)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh():
    from longctx.models import compiled_copies

    torch._dynamo.reset()  # (earlier tests' graphs would serve, and count towards the limit)
    compiled_copies.COPIES.clear()
    yield
    compiled_copies.COPIES.clear()
    torch._dynamo.reset()


def _model(**over):
    cfg = load_config(overrides=["--model.preset=debug", "--model.layers=1"]).model
    return build_model(dataclasses.replace(cfg, init_std=0.1, **over), seed=0).eval()


def _tokens(model, compile, rows=1, sampling=None, new=8):
    return [r.tokens for r in generate(model, PROMPTS[:rows], max_new_tokens=new, compile=compile,
                                       **({} if sampling is None else {"sampling": sampling}))]


def test_each_copy_that_falls_back_is_said_under_the_default_warning_filter():
    from longctx.models.compiled_copies import CompiledDecodeFallback

    model = _model()
    step = CompiledStep(backend=Runs())
    sampled = Sampling(temperature=0.8, top_k=20, seed=3)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # (as a process runs: each text once per place)
        for rows, sampling in [(1, None), (2, None), (1, sampled), (2, sampled)]:
            assert _tokens(model, step, rows, sampling) == _tokens(model, None, rows, sampling), (rows, sampling)
    said = [str(w.message) for w in caught if issubclass(w.category, CompiledDecodeFallback)]
    assert len(said) == 2, said  # greedy's and the sampled variant's `next_token_1` (1 before)
    assert all("next_token_1" in s and "recompile limit" in s and "eagerly" in s for s in said)
    assert all("Llama" in s and "torch.float32" in s for s in said), said  # the variant, short
    assert all(len(s) < 700 for s in said), [len(s) for s in said]  # (the config's repr digested)


def test_ms_poe_ratios_and_yarn_frequencies_share_a_copy_with_eager_tokens():
    runs = Runs()
    step = CompiledStep(backend=runs)
    yarn = {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 64, "rope_attention_factor": 1.3}
    models = [_model(rope_ms_poe=True, rope_ms_poe_skip_layers=0, **yarn),
              _model(rope_ms_poe=True, rope_ms_poe_skip_layers=0, rope_ms_poe_min=1.5, rope_ms_poe_max=3.0,
                     rope_ms_poe_order="index", rope_theta=500.0, **{**yarn, "rope_original_max_len": 32})]
    assert model_key(models[0]) == model_key(models[1])
    eager = [_tokens(m, None, rows=2) for m in models]
    assert eager[0] != eager[1]  # the ratios and frequencies change the tokens: a graph holding them would fail
    for m, want in zip(models + models[:1], eager + eager[:1]):
        assert _tokens(m, step, rows=2) == want
    assert runs.graphs == 1  # the first model's graph serves the second
