"""Review of 078e4c70 (compiled decode copied per variant: models/static_decode.py `model_key`, generate/blocks.py
`step_variant`): what went into a variant that no graph reads made a generation compile all its graphs again
where one code object's graphs served it before, and kept them for the rest of the process:
- the model's config whole, with where its weights came from: generate/loading.py builds a model whose
  model.init_from is the checkpoint's path, so every checkpoint of one architecture (an evaluation of a run's
  checkpoints in one process) compiled again (3 checkpoints: 3 graphs, 1 before the commit);
- a greedy step's filter flags (top-k, top-p, min-p), which greedy decoding never reads (the library takes them;
  the CLI refuses them): greedy with a top_k set compiled a copy of its own (2 graphs, 1 before).
Counted with a counting backend: dynamo's guards and code objects are the backend's whatever it is."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from longctx.config import load_config
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep, model_key

PROMPTS = [[5, 6, 7]]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # (graphs of earlier tests would be reused, and their code objects counted)
    yield
    torch._dynamo.reset()


def _config(**over):
    return dataclasses.replace(load_config(overrides=["--model.preset=debug", "--model.layers=1"]).model, **over)


def _tokens(model, compile, sampling=None, rows=1):
    prompts = [[5, 6, 7], [8, 9]][:rows]
    return [r.tokens for r in generate(model, prompts, max_new_tokens=6, compile=compile,
                                       **({} if sampling is None else {"sampling": sampling}))]


def test_checkpoints_of_one_architecture_share_the_compiled_decode():
    counter = CompileCounter()
    step = CompiledStep(backend=counter)
    origins = [{}, {"init_from": "/ckpts/run/step_1000"}, {"init_from": "hf:/models/tuned"},
               {"preset": "", "init_std": 0.01}]
    for seed, origin in enumerate(origins):
        model = build_model(_config(**origin), seed=seed).eval()  # (other weights: the same graph, other tokens)
        assert _tokens(model, step) == _tokens(model, None), origin
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for 4 checkpoints of one architecture (1 before)"


def test_an_architecture_change_still_has_a_variant_of_its_own():
    # (the fix must not merge what the variants keep apart: another shape or YaRN factor is another code object;
    # rope_theta reaches the graphs only as the inv_freq buffer: shared, tests/unit/test_compiledec120.py)
    keys = {model_key(build_model(_config(**over), seed=0)) for over in ({}, {"layers": 2}, {"rope_scaling": "yarn"},
                                                                           {"kv_heads": 4})}
    assert len(keys) == 4
    same = {model_key(build_model(_config(**over), seed=0)) for over in ({}, {"init_from": "/x"}, {"init_std": 0.1},
                                                                           {"rope_theta": 5e5})}
    assert len(same) == 1


def test_greedy_with_filter_settings_shares_greedy_graphs():
    model = build_model(_config(), seed=0).eval()
    counter = CompileCounter()
    step = CompiledStep(backend=counter)
    for sampling in (Sampling(), Sampling(top_k=20), Sampling(top_p=0.9, min_p=0.05), Sampling(top_k=3, top_p=0.5)):
        assert _tokens(model, step, sampling) == _tokens(model, None, sampling), sampling
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for greedy with unread filters (1 before)"
    # a sampled run keeps its own variant, and its tokens
    sampled = Sampling(temperature=0.8, top_k=20, seed=3)
    assert _tokens(model, step, sampled) == _tokens(model, None, sampled)
    assert counter.frame_count == 2
