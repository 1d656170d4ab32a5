"""InfLLM's `ordered` placement (--infllm-positions ordered, models/context_memory.py place_far): the initial
tokens and the retrieved units laid end to end in slot order right before the local span.
- with every unit retrieved it is plain attention (the gaps it closes are empty): the same tokens and
  logprobs as generating without the memory;
- with some units retrieved, every query's attention equals an independent reference that lays out the
  recorded choice of each layer and call by hand (its own RoPE, per query, in float64);
- the distances it shows stay below the shape's reach, and the command checks that reach (topk counts)
  before any work."""

import math

import pytest
import test_infllm
import torch
from test_infllm import PROMPT, SMALL, _prepare, _prompt, _turn, check_against_reference

from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models.context_memory import InfLLMMemory, InfLLMShape

model, hf64 = test_infllm.model, test_infllm.hf64  # (its fixtures: the tiny model, the 64-position HF directory)


def test_every_unit_retrieved_is_plain_attention(model):
    shape = InfLLMShape(block=4, repr=2, topk=64, window=16, init=4, positions="ordered")
    prompt = _prompt(80, seed=2)
    plain = generate(model, [prompt], max_new_tokens=12, prefill_chunk=8, logprobs=0)[0]
    backend = InfLLMGeneration(shape)
    ours = generate(model, [prompt], max_new_tokens=12, prefill_chunk=8, logprobs=0, backend=backend)[0]
    assert backend.memory.built.max() > 0  # units formed, and all were retrieved (topk >= units)
    assert ours.tokens == plain.tokens
    torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    # the shared placement of the same memory is not plain attention (the test can tell them apart)
    shared = generate(model, [prompt], max_new_tokens=12, prefill_chunk=8, logprobs=0,
                      backend=InfLLMGeneration(InfLLMShape(block=4, repr=2, topk=64, window=16, init=4)))[0]
    assert not torch.allclose(torch.tensor(shared.logprobs), torch.tensor(plain.logprobs), atol=1e-3)


def _ordered_reference(shape, ends, chosen, layer, inv_freq):
    """Query i of the call ending at ends[i] sees: the initial tokens at their slots, the call's chosen units
    (chosen[(layer, end)], ascending) end to end from init, then its local span [lo, i] from init + k x block
    on; before any unit exists, everything at its slot. q and k arrive unrotated."""

    def core(q, k, v, doc_ids):
        n, h, kv = q.shape[1], q.shape[2], k.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float64)
        for i in range(n):
            e = ends[i]
            units = max(0, (e - shape.window - min(shape.init, e)) // shape.block)
            if units == 0:
                keys, kpos, qpos = list(range(i + 1)), list(range(i + 1)), i
            else:
                lo = shape.init + units * shape.block
                picked = chosen[(layer, e)]
                keys = list(range(shape.init))
                for u in picked:
                    keys += range(shape.init + u * shape.block, shape.init + (u + 1) * shape.block)
                seen = len(keys)
                kpos = list(range(seen)) + [seen + j - lo for j in range(lo, i + 1)]
                keys += range(lo, i + 1)
                qpos = seen + i - lo
            qi = _turn(q[0, i], torch.tensor(float(qpos)), inv_freq)
            kj = _turn(k[0, keys], torch.tensor(kpos, dtype=torch.float64)[:, None, None], inv_freq)
            for head in range(h):
                g = head // (h // kv)
                p = torch.softmax(kj[:, g] @ qi[head] / math.sqrt(q.shape[-1]), dim=0)
                out[0, i, head] = p @ v[0, keys, g].double()
        return out.to(q.dtype)
    return core


def test_some_units_retrieved_equal_a_hand_laid_reference(model, monkeypatch):
    shape = InfLLMShape(block=4, repr=2, topk=2, window=16, init=4, positions="ordered")
    prompt, new = _prompt(80, seed=3), 12
    chosen, ends_of_call = {}, {}
    real_core, real_select = InfLLMMemory.core, InfLLMMemory._select

    def core(self, q, k, v, layer, step):
        ends_of_call[layer.index] = int(step.start[0]) + step.new
        return real_core(self, q, k, v, layer, step)

    def select(self, index, q_far, units):
        picked = real_select(self, index, q_far, units)
        chosen[(index, ends_of_call[index])] = picked[0].tolist()
        return picked

    monkeypatch.setattr(InfLLMMemory, "core", core)
    monkeypatch.setattr(InfLLMMemory, "_select", select)
    backend = InfLLMGeneration(shape)
    ours = generate(model, [prompt], max_new_tokens=new, prefill_chunk=8, logprobs=0, backend=backend)[0]
    units = (len(prompt) + new - 1 - shape.window - shape.init) // shape.block
    assert units > shape.topk and any(len(c) == shape.topk and c != list(range(shape.topk)) for c in chosen.values())
    check_against_reference(model, prompt, ours, backend.chunk(8),
                            lambda index, ends, inv_freq: _ordered_reference(shape, ends, chosen, index, inv_freq))


def test_the_reach_counts_the_retrieved_units(hf64):
    from longctx.errors import ConfigError

    # SMALL: init 8, window 16, block 8; topk 4: 8 + 4 x 8 + 16 + 8 - 1 = 63 positions, within the model's 64
    request = _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--infllm-topk", "4",
                       "--infllm-positions", "ordered")
    assert request.memory.positions == "ordered" and request.memory.positions_needed == 63
    with pytest.raises(ConfigError, match=r"--infllm-init \+ --infllm-topk x --infllm-block \+ --infllm-window \+ "
                                          r"--infllm-block - 1 = 71 positions, past the 64.*--infllm-positions "
                                          r"shared"):
        _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--infllm-topk", "5",
                 "--infllm-positions", "ordered")
    # shared shows every retrieved unit at one distance: the same topk is within reach
    shared = _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--infllm-topk", "5").memory
    assert shared.positions_needed == 32
