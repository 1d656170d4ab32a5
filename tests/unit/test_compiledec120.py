"""Leftovers of the compiled decode (models/static_decode.py, models/compiled_copies.py, generate/blocks.py):
- configs differing only in a value that reaches the graphs as a tensor (rope_theta, a non-YaRN RoPE scaling:
  the `inv_freq` buffer; max_seq_len, read by no graph) compiled a copy each (3 rope_theta values: 3 graphs, 3
  copies); now one, and each model's tokens its eager path's;
- the process's compiled copies were unbounded (functools.cache): 40 architectures in turn kept 43 copies and their
  graphs; now at most COMPILED_COPIES, the least recently called dropped, and with it its graphs;
- past torch._dynamo's recompile limit a copy (fullgraph) raised FailOnRecompileLimitHit out of the generation;
  now it warns once (CompiledDecodeFallback) and decodes eagerly where its graphs do not serve: eager's tokens.
The counting backends run the captured graph as is; one inductor test (a C++ compiler needed) does the same with
inductor's kernels."""

import dataclasses
import gc
import types
import warnings

import pytest
import torch

from longctx.config import load_config
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.llama import build_model
from longctx.models.recompiles import RecompileWatch
from longctx.models.static_decode import CompiledStep, model_key

PROMPTS = [[5, 6, 7, 11, 13, 17, 19, 23], [8, 9], [1, 2, 3, 4]]


class Runs:
    """A backend that counts its graphs and their runs (each graph run as captured)."""

    def __init__(self):
        self.graphs = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


@pytest.fixture(autouse=True)
def _fresh():
    from longctx.models import compiled_copies

    torch._dynamo.reset()  # (earlier tests' graphs would serve, and their copies count towards the bound)
    compiled_copies.COPIES.clear()
    yield
    compiled_copies.COPIES.clear()
    torch._dynamo.reset()


def _config(**over):
    return dataclasses.replace(load_config(overrides=["--model.preset=debug", "--model.layers=1"]).model, **over)


def _tokens(model, compile, rows=1, new=12, sampling=None):
    return [r.tokens for r in generate(model, PROMPTS[:rows], max_new_tokens=new, compile=compile,
                                       **({} if sampling is None else {"sampling": sampling}))]


def test_configs_differing_only_in_tensor_values_share_one_compiled_copy():
    runs = Runs()
    step = CompiledStep(backend=runs)
    configs = [{}, {"rope_theta": 500.0}, {"rope_theta": 1e6}, {"rope_scaling": "linear", "rope_factor": 4.0},
               {"rope_scaling": "llama3", "rope_theta": 50.0}, {"max_seq_len": 4096}]
    eager = []
    for over in configs:
        # (the same weights, only RoPE's frequencies differ; init_std 0.1: attention sharp enough that they matter)
        model = build_model(_config(init_std=0.1, **over), seed=0).eval()
        eager.append(_tokens(model, None))
        assert _tokens(model, step) == eager[-1], over
    assert len({str(t) for t in eager}) >= 5  # the frequencies change the tokens: a graph holding them would fail
    assert runs.graphs == 1, f"{runs.graphs} graphs for configs differing only in RoPE's frequencies (6 before)"
    # a YaRN factor is a Python number in the graph (rope_scale): another copy, still eager's tokens
    yarn = build_model(_config(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=64, init_std=0.1),
                       seed=0).eval()
    assert _tokens(yarn, step) == _tokens(yarn, None) and runs.graphs == 2


def test_the_graph_key_keeps_what_changes_a_graph_apart():
    def key(**over):
        return model_key(build_model(_config(**over), seed=0))

    same = {key(), key(rope_theta=5e5), key(rope_scaling="linear"), key(max_seq_len=512), key(init_from="/x"),
            key(rope_scaling="llama3", rope_factor=2.0, rope_low_freq_factor=2.0)}
    assert len(same) == 1
    apart = [key(), key(layers=2), key(norm_eps=1e-6), key(qk_norm=True), key(kv_heads=4), key(rope_ms_poe=True,
             rope_ms_poe_skip_layers=0), key(rope_scaling="yarn"), key(rope_scaling="yarn", rope_factor=16.0)]
    assert len(set(apart)) == len(apart)


def _live_copies(but=()) -> list:
    """The copies' functions alive (gc.collect first), but those whose code is in `but` (by identity: code objects
    compare equal by content, the same for every copy)."""
    gc.collect()
    # (type(), not isinstance: a dead weakref.proxy among the objects raises at isinstance)
    return [o for o in gc.get_objects()
            if type(o) is types.FunctionType and o.__code__.co_name.startswith(("next_token_", "static_hidden_"))
            and all(o.__code__ is not c for c in but)]


def test_compiled_copies_are_bounded_least_recently_called_dropped(monkeypatch):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from longctx.models import compiled_copies

    monkeypatch.setattr(compiled_copies, "COMPILED_COPIES", 3)
    runs = Runs()
    step = CompiledStep(backend=runs)
    models = [build_model(_config(layers=n), seed=n).eval() for n in (1, 2, 3, 4, 5)]
    earlier = [f.__code__ for f in _live_copies()]  # (copies an earlier test of this process still holds)
    dropped = compiled_copies.COPIES.dropped
    codes = []
    for i, model in enumerate(models):  # (one `next_token_1` copy each: greedy decoding in blocks)
        assert _tokens(model, step, new=4) == _tokens(model, None, new=4)
        new = [f.__code__ for f in _live_copies(but=earlier + codes)]
        assert len(new) == 1 and new[0].co_name == "next_token_1", new
        codes.append(new[0])
        kept = len(_live_copies(but=earlier))
        assert kept <= 3, f"{kept} copies kept after {i + 1} models (bound 3)"
    assert runs.graphs == 5 and compiled_copies.COPIES.dropped - dropped == 2
    gc.collect()
    # the dropped copies' graphs (dynamo's cache entries, kept on the code object) are gone; the kept ones' stay
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [0, 0, 1, 1, 1]
    # least recently CALLED goes first: models 3, 4, 5 kept; 3 called, so model 1's new copy drops 4's, not 3's
    for model, graphs in ((models[2], 5), (models[0], 6), (models[2], 6), (models[3], 7)):
        assert _tokens(model, step, new=4) == _tokens(model, None, new=4)
        assert runs.graphs == graphs, (model.cfg.layers, runs.graphs, graphs)


def test_the_recompile_limit_falls_back_to_eager_with_one_warning():
    """recompile_limit 1 stands for the default 8 (each graph past a code object's first counts): a batch of 1 then
    of 2 in one copy reaches it. Before: FailOnRecompileLimitHit out of the batch of 2's generation."""
    from longctx.models.compiled_copies import CompiledDecodeFallback

    model = build_model(_config(), seed=0).eval()
    runs = Runs()
    step = CompiledStep(backend=runs)
    watch = RecompileWatch()
    sampled = Sampling(temperature=0.8, top_k=20, seed=3)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = []
        for rows, sampling in [(1, None), (2, None), (1, None), (3, None), (1, sampled), (2, sampled)]:
            before = runs.runs
            got.append((_tokens(model, step, rows, sampling=sampling), runs.runs - before))
            assert got[-1][0] == _tokens(model, None, rows, sampling=sampling), (rows, sampling)
    fallbacks = [w for w in caught if issubclass(w.category, CompiledDecodeFallback)]
    # one warning per copy that reached the limit (greedy's and the sampled variant's `next_token_1`), saying why
    assert len(fallbacks) == 2, [str(w.message) for w in fallbacks]
    assert all("recompile limit" in str(w.message) and "eagerly" in str(w.message) for w in fallbacks)
    assert runs.graphs == 2  # a batch of 1 per copy, nothing compiled past the limit
    graph_runs = [r for _, r in got]
    assert graph_runs[0] > 0 and graph_runs[1] == 0 and graph_runs[2] > 0 and graph_runs[3] == 0  # the graph serves
    assert [r.limit_hit for r in watch.take()] == [True, True]  # (the CLI's lines say so)


def _compiler_or_skip():
    from longctx.errors import ConfigError
    from longctx.models.compile import check_compiler

    try:
        check_compiler("cpu")
    except ConfigError as e:
        pytest.skip(str(e))


def test_inductor_shares_a_copy_across_rope_theta_and_falls_back_to_eager_tokens():
    _compiler_or_skip()
    from longctx.models.compiled_copies import COPIES, CompiledDecodeFallback

    step = CompiledStep()
    models = [build_model(_config(rope_theta=theta, init_std=0.1), seed=0).eval() for theta in (1e4, 500.0)]
    assert _tokens(models[0], None) != _tokens(models[1], None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model in models:
            assert _tokens(model, step) == _tokens(model, None)
        assert len(COPIES) == 1 and step.calls > 0
        with torch._dynamo.config.patch(recompile_limit=1):
            assert _tokens(models[1], step, rows=2) == _tokens(models[1], None, rows=2)
    assert [w.category for w in caught if issubclass(w.category, CompiledDecodeFallback)] == [CompiledDecodeFallback]
