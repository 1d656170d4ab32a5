"""The GliDe draft (models/glide.py) and its decoding (generate/speculative.py GlideDrafter):
- the block-stale cross-attention equals a reference written position by position (query t sees
  the target's keys before t // block * block; the first block sees none and gets 0);
- decoding reads the target's cache as training does: after the target's prefill of a sequence,
  the draft's logits fed token by token (each seeing the whole cache as of its block's start)
  equal the training forward's at every position;
- speculative decoding with a GliDe draft is token-identical to plain greedy decoding."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.generate.drafters import GlideDrafter
from longctx.generate.engine import generate
from longctx.generate.local import prefill
from longctx.generate.speculative import speculative_generate
from longctx.models.glide import GlideDraft, block_stale_visible, cross_attention
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model


def _target(layers=3):
    return build_model(load_config(overrides=[f"--model.layers={layers}"]).model, seed=1).eval()


def test_block_stale_cross_attention_against_a_per_position_reference():
    g = torch.Generator().manual_seed(0)
    b, n, heads, kv, d, block = 2, 11, 4, 2, 8, 3
    q = torch.randn(b, n, heads, d, generator=g)
    k, v = torch.randn(b, kv, n, d, generator=g), torch.randn(b, kv, n, d, generator=g)
    visible = block_stale_visible(n, block)[None].expand(b, n)
    got = cross_attention(q, k, v, visible, chunk=4)
    want = torch.zeros_like(got)
    for r in range(b):
        for t in range(n):
            seen = t // block * block
            for h in range(heads):
                if seen == 0:
                    continue  # the first block sees no target position: 0
                keys, values = k[r, h // (heads // kv), :seen], v[r, h // (heads // kv), :seen]
                w = torch.softmax(keys @ q[r, t, h] / math.sqrt(d), dim=0)
                want[r, t, h] = w @ values
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert got[:, :block].abs().max() == 0


@pytest.mark.parametrize("slots", [0, 1, 6, 9])
def test_a_prefix_of_slots_reads_as_the_per_query_limit(slots):
    # decoding passes an int (every query reads the first `slots`): no mask, no host read; it must
    # equal the general path with that limit for every query
    g = torch.Generator().manual_seed(1)
    b, n, heads, kv, d, held = 1, 3, 8, 2, 16, 9
    q = torch.randn(b, n, heads, d, generator=g)
    k, v = torch.randn(b, kv, held + 4, d, generator=g), torch.randn(b, kv, held + 4, d, generator=g)
    got = cross_attention(q, k, v, slots)
    want = cross_attention(q, k, v, torch.full((b, n), slots))
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    if slots == 0:
        assert got.abs().max() == 0
    with pytest.raises(ValueError, match="prefix of slots"):
        cross_attention(q, k, v, slots, key_pos=torch.arange(held + 4)[None])


@pytest.mark.parametrize("layers", [1, 2])
def test_decoding_reads_the_target_cache_as_training_does(layers):
    target = _target()
    draft = GlideDraft(target.cfg, layers=layers).init_weights(seed=2, std=0.1)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))
    n, block = tokens.shape[1], 4
    with torch.inference_mode():
        tcache = KVCache.for_model(target, 1, n)
        prefill(target, tcache, tokens, 64)
        kv = [(tcache.k[i], tcache.v[i]) for i in draft.target_layers]
        positions = torch.arange(n)[None]
        trained = draft(target, tokens, positions, kv, block_stale_visible(n, block)[None])[0]
        own = KVCache(layers, 1, n, target.cfg.kv_heads, target.cfg.resolved_head_dim)
        for t in range(n):  # token by token, each seeing the target's slots before its block
            seen = t // block * block  # (an int, as decoding passes it: every query reads that many slots)
            seen = torch.tensor([[seen]]) if t % 2 else seen
            out = draft(target, tokens[:, t:t + 1], positions[:, t:t + 1], kv, seen, cache=own)[0, -1]
            assert torch.allclose(out, trained[t], atol=1e-4, rtol=0), t


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_decoding_with_a_glide_draft_is_plain_greedy(k):
    target = _target()
    draft = GlideDraft(target.cfg, layers=1).init_weights(seed=4, std=0.05)
    for n in (1, 40):
        prompt = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        plain = generate(target, [prompt], max_new_tokens=24)[0].tokens
        spec = speculative_generate(target, GlideDrafter(draft, target, n + 24 + k + 2, block=k), prompt,
                                    max_new_tokens=24, k=k)
        assert spec.tokens == plain and spec.passes <= 24
        # a prompt pass over the last 8 tokens only (LongSpec's window): still plain greedy, with its
        # positions where they were (a window of the whole prompt: the very same rounds)
        for window, same in ((8, False), (n, True)):
            drafter = GlideDrafter(draft, target, n + 24 + k + 2, block=k, window=window)
            windowed = speculative_generate(target, drafter, prompt, max_new_tokens=24, k=k)
            assert windowed.tokens == plain and drafter.offset == max(0, n - 1 - window)
            if same:
                assert windowed.accepted == spec.accepted


@pytest.mark.parametrize("layers", [1, 2])
def test_a_prompt_pass_that_only_fills_the_cache_leaves_the_full_pass_cache(layers):
    # GlideDrafter.start skips the last layer's attention, cross-attention and MLP (nobody reads the
    # prompt pass's outputs): its cache must hold what the full pass leaves, every layer
    target = _target()
    draft = GlideDraft(target.cfg, layers=layers).init_weights(seed=5, std=0.1)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(6))
    n = tokens.shape[1]
    with torch.inference_mode():
        tcache = KVCache.for_model(target, 1, n)
        prefill(target, tcache, tokens, 64)
        kv = [(tcache.k[i], tcache.v[i]) for i in draft.target_layers]
        args = (target, tokens, torch.arange(n)[None], kv, block_stale_visible(n, 4)[None])
        caches = [KVCache(layers, 1, n + 2, target.cfg.kv_heads, target.cfg.resolved_head_dim) for _ in range(2)]
        full = draft.hidden_states(*args, cache=caches[0])
        assert full.shape == (1, n, target.cfg.dim)
        assert draft.hidden_states(*args, cache=caches[1], fill_only=True) is None
        assert int(caches[1].lengths[0]) == n == int(caches[0].lengths[0])
        assert caches[0].k.abs().sum() > 0
        assert torch.allclose(caches[1].k, caches[0].k, atol=1e-6, rtol=0)
        assert torch.allclose(caches[1].v, caches[0].v, atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="fill_only"):
            draft.hidden_states(*args, fill_only=True)


@pytest.mark.parametrize("window", [0, 12])
def test_the_drafter_prompt_pass_fills_the_cache_a_full_pass_would(window):
    # decoding stays plain greedy whatever the draft's cache holds, so the drafter's prompt pass is
    # checked against the full forward over the same tokens, positions and block-stale reads
    target = _target()
    draft = GlideDraft(target.cfg, layers=2).init_weights(seed=7, std=0.1)
    prompt = torch.randint(0, target.cfg.vocab_size, (31,), generator=torch.Generator().manual_seed(8)).tolist()
    n, block = len(prompt) - 1, 4
    with torch.inference_mode():
        tcache = KVCache.for_model(target, 1, len(prompt) + 8)
        prefill(target, tcache, torch.tensor([prompt]), 64)
        drafter = GlideDrafter(draft, target, len(prompt) + 8, block=block, window=window)
        drafter.start(prompt, tcache)
        first = max(0, n - window) if window else 0
        assert drafter.offset == first and int(drafter.cache.lengths[0]) == n - first
        kv = [(tcache.k[i], tcache.v[i]) for i in draft.target_layers]
        want = KVCache(2, 1, len(prompt) + 8, target.cfg.kv_heads, target.cfg.resolved_head_dim)
        draft(target, torch.tensor([prompt[first:n]]), torch.arange(first, n)[None], kv,
              block_stale_visible(n, block)[None, first:], cache=want)
        held = n - first
        assert torch.allclose(drafter.cache.k[:, :, :, :held], want.k[:, :, :, :held], atol=1e-6, rtol=0)
        assert torch.allclose(drafter.cache.v[:, :, :, :held], want.v[:, :, :, :held], atol=1e-6, rtol=0)
