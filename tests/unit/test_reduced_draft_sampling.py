"""Speculative sampling stays exact with drafts whose distribution is zero on most tokens: a GliDe and a
Clover draft with a reduced vocabulary (models/draft_vocab.py: 5 of a tiny target's 8 tokens). At T = 1
the first two new tokens of 2,000 seeded continuations follow the target's own distribution
(chi-square p > 0.01, tests/unit/test_speculative.py's check), tokens the drafts can never propose
included: the residual distribution after a rejection must put them back."""

import pytest
import torch
from test_speculative import WRONG_RUNS, _model, _pairs, pooled_chisquare

from longctx.generate.drafters import CloverDrafter, GlideDrafter
from longctx.generate.local import prefill
from longctx.generate.sampling import Sampling
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft
from longctx.models.kv_cache import KVCache

IDS = [0, 2, 3, 5, 7]


def _drafter(kind, target):
    if kind == "glide":
        draft = GlideDraft(target.cfg, 1, vocab=len(IDS)).init_weights(seed=3, std=0.3)
    else:
        draft = CloverDraft(target.cfg, vocab=len(IDS)).init_weights(seed=3, std=0.3)
    draft.vocab.ids.copy_(torch.tensor(IDS))
    with torch.no_grad():
        draft.norm.weight.mul_(4.0)  # a draft of some conviction, so rejections happen
    cls = GlideDrafter if kind == "glide" else CloverDrafter
    return cls(draft.eval(), target, 16, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_reduced_vocabulary_draft_samples_the_targets_distribution(kind, monkeypatch):
    import longctx.generate.speculative as sp
    from longctx.generate.acceptance import sampling_probs

    vocab, runs, sampling = 8, 2000, Sampling(temperature=1.0)
    target = _model(1, layers=2, vocab=vocab, dim=32)
    with torch.no_grad():
        target.lm_head_weight.mul_(6.0)
    prompt = [3, 1, 4, 6]
    with torch.inference_mode():
        p1 = sampling_probs(target(torch.tensor([prompt]))[:, -1], sampling)[0]
        seconds = torch.cat([sampling_probs(target(torch.tensor([prompt + [a]]))[:, -1], sampling)
                             for a in range(vocab)])
        exact = (p1[:, None] * seconds).flatten().double().numpy()
        drafter = _drafter(kind, target)  # (before the prefill: a Clover drafter's hook captures it)
        cache = KVCache.for_model(target, 1, 16)
        first = sampling_probs(prefill(target, cache, torch.tensor([prompt]), 64), sampling)[0]
        drafter.start(prompt, cache)
    outside = [t for t in range(vocab) if t not in IDS]
    assert exact.reshape(vocab, vocab)[:, outside].sum() > 0.2  # the target often writes what the draft cannot

    def draw_pair(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            a = int(torch.multinomial(first, 1, generator=g))
            cache.truncate(len(prompt))
            drafter.rewind(prompt)
            kept, following, _ = sp.speculative_round(target, cache, drafter, a, 2, sampling, g)
        return a, (kept + [following])[0]

    def pvalue(counts):
        return pooled_chisquare(counts, exact, int(counts.sum()))

    counts = _pairs(draw_pair, runs, vocab)
    assert counts[exact == 0].sum() == 0
    p = pvalue(counts)
    print(f"{kind}: chi-square p = {p:.3g}")
    assert p > 0.01
    # the same check rejects a sampler that keeps every proposal (the second token then never lies
    # outside the draft's vocabulary when a proposal was made)
    from longctx.generate.acceptance import choose

    monkeypatch.setattr(sp, "accept", lambda proposals, q, p, s, g: (len(proposals), choose(p[-1], s, g)))
    # (500 draws: that sampler is far from the target, p 1e-170 (glide) and 1e-263 (clover) there: lambda ~ 880
    # and 1,320 on 34 degrees of freedom, a false pass below 1e-100; see test_speculative.WRONG_RUNS)
    p_wrong = pvalue(_pairs(draw_pair, WRONG_RUNS, vocab))
    print(f"{kind}: every proposal kept: chi-square p = {p_wrong:.3g}")
    assert p_wrong < 0.01
