"""The compiled static-shape decode step (models/static_decode.py) and the cache it writes
(models/kv_cache.py), against the independent reference: the model's plain forward over each row's
whole sequence, no cache (dynamo captures the step, run as captured: the "eager" backend, so these
tests compile in seconds; inductor's kernels are tests/unit/test_compiled_decode.py's slow test):
- ragged rows (prompts of different lengths in one batch), GQA and MQA, one token per call and a
  chain of 3 (padded to the bucket of 4): every call's logits;
- the capacity boundary: the calls that would reach the spare last slot decode eagerly, a prompt may
  fill the cache exactly, and a step past it is refused with what to do;
- in bf16, the step's attention keeps its scores in fp32 (as the eager path's kernel does): a bf16
  matmul rounded them to bf16 before the softmax, 20x the eager path's error at scores of ~25;
- a cache with its own attention core (InfLLM's memory, a caller's cache_core) is not handed to the
  static step, which would attend over every slot instead (other tokens, silently)."""

import math

import numpy as np
import pytest
import torch

from longctx.config import ModelConfig, load_config
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models.context_memory import InfLLMShape
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep, _attend, _visible, install


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(**over):
    overrides = ["--model.layers=2"] + [f"--model.{k}={v}" for k, v in over.items()]
    return build_model(load_config(overrides=overrides).model, seed=1).eval()


def _full(model, seq: torch.Tensor) -> torch.Tensor:
    """The reference: logits [len, vocab] of the plain forward over the whole sequence."""
    return model.logits(model.hidden_states(seq[None]))[0]


def _decode_error(model, lengths, capacity: int, steps: int, chunk: int) -> tuple[float, int]:
    """Prefill rows of `lengths` (each its own row view), install a step, feed `steps` more tokens per
    row `chunk` at a time: the largest difference of any call's logits from the reference, and how many
    calls the compiled step took."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n + steps,), generator=g) for n in lengths]
    cache = KVCache.for_model(model, len(lengths), capacity)
    step = CompiledStep(backend="eager")
    worst = 0.0
    with torch.inference_mode():
        for r, n in enumerate(lengths):
            model.hidden_states(seqs[r][None, :n], cache=cache.rows(r, r + 1))
        assert install(cache, model, step)
        for t in range(0, steps, chunk):
            fed = torch.stack([seqs[r][n + t:n + t + chunk] for r, n in enumerate(lengths)])
            logits = model.logits(model.hidden_states(fed, cache=cache))
            for r, n in enumerate(lengths):
                worst = max(worst, (logits[r] - _full(model, seqs[r][:n + t + chunk])[-chunk:]).abs().max().item())
    assert cache.lengths.tolist() == [n + steps for n in lengths]
    return worst, step.calls


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("chunk", [1, 3], ids=["decode", "chain3"])
def test_compiled_calls_on_ragged_rows_match_the_full_forward(kv_heads, chunk):
    # rows of 5, 9 and 2 tokens: each row's own positions and slots; the last call of the longest row
    # ends at slot 14 of 16, so every call stays off the spare slot and goes through the step
    worst, calls = _decode_error(_model(kv_heads=kv_heads), [5, 9, 2], 9 + 6 + 1, 6, chunk)
    assert calls == 6 // chunk
    assert worst < 1e-4


def test_calls_reaching_the_spare_slot_decode_eagerly_and_a_full_cache_refuses():
    model = _model()
    # the longest row ends exactly at the cache's length: its last call would write the spare slot
    worst, calls = _decode_error(model, [5, 9], 9 + 6, 6, 1)
    assert worst < 1e-4 and calls == 5
    cache = KVCache.for_model(model, 1, 8)
    install(cache, model, CompiledStep(backend="eager"))
    with torch.inference_mode():
        model(torch.arange(8)[None], cache=cache)  # a prompt that fills the cache exactly
        with pytest.raises(ValueError, match="at most 8 tokens per row; 8 held . 1 new do not fit.*larger max_len"):
            model(torch.tensor([[1]]), cache=cache)
    assert cache.lengths.tolist() == [8] and cache.step is None  # nothing wrapped, the cache still usable


def test_compile_leaves_a_cache_with_its_own_core_to_it():
    # InfLLM's memory attends to its initial tokens, the top-k units and the local window only; the
    # static step would attend to every slot of the cache. generate(compile=...) on its backend must
    # give the memory's tokens (the CLI refuses --compile with it; the library call did not)
    cfg = ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab_size=97, init_std=0.2)
    model = build_model(cfg, seed=5).eval()
    prompt = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    shape = InfLLMShape(block=4, repr=2, topk=1, window=16, init=4)
    eager = generate(model, [prompt], max_new_tokens=12, backend=InfLLMGeneration(shape))[0].tokens
    full = generate(model, [prompt], max_new_tokens=12)[0].tokens
    assert eager != full  # (the memory matters here: a test that can tell the two apart)
    step = CompiledStep(backend="eager")
    compiled = generate(model, [prompt], max_new_tokens=12, backend=InfLLMGeneration(shape), compile=step)
    assert compiled[0].tokens == eager
    assert step.calls == 0


def test_a_rejected_chain_rolls_back_under_the_compiled_step():
    # a speculative verification of 4 tokens (compiled), 1 kept: truncate forgets 3 slots, whose keys
    # stay in the cache; the next calls (compiled) must neither see them nor shift their positions
    model = _model()
    seq = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(model, 1, 24)
    step = CompiledStep(backend="eager")
    with torch.inference_mode():
        model(seq[None, :6], cache=cache)
        install(cache, model, step)
        model(torch.tensor([[int(seq[6]), 5, 6, 7]]), cache=cache)
        cache.truncate(7)
        logits = model(seq[None, 7:9], cache=cache)[0]
        last = model(seq[None, 9:10], cache=cache)[0]
    assert step.calls == 3
    assert (logits - _full(model, seq[:9])[-2:]).abs().max() < 1e-4
    assert (last - _full(model, seq)[-1:]).abs().max() < 1e-4


def test_bf16_attention_keeps_its_scores_in_fp32():
    # the compiled graph's attention (static_hidden_states: _visible, then _attend per layer) on bf16
    # inputs with scores of std ~25 (a trained model's peaked attention), two rows of different lengths
    b, h, kv, d, length = 2, 4, 2, 64, 512
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(b, 1, h, d, generator=g) * 5).bfloat16()
    k = (torch.randn(b, kv, length, d, generator=g) * 5).bfloat16()
    v = torch.randn(b, kv, length, d, generator=g).bfloat16()
    start = np.array([length - 2, 300])  # slots each row held; its new token's key at slot `start`
    visible = _visible(torch.as_tensor(start), torch.ones(1, 1, dtype=torch.bool), length, h // kv)
    out = _attend(q, k, v, visible).float()
    # the reference: fp32 softmax attention over the same bf16 values, each row's slots 0..start written out
    for r, s in enumerate(start.tolist()):
        kk = k[r, :, :s + 1].float().repeat_interleave(h // kv, 0)  # [h, s + 1, d]
        vv = v[r, :, :s + 1].float().repeat_interleave(h // kv, 0)
        scores = torch.einsum("hd,hld->hl", q[r, 0].float(), kk) / math.sqrt(d)
        ref = torch.einsum("hl,hld->hd", scores.softmax(-1), vv)
        # bf16 rounding of the output alone is ~4e-3 here; scores rounded to bf16 gave 0.15
        assert (out[r, 0] - ref).abs().max() < 0.03


def test_keep_moves_the_nodes_in_any_order_and_refuses_others():
    """KVCache.keep after a call of 3 tokens: the kept nodes' keys and values, in the order given (nodes
    [2, 0] copied slot by slot read node 0 after slot 0 was overwritten), and an index outside the call
    refused (it copied stale slots silently)."""
    model = _model()
    cache = KVCache.for_model(model, 1, 16)
    with torch.inference_mode():
        model.hidden_states(torch.arange(4)[None], cache=cache)
        model.hidden_states(torch.tensor([[7, 8, 9]]), cache=cache)
        k, v = cache.k.clone(), cache.v.clone()
        cache.keep([2, 0])
    assert cache.lengths.tolist() == [6]
    assert torch.equal(cache.k[:, :, :, 4:6], k[:, :, :, [6, 4]])
    assert torch.equal(cache.v[:, :, :, 4:6], v[:, :, :, [6, 4]])
    assert torch.equal(cache.k[:, :, :, :4], k[:, :, :, :4])
    with torch.inference_mode():
        model.hidden_states(torch.tensor([[1, 2]]), cache=cache)
    with pytest.raises(ValueError, match="indices of the last call's 2 tokens"):
        cache.keep([0, 3])


def test_reset_forgets_a_tree_mask_a_failed_call_left():
    """among() before a call that failed: reset() (the next prompt) must not hand that mask to the next
    prompt's first call (it raised for another shape, or masked a same-shaped call silently)."""
    model = _model()
    cache = KVCache.for_model(model, 1, 16)
    cache.among(torch.eye(3, dtype=torch.bool))  # a tree whose call never ran
    cache.reset()
    with torch.inference_mode():
        got = model.logits(model.hidden_states(torch.tensor([[5, 6, 7]]), cache=cache))[0]
    torch.testing.assert_close(got, _full(model, torch.tensor([5, 6, 7])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights, held", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_cache_in_another_dtype_than_the_keys_is_refused_by_name(weights, held):
    """A cache allocated in another dtype than the model computes keys in failed inside attention with a
    bare 'expected scalar type Float but found BFloat16'; the append names both and the fix."""
    model = _model().to(weights)
    cache = KVCache.for_model(model, 1, 16, dtype=held)
    with torch.inference_mode(), pytest.raises(TypeError, match=f"keys in {weights} but the KV cache holds {held}"):
        model.hidden_states(torch.tensor([[5, 6, 7]]), cache=cache)
    assert cache.lengths.tolist() == [0]
