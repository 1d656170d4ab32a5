"""The positions InfLLM's placements need (models/context_memory.py InfLLMShape.positions_needed): every
distance a query sees is below it, and the largest one shown is that - 1, under `shared` and `ordered` alike,
so that the checks against a model's trained positions (generate/context_memory.py check_reach) and against
windowed weights (generate/loop.py and eval's _check_window) refuse exactly the shapes that would show a distance
past them.
- the largest distance is measured, not computed: a one-frequency RoPE head whose angle grows slowly with the
  distance, turned by place_far, read back as an angle;
- `ordered` lays init + k x block keys and a local span of at most window + block - 1 tokens end to end: its
  largest distance is init + topk x block + window + block - 2 (reach - 1), not one more;
- the library's decode loop meets a windowed model's window with that reach (it met `shared`'s far + 1 under
  either placement, and let `ordered` run distances past the window);
- rows choosing different units (two prompts of one length in a call) each lay out their own choice: each
  decodes as it does alone (the other tests choose for one row only: a place_far that laid every row out by
  row 0's choice passed them)."""

import pytest
import test_infllm
import torch
from test_infllm import PROMPT, SMALL, _prepare, _prompt

from longctx.errors import ConfigError
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models.context_memory import InfLLMMemory, InfLLMShape, place_far, rotate

model, hf64 = test_infllm.model, test_infllm.hf64  # (its fixtures: the tiny model, a 64-position HF directory)

W = 1e-3  # the one RoPE frequency: angles of distances below ~3,000 stay within (-pi, pi)


def _largest_distance(shape: InfLLMShape) -> int:
    """The largest distance place_far shows between the far keys (the initial tokens and topk chosen units,
    spread over the memory) and the queries of a full local span (window + block - 1 tokens: the longest)."""
    units = 3 * shape.topk
    chosen = torch.arange(1, units, 3)[None]  # [1, topk], ascending, not the first units (gaps to close)
    lo = shape.init + units * shape.block
    slots = torch.cat([torch.arange(shape.init), (shape.init + chosen[0, :, None] * shape.block
                                                  + torch.arange(shape.block)).flatten()])[None]  # [1, G]
    query_pos = torch.arange(lo, lo + shape.window + shape.block - 1)[None]  # [1, n]
    inv_freq = torch.tensor([W], dtype=torch.float64)
    one = torch.tensor([1.0, 0.0], dtype=torch.float64)
    q = rotate(one.expand(1, query_pos.shape[1], 1, 2), query_pos, inv_freq)  # [1, n, 1, 2] at their slots
    k = rotate(one.expand(1, slots.shape[1], 1, 2), slots, inv_freq)  # [1, G, 1, 2] at their slots
    q_far = rotate(q, shape.far - query_pos, inv_freq)
    q_seen, k_seen = place_far(q, q_far, k.transpose(1, 2), slots, chosen, query_pos, lo, shape, inv_freq)
    qa = torch.atan2(q_seen[0, :, 0, 1], q_seen[0, :, 0, 0])  # [n] the angle each query is seen at
    ka = torch.atan2(k_seen[0, 0, :, 1], k_seen[0, 0, :, 0])  # [G]
    return round(float((qa[:, None] - ka[None, :]).max()) / W)


@pytest.mark.parametrize("init", [0, 3, 4])
@pytest.mark.parametrize("positions", ["shared", "ordered"])
def test_the_largest_distance_shown_is_the_reach_minus_one(positions, init):
    shape = InfLLMShape(block=4, repr=2, topk=3, window=8, init=init, positions=positions)
    assert _largest_distance(shape) == shape.positions_needed - 1
    # (the local span's own largest distance, at real distances, is less)
    assert shape.window + shape.block - 2 < shape.positions_needed - 1


def test_an_ordered_memory_that_just_fits_is_accepted(hf64):
    # SMALL (init 8, window 16, block 8) with topk 4 and init 9: 9 + 4 x 8 + 16 + 8 - 1 = 64 positions, the model's
    request = _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--infllm-topk", "4",
                       "--infllm-init", "9", "--infllm-positions", "ordered")
    assert request.memory.positions_needed == 64
    with pytest.raises(ConfigError, match=r"= 65 positions, past the 64 the model reaches"):
        _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--infllm-topk", "4",
                 "--infllm-init", "10", "--infllm-positions", "ordered")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """longctx's model of a random Mistral with a 16-token sliding window (test_swa_window_audit's weights)."""
    pytest.importorskip("transformers")
    import test_hf

    from longctx.config import load_config
    from longctx.generate.loading import load_model

    d, _ = test_hf.random_hf_dir(tmp_path_factory.mktemp("swa"), test_hf.hf_config("mistral", sliding_window=16))
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", "--model.max_seq_len=16", "--train.seq_len=16"])
    return load_model(cfg, torch.device("cpu"), torch.float32)


def test_library_generate_meets_a_window_with_the_ordered_reach(windowed):
    """A 16-token sliding window: `ordered` with init 2, window 8, block 4, topk 2 shows distances up to 20
    (reach 21), where `shared`'s far is 13. The decode loop checked far + 1 = 14 under either placement and
    decoded `ordered` past the window, without a word."""
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with pytest.raises(ConfigError, match="21 positions, past the 16-token sliding window"):
        generate(windowed, [prompt], max_new_tokens=6,
                 backend=InfLLMGeneration(InfLLMShape(4, 2, 2, 8, 2, positions="ordered")))
    # topk 1, init 1: 1 + 4 + 8 + 4 - 1 = 16 positions, the window's: runs
    fits = InfLLMGeneration(InfLLMShape(4, 2, 1, 8, 1, positions="ordered"))
    assert len(generate(windowed, [prompt], max_new_tokens=6, backend=fits)[0].tokens) == 6


def test_rows_choosing_different_units_each_decode_as_alone(model, monkeypatch):
    shape = InfLLMShape(block=4, repr=2, topk=2, window=16, init=4, positions="ordered")
    prompts = [_prompt(80, seed=3), _prompt(80, seed=4)]
    differ, real_select = [], InfLLMMemory._select

    def select(self, index, q_far, units):
        picked = real_select(self, index, q_far, units)
        differ.append(picked.shape[0] == 2 and not torch.equal(picked[0], picked[1]))
        return picked

    monkeypatch.setattr(InfLLMMemory, "_select", select)
    both = generate(model, prompts, max_new_tokens=12, prefill_chunk=8, logprobs=0, backend=InfLLMGeneration(shape))
    assert sum(differ) > 10  # (the rows' choices part in most calls: 34 of them here)
    for prompt, got in zip(prompts, both):
        alone = generate(model, [prompt], max_new_tokens=12, prefill_chunk=8, logprobs=0,
                         backend=InfLLMGeneration(shape))[0]
        assert got.tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
