"""The compiled decode step (models/static_decode.py) against the eager path, the reference:
- plain greedy decoding, batch 1 and ragged rows of different prompt lengths, and sampled decoding
  with several samples per prompt: the same tokens;
- a speculative chain (K = 3: 4 tokens per verification, padded to the bucket of 4; and a draft
  that stops early, fewer tokens in the same bucket; the draft model's own steps compiled too) and
  CaPE's tree (any size, padded): the same
  tokens as eager plain greedy, and the verifications went through the compiled step;
- compilations are counted (a counting backend): one per bucket, never one per token or per round,
  and a second generation, of the same shapes or of another cache length, compiles nothing;
- what has no static form (a MoE model) or no spare slot decodes eagerly; the prefill stays eager.
Inductor itself (the compiled kernels, C++ wrapper) is the slow test at the end and
tests/unit/test_bench_generate_compile.py (`bench generate --compile both`)."""

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from longctx.config import load_config
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.speculative import speculative_generate
from longctx.models.cached_attention import CacheStep
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model
from longctx.models.static_decode import BUCKETS, CompiledStep, bucket


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compilations of earlier tests neither count nor use up the recompile limit
    yield
    torch._dynamo.reset()


def _model(seed, preset="debug", **over):
    """The debug model with 2 layers, not its 4 (as test_static_decode_audit.py's): every layer is the same
    code (its cache read and write; the second one's input the first one's output), and the time to trace
    and compile a step grows with the layers (the inductor test: ~100 s with 4 of a loaded 2-core CPU)."""
    if preset == "debug":
        over = {"layers": 2, **over}
    overrides = [f"--model.preset={preset}"] + [f"--model.{k}={v}" for k, v in over.items()]
    return build_model(load_config(overrides=overrides).model, seed=seed).eval()


def _prompt(n, seed=0, vocab=320):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Counted(CompiledStep):
    """A step compiled with a counting backend (the captured graph run as is), counting its calls."""

    def __init__(self):
        self.counter = CompileCounter()
        super().__init__(backend=self.counter)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 17, 64)] == [1, 2, 4, 8, 8, 32, 64]
    assert bucket(BUCKETS[-1] + 1) is None


def test_plain_decoding_is_eager_token_for_token_and_compiles_once():
    model = _model(1)
    prompts = [_prompt(40, seed=1), _prompt(7, seed=2), _prompt(23, seed=3)]
    for batch in ([prompts[0]], prompts):  # batch 1; ragged rows (each row its own slots and mask)
        eager = [r.tokens for r in generate(model, batch, max_new_tokens=24)]
        step = Counted()
        compiled = [r.tokens for r in generate(model, batch, max_new_tokens=24, compile=step)]
        assert compiled == eager
        assert step.calls == 23  # every decode step after the prefill's token went through it
        assert step.counter.frame_count == 1  # one graph for the 23 steps: no recompilation per token
        again = [r.tokens for r in generate(model, batch, max_new_tokens=24, compile=step)]
        assert again == eager and step.counter.frame_count == 1  # the same shapes: nothing compiled
        longer = [r.tokens for r in generate(model, batch, max_new_tokens=31, compile=step)]
        assert [t[:24] for t in longer] == eager and step.counter.frame_count == 1  # another cache length: neither
        torch._dynamo.reset()


def test_sampled_decoding_with_samples_is_eager_token_for_token():
    model = _model(2)
    s = Sampling(temperature=0.9, top_k=50, seed=5)
    prompts = [_prompt(12, seed=4), _prompt(30, seed=5)]
    eager = [r.tokens for r in generate(model, prompts, max_new_tokens=16, sampling=s, num_samples=2)]
    step = Counted()
    got = [r.tokens for r in generate(model, prompts, max_new_tokens=16, sampling=s, num_samples=2, compile=step)]
    assert got == eager and step.counter.frame_count == 1


@pytest.mark.parametrize("stop_below", [0.0, 0.5])
def test_speculative_chain_is_plain_greedy_and_compiles_per_bucket(stop_below):
    """K = 3: a verification of 4 tokens (bucket 4); with a confidence stop the draft ends rounds
    early, so verifications of 2 to 4 tokens: buckets 2 and 4, each compiled once."""
    target, draft = _model(1), _model(2, layers=1)
    prompt = _prompt(33, seed=7)
    plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
    step, draft_step = Counted(), Counted()
    spec = speculative_generate(target, ModelDrafter(draft, 80, compile=draft_step), prompt, max_new_tokens=30,
                                k=3, stop_below=stop_below, compile=step)
    assert spec.tokens == plain
    assert step.calls == spec.passes  # every verification went through it
    shapes = {bucket(p + 1) for p in spec.proposed}
    assert step.counter.frame_count == len(shapes) <= 2
    # the draft's own steps too: one or two tokens (a kept last proposal, then the pending one)
    assert draft_step.calls >= sum(spec.proposed) and draft_step.counter.frame_count <= 2


def test_cape_tree_is_plain_greedy_through_the_compiled_step():
    """Trees of varying sizes, padded to their bucket: the padded nodes see nothing real and nothing
    real sees them; the accepted path is kept (cache.keep) as eagerly."""
    target, draft = _model(1), _model(1)
    with torch.no_grad():  # a draft that hesitates, so trees grow alternatives
        w = draft.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.8)
    prompt = _prompt(20, seed=8)
    plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
    eager = speculative_generate(target, ModelDrafter(draft, 120), prompt, max_new_tokens=30, k=3,
                                 cape=CapeTable.parse("0.5:4,0.8:2,1:1"))
    step = Counted()
    spec = speculative_generate(target, ModelDrafter(draft, 120), prompt, max_new_tokens=30, k=3,
                                cape=CapeTable.parse("0.5:4,0.8:2,1:1"), compile=step)
    assert spec.tokens == plain == eager.tokens
    assert spec.accepted == eager.accepted  # the same trees, the same paths kept
    assert step.calls == spec.passes and 1 <= step.counter.frame_count <= 3  # buckets 8, 16 (, 4)


def test_what_has_no_static_form_decodes_eagerly():
    """A MoE model (routing has data-dependent shapes) is not handed to the step; a call that would
    reach the spare slot, or of more tokens than the largest bucket, runs the eager path."""
    moe = _model(3, preset="debug-moe")
    prompt = _prompt(9, seed=9)
    step = Counted()
    assert generate(moe, [prompt], max_new_tokens=6, compile=step)[0].tokens == \
        generate(moe, [prompt], max_new_tokens=6)[0].tokens
    assert step.calls == 0
    cache = KVCache.for_model(_model(1), 1, 16)
    assert step.handles(cache, CacheStep(np.array([10]), 5, None))
    assert not step.handles(cache, CacheStep(np.array([11]), 5, None))  # would write the spare slot 15
    assert not step.handles(cache, CacheStep(np.array([0]), BUCKETS[-1] + 1, None))


@pytest.mark.slow
def test_inductor_decode_chain_and_tree_are_eager_token_for_token():
    """The real compiler (inductor, C++ wrapper on a CPU): plain, chain and CaPE tree tokens as eager,
    also after the weights change in place (no weight frozen into the graph)."""
    target, draft = _model(1), _model(2, layers=1)
    prompt = _prompt(50, seed=11)
    plain = generate(target, [prompt], max_new_tokens=20)[0].tokens
    step = CompiledStep()
    assert generate(target, [prompt], max_new_tokens=20, compile=step)[0].tokens == plain
    for cape in (None, CapeTable.parse("0.5:2,1:0")):
        spec = speculative_generate(target, ModelDrafter(draft, 100), prompt, max_new_tokens=20, k=3, cape=cape,
                                    compile=step)
        assert spec.tokens == plain
    assert step.calls > 19
    with torch.no_grad():  # weights changed in place (a training step): the graph reads them, not a copy
        target.layers[0].feed_forward.w2.weight.mul_(-3.0)
    changed = generate(target, [prompt], max_new_tokens=20)[0].tokens
    assert changed != plain and generate(target, [prompt], max_new_tokens=20, compile=step)[0].tokens == changed
