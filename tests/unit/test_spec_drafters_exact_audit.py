"""Speculative decoding with every drafter kind against plain decoding, over combinations the other
tests take one at a time:
- T = 0: a plain draft model, a GliDe draft (whole prompt, or a 4-token window) and a Clover draft, each
  with the chain or CaPE's tree, a fixed or adaptive K (probes every 2 plain rounds), a confidence stop or
  none, the penalties and min_new_tokens or none, and an EOS, a stop or the limit landing anywhere in a
  round's kept proposals: the tokens and the finish reason are plain greedy decoding's (nothing past the
  end emitted), and tau x passes is the tokens decoded after the first (nothing past it counted);
- T = 0.9 with top-p, a repetition penalty, min_new_tokens and an EOS, a GliDe and a Clover draft, a
  confidence stop and adaptive K: the first three tokens of 1,000 seeded generations follow the target's
  processed distribution, enumerated by plain forwards (chi-square p > 0.01, nothing impossible drawn); a
  sampler that keeps every proposal fails the same check."""

import random

import numpy as np
import pytest
from test_sampling_audit import _tiny, processed_probs
from test_speculative import WRONG_RUNS, _model, _prompt, pooled_chisquare

from longctx.generate.acceptance import choose
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import CloverDrafter, GlideDrafter, ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.spec_length import AdaptiveLength
from longctx.generate.speculative import speculative_generate
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft

VOCAB = 64


def _drafter(kind, target, other, max_len):
    if kind == "model":
        return ModelDrafter(other, max_len)
    if kind == "clover":
        return CloverDrafter(CloverDraft(target.cfg).init_weights(seed=2, std=0.1), target, max_len, 4)
    draft = GlideDraft(target.cfg, layers=1).init_weights(seed=4, std=0.05)
    return GlideDrafter(draft, target, max_len, 4, window=4 if kind == "glide-window" else 0)


def test_every_drafter_and_setting_is_plain_greedy_with_ends_inside_rounds():
    target, other = _model(1, vocab=VOCAB), _model(2, layers=1, vocab=VOCAB)
    rng = random.Random(0)
    kinds, ends = set(), set()
    for trial in range(48):
        kind = ("model", "glide", "glide-window", "clover")[trial % 4]
        n, k, limit = rng.choice([1, 5, 17, 40]), rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 7, 15])
        cape = rng.choice([None, CapeTable.parse("0.3:3,0.6:2,0.9:1,1:0"), CapeTable.parse("1:2")])
        sampling = rng.choice([Sampling(), Sampling(repetition_penalty=1.3),
                               Sampling(presence_penalty=1.0, frequency_penalty=0.5, min_new_tokens=3)])
        prompt = _prompt(n, vocab=VOCAB, seed=trial)
        free = generate(target, [prompt], max_new_tokens=limit, sampling=sampling)[0].tokens
        eos = [free[rng.randrange(len(free))]] if len(free) > 1 and rng.random() < 0.5 else []
        stop_at = rng.choice([None, 2, 4])
        stop = None if stop_at is None else (lambda _row, out, s=stop_at: len(out) >= s)
        plain = generate(target, [prompt], max_new_tokens=limit, sampling=sampling, eos_ids=eos, stop=stop)[0]
        adaptive = AdaptiveLength(k, 0.1, probe_every=2) if rng.random() < 0.5 else False
        spec = speculative_generate(target, _drafter(kind, target, other, n + limit + 4 * k + 10), prompt,
                                    max_new_tokens=limit, k=k, cape=cape, adaptive=adaptive,
                                    stop_below=rng.choice([0.0, 0.3]), sampling=sampling, eos_ids=eos, stop=stop)
        said = (trial, kind, n, k, limit, cape, sampling, eos, stop_at)
        assert (spec.tokens, spec.finish_reason) == (plain.tokens, plain.finish_reason), said
        if spec.passes:
            assert spec.tau * spec.passes == pytest.approx(len(spec.tokens) + (spec.finish_reason == "eos") - 1), said
        kinds.add(kind)
        ends.add(spec.finish_reason if not spec.unused else "inside a round")
    assert kinds == {"model", "glide", "glide-window", "clover"} and ends == {"eos", "stop", "length",
                                                                               "inside a round"}, ends


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_sampling_with_a_glide_or_clover_draft_keeps_the_targets_distribution(kind, monkeypatch):
    import longctx.generate.speculative as sp

    vocab, eos, runs, prompt = 6, 5, 1000, [3, 1, 4, 2, 0]
    target = _tiny(1, vocab)
    draft = GlideDraft(target.cfg, layers=1).init_weights(seed=4, std=0.3) if kind == "glide" else \
        CloverDraft(target.cfg).init_weights(seed=2, std=0.3)
    s = Sampling(temperature=0.9, top_p=0.9, repetition_penalty=1.2, min_new_tokens=1)

    def probs(generated):
        return processed_probs(target, s, prompt, vocab, eos, generated)

    exact = np.zeros((vocab,) * 3)  # (a sequence that ends at an EOS is padded with EOS)
    first = probs([])
    for a in np.flatnonzero(first):
        second = probs([int(a)])
        for b in np.flatnonzero(second):
            exact[a, b] = first[a] * second[b] * (np.eye(vocab)[eos] if b == eos else probs([int(a), int(b)]))
    exact = exact.flatten()

    def counts(n):
        out = np.zeros(vocab ** 3)
        for seed in range(n):
            drafter = GlideDrafter(draft, target, 32, 2) if kind == "glide" else CloverDrafter(draft, target, 32, 2)
            r = speculative_generate(target, drafter, prompt, max_new_tokens=3, k=3, sampling=s, eos_ids=[eos],
                                     seed=seed, stop_below=0.4, adaptive=AdaptiveLength(3, 0.1))
            tokens = (r.tokens + [eos] * 3)[:3]
            out[np.ravel_multi_index(tokens, (vocab,) * 3)] += 1
        return out

    got = counts(runs)
    assert got[exact == 0].sum() == 0
    p = pooled_chisquare(got, exact, runs)
    print(f"{kind}: chi-square p = {p:.3g}")
    assert p > 0.01
    monkeypatch.setattr(sp, "accept", lambda proposals, q, p, s, g: (len(proposals), choose(p[-1], s, g)))
    biased = counts(WRONG_RUNS)
    assert biased[exact == 0].sum() > 0 or pooled_chisquare(biased, exact, WRONG_RUNS) < 0.01
