"""What a GliDe draft's cross-attention reads while decoding, against training's block-stale mask
(models/glide.py block_stale_limit: position t reads the target's positions below t // block * block).

A decode feed holds several tokens when verified tokens reach the draft late: the prompt's last token,
a fully kept round's last proposal, adaptive K's plain steps, CaPE's kept alternative; each is fed
with the next round's pending token. Until 2026-12-07 every query of the feed read every slot of the
target's cache, its own position's and later ones included, which training never shows a position:
a 2+ layer draft's own cache (layer >= 1) then held keys no training forward computes.
- the draft's cache after such feeds (plain steps, a fully kept round) equals one forward over the
  whole sequence where each verified token reads training's mask and each round's tokens the cache as
  the round began (2 and 3 layers);
- in whole generations (fixed K, adaptive K with plain steps, CaPE), no draft query reads its own or
  a later target slot, a verified token reads exactly training's limit, and the output is plain greedy."""

import pytest
import torch

from longctx.config import load_config
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import GlideDrafter
from longctx.generate.engine import generate
from longctx.generate.local import prefill
from longctx.generate.sampling import GREEDY
from longctx.generate.spec_length import AdaptiveLength
from longctx.generate.speculative import speculative_generate
from longctx.models.glide import GlideDraft
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model

BLOCK = 4


def _models(layers: int, seed: int = 2):
    target = build_model(load_config(overrides=["--model.layers=3"]).model, seed=1).eval()
    return target, GlideDraft(target.cfg, layers=layers).init_weights(seed=seed, std=0.1)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("layers", [2, 3])
def test_late_verified_tokens_fill_the_draft_cache_as_training_reads(layers):
    target, draft = _models(layers)
    vocab, k = target.cfg.vocab_size, 3
    prompt, plain_steps = _tokens(13, 3, vocab), _tokens(5, 4, vocab)
    pending, bonus = _tokens(2, 5, vocab)
    with torch.inference_mode():
        tcache = KVCache.for_model(target, 1, 64)
        prefill(target, tcache, torch.tensor([prompt]), 64)
        drafter = GlideDrafter(draft, target, 64, block=BLOCK)
        drafter.start(prompt, tcache)
        prefill(target, tcache, torch.tensor([plain_steps]), 64)  # two plain steps' tokens, verified
        for token in plain_steps:
            drafter.skipped(token)
        proposed, _ = drafter.propose(pending, k, GREEDY, None)  # feeds prompt[-1], the plain steps, pending
        prefill(target, tcache, torch.tensor([[pending, *proposed]]), 64)  # every proposal kept
        drafter.accepted(k, k)
        again, _ = drafter.propose(bonus, k, GREEDY, None)  # feeds the kept last proposal, then the bonus token
        sequence = [*prompt, *plain_steps, pending, *proposed, bonus, *again[:-1]]
        first_round, second_round = len(prompt) + len(plain_steps), len(prompt) + len(plain_steps) + k + 1
        # what each position reads: a verified token training's limit, a round's tokens the slots at its start
        visible = [t // BLOCK * BLOCK for t in range(first_round)] + [first_round] * k + \
            [(second_round - 1) // BLOCK * BLOCK] + [second_round] * k
        assert len(visible) == len(sequence) == int(drafter.cache.lengths[0])
        kv = [(tcache.k[i], tcache.v[i]) for i in draft.target_layers]
        want = KVCache(layers, 1, 64, target.cfg.kv_heads, target.cfg.resolved_head_dim)
        n = len(sequence)
        draft(target, torch.tensor([sequence]), torch.arange(n)[None], kv, torch.tensor([visible]), cache=want)
    for name in ("k", "v"):
        got, ref = getattr(drafter.cache, name)[..., :n, :], getattr(want, name)[..., :n, :]
        gap = (got - ref).abs().amax(dim=(0, 1, 2, 4))  # per position
        assert gap.max() <= 1e-5, f"{name}: positions {gap.gt(1e-5).nonzero().flatten().tolist()} differ"


def _spy(monkeypatch) -> list[tuple[list[int], list[int], int]]:
    """(positions, slots each query reads, the target's slots) of every decode-time draft call."""
    calls, hidden_states = [], GlideDraft.hidden_states

    def spy(self, target, tokens, positions, target_kv, visible, cache=None, **kw):
        n = tokens.shape[1]
        reads = [visible] * n if isinstance(visible, int) else visible[0].tolist()
        if not kw.get("fill_only"):  # (the prompt pass: test_glide.py checks it against training)
            calls.append((positions[0].tolist(), reads, int(self_cache[0].lengths[0])))
        return hidden_states(self, target, tokens, positions, target_kv, visible, cache, **kw)

    self_cache: list = []
    monkeypatch.setattr(GlideDraft, "hidden_states", spy)
    return calls, self_cache


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "cape"])
def test_no_draft_query_reads_its_own_or_a_later_target_slot(monkeypatch, mode):
    target, draft = _models(2, seed=6)
    prompt = _tokens(11, 7, target.cfg.vocab_size)
    plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
    calls, holder = _spy(monkeypatch)
    kw = {"adaptive": AdaptiveLength(4, 0.9)} if mode == "adaptive" else \
        {"cape": CapeTable.parse("0.3:3,0.6:2,0.9:1,1:0")} if mode == "cape" else {}
    drafter = GlideDrafter(draft, target, 64, block=BLOCK)
    start = drafter.start

    def held_start(prompt, target_cache=None):
        holder.append(target_cache)
        return start(prompt, target_cache)

    drafter.start = held_start
    with torch.inference_mode():
        spec = speculative_generate(target, drafter, prompt, max_new_tokens=30, k=4, **kw)
    assert spec.tokens == plain
    assert any(len(p) > 1 for p, _, _ in calls), "no multi-token feed"
    late = 0
    for positions, reads, slots in calls:
        for p, r in zip(positions, reads):
            want = p // BLOCK * BLOCK if p < slots else slots
            late += p < slots
            assert r == want, f"query at {p} reads {r} of {slots} slots; training's limit {want}"
    assert late >= (17 if mode == "adaptive" else 1)  # (adaptive K here: a run of 16 plain steps)
