"""Review of 90859ac5 (a GliDe draft's late-fed verified tokens read training's block-stale limit:
models/glide.py decode_visible, masked_prefix_attention) and 672180eb (the chain's confidence stop at T = 0
reads the penalised softmax: generate/drafters.py _confidence). No bug found; these guard what the
review checked beyond test_glidepeek121 and test_specfuzz121:
- a sharded target cache (generate/sharded.py read_attention, slots out of position order as a zigzag
  prefill leaves them) gives a late feed the same per-query limits, and the draft the same cache and
  proposals, as one device (test_glidepeek121 checks one device only);
- masked_prefix_attention is training's cross_attention for the same limits, in fp32 and bf16, a query
  that sees no slot (position < block) getting 0 as training's does;
- at T = 0 a reduced-vocabulary draft's confidence under penalties is the softmax over its own tokens of
  the penalised logits (the penalties index target ids; the rest of the target's vocabulary stays at 0)."""

import numpy as np
import pytest
import torch

from longctx.config import load_config
from longctx.generate.drafters import GlideDrafter, _confidence
from longctx.generate.local import prefill
from longctx.generate.sampling import GREEDY, Processors, Sampling
from longctx.generate.sharded import ShardedKVCache
from longctx.models.glide import GlideDraft, cross_attention, decode_visible, masked_prefix_attention
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model

BLOCK = 4


def _target():
    return build_model(load_config(overrides=["--model.layers=3"]).model, seed=1).eval()


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _OneRankSharded:
    """A one-device target cache read as a head 1 x ctx 1 ShardedKVCache whose slots are out of position
    order (no collective is called); records every read's per-query limits."""

    def __init__(self, cache: KVCache, heads: int, kv_heads: int):
        self.cache, self.heads, self.kv_heads, self.limits = cache, heads, kv_heads, []

    @property
    def lengths(self):
        return self.cache.lengths

    def read_attention(self, layer: int, q: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        held = int(self.cache.lengths[0])
        order = np.random.default_rng(held).permutation(held)
        sharded = object.__new__(ShardedKVCache)
        sharded.h = sharded.c = 1
        sharded.head_rank = sharded.ctx_rank = 0
        sharded.heads_local, sharded.kv_local = self.heads, self.kv_heads
        sharded.k, sharded.v = self.cache.k[:, :, :, order], self.cache.v[:, :, :, order]
        sharded.shares, sharded.slot_positions = np.array([[held]]), order[None]
        self.limits.append(limit[0].tolist())
        return sharded.read_attention(layer, q, limit)


def _late_feeds(target, draft, sharded: bool):
    """Prompt, 5 plain steps, a fully kept round, the next round: the draft's cache, proposals, reads."""
    vocab, k = target.cfg.vocab_size, 3
    prompt, plain = _tokens(13, 3, vocab), _tokens(5, 4, vocab)
    pending, bonus = _tokens(2, 5, vocab)
    tcache = KVCache.for_model(target, 1, 64)
    reader = _OneRankSharded(tcache, target.cfg.heads, target.cfg.kv_heads) if sharded else None
    with torch.inference_mode():
        prefill(target, tcache, torch.tensor([prompt]), 64)
        drafter = GlideDrafter(draft, target, 64, block=BLOCK)
        drafter.start(prompt, reader or tcache)
        if reader is not None:
            reader.limits.clear()  # (the prompt pass's: test_glide.py checks them)
        prefill(target, tcache, torch.tensor([plain]), 64)
        for token in plain:
            drafter.skipped(token)
        first, _ = drafter.propose(pending, k, GREEDY, None)
        prefill(target, tcache, torch.tensor([[pending, *first]]), 64)
        drafter.accepted(k, k)
        second, _ = drafter.propose(bonus, k, GREEDY, None)
    n = int(drafter.cache.lengths[0])
    return drafter.cache.k[..., :n, :].clone(), drafter.cache.v[..., :n, :].clone(), (first, second), reader


@pytest.mark.parametrize("layers", [2, 3])
def test_a_sharded_target_cache_reads_late_feeds_as_one_device(layers):
    target = _target()
    draft = GlideDraft(target.cfg, layers=layers).init_weights(seed=2, std=0.1)
    k1, v1, proposals1, _ = _late_feeds(target, draft, sharded=False)
    k2, v2, proposals2, reader = _late_feeds(target, draft, sharded=True)
    assert proposals1 == proposals2
    assert (k1 - k2).abs().max() <= 1e-5 and (v1 - v2).abs().max() <= 1e-5
    # the feeds of several tokens (prompt[-1] + 5 plain steps + pending; a kept last proposal + bonus),
    # each of the draft's layers: verified tokens at training's limit, the pending one every slot
    late = [limits for limits in reader.limits if len(limits) > 1]
    first = [t // BLOCK * BLOCK for t in range(12, 18)] + [18]
    second = [21 // BLOCK * BLOCK, 22]
    assert late == [first] * layers + [second] * layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_prefix_attention_is_trainings_cross_attention(dtype):
    g = torch.Generator().manual_seed(0)
    slots, kv_heads, heads, d = 23, 2, 4, 8
    k = torch.randn(1, kv_heads, 40, d, generator=g).to(dtype)  # (a cache longer than its slots)
    v = torch.randn(1, kv_heads, 40, d, generator=g).to(dtype)
    q = torch.randn(1, 6, heads, d, generator=g).to(dtype)
    visible = decode_visible(torch.tensor([[1, 2, 9, 17, 22, 23]]), slots, BLOCK)
    assert visible.tolist() == [[0, 0, 8, 16, 20, 23]]
    got = masked_prefix_attention(k, v, slots, q, visible)
    want = cross_attention(q, k[:, :, :slots], v[:, :, :slots], visible)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not got[:, :2].any()  # positions below the block see no slot: 0, as training's


def test_a_reduced_vocabulary_drafts_greedy_confidence_is_its_penalised_softmax():
    target = _target()
    vocab = target.cfg.vocab_size
    draft = GlideDraft(target.cfg, layers=1, vocab=16).init_weights(seed=2, std=0.1)
    ids = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:16]).values
    draft.vocab.ids.copy_(ids)
    sampling = Sampling(repetition_penalty=0.6, presence_penalty=0.5, top_k=3, top_p=0.5)  # (T = 0: no warp)
    history = [int(ids[2]), int(ids[5]), int(ids[5]), 7]  # two of the draft's ids repeated, one of the target's
    processors = Processors(sampling, [history], vocab, [], torch.device("cpu"))
    processors.chosen(torch.tensor([int(ids[9])]))  # a generated token: repetition and presence penalties
    with torch.inference_mode():
        x = torch.randn(1, 1, target.cfg.dim, generator=torch.Generator().manual_seed(4))
        logits = draft.logits(target, x)[0, -1]
        own = torch.nn.functional.linear(draft.norm(x), target.lm_head_weight[ids])[0, -1]
    penalised = own.clone()
    for i in (2, 5, 9):  # the repetition penalty (once), then presence (generated tokens only: ids[9])
        penalised[i] = penalised[i] * 0.6 if penalised[i] < 0 else penalised[i] / 0.6
    penalised[9] -= 0.5
    want = torch.softmax(penalised, -1)
    choice = int(want.argmax())
    q = torch.nn.functional.one_hot(ids[choice], vocab).float()
    got = _confidence(logits, q, int(ids[choice]), sampling, processors)
    assert got == pytest.approx(float(want[choice]), abs=1e-6)
    assert got != pytest.approx(float(torch.softmax(own, -1)[choice]), abs=1e-4)  # the penalty matters here
