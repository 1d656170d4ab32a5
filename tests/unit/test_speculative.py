"""Speculative decoding on one device (generate/speculative.py) with a plain draft model:
- T = 0: token-identical to plain greedy decoding, with a draft that agrees (the target itself:
  every proposal kept, tau = K + 1) and with one that mostly does not (another random model), for
  several K, prompt lengths and an EOS;
- T = 1, and T = 0.9 with top-k and min-p: over 2,000 continuations of a tiny model, the first two
  tokens' distribution is the target's own (chi-square p > 0.01), also with K chosen per round by the
  adaptive length, and the same check rejects a sampler that keeps every proposal (biased toward the
  draft), so it can fail;
- the penalties and min_new_tokens: at T = 0 the output is plain decoding's with them, token for token,
  chain and CaPE's tree (T = 1: the chi-square above);
- logprobs: the target's processed distribution at each token's position (T = 0: plain decoding's);
- a prompt's own seed (speculate_one(seed=...)) decides its draws."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from longctx.config import load_config
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.spec_length import AdaptiveLength
from longctx.generate.speculative import speculative_generate
from longctx.models.llama import build_model


def _model(seed, layers=2, vocab=320, dim=None):
    overrides = [f"--model.layers={layers}", f"--model.vocab_size={vocab}"]
    if dim:
        overrides += [f"--model.dim={dim}", "--model.heads=2", "--model.kv_heads=1", f"--model.ffn_dim={2 * dim}"]
    return build_model(load_config(overrides=overrides).model, seed=seed).eval()


def _prompt(n, vocab=320, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("draft", ["itself", "another"])
def test_greedy_is_token_identical_to_plain_decoding(k, draft):
    target = _model(1)
    drafter_model = target if draft == "itself" else _model(2, layers=1)
    for n in (1, 70):
        prompt = _prompt(n, seed=n)
        plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
        spec = speculative_generate(target, ModelDrafter(drafter_model, n + 30 + k + 2), prompt, max_new_tokens=30, k=k)
        assert spec.tokens == plain
        if draft == "itself":
            assert all(a == k for a in spec.accepted[:-1]) and spec.tau > k  # every proposal kept
    # an EOS ends it where plain decoding ends
    eos = plain[17]
    plain_eos = generate(target, [prompt], max_new_tokens=30, eos_ids=[eos])[0].tokens
    spec_eos = speculative_generate(target, ModelDrafter(drafter_model, 200), prompt, max_new_tokens=30, k=k,
                                    eos_ids=[eos])
    assert spec_eos.tokens == plain_eos


def _pairs(draw_pair, runs, vocab):
    counts = np.zeros(vocab * vocab)
    for seed in range(runs):
        a, b = draw_pair(seed)
        counts[a * vocab + b] += 1
    return counts


def pooled_chisquare(counts: np.ndarray, exact: np.ndarray, runs: int) -> float:
    """The chi-square p-value of `counts` against the distribution `exact`: on the cells expected at least 5
    times in `runs` draws, the other possible ones pooled (a cell `exact` gives 0 must be checked apart:
    it must never be drawn at all)."""
    keep = exact * runs >= 5
    rare = ~keep & (exact > 0)
    observed = np.append(counts[keep], counts[rare].sum()) if rare.any() else counts[keep]
    expected = np.append(exact[keep], exact[rare].sum()) if rare.any() else exact[keep]
    return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


# The biased sampler's draws (the check can fail): its distribution is the draft's, far from the target's, so
# 500 draws reject it with a false-pass probability <= 5e-21 (T1: noncentral chi-square, lambda ~ 245 on 41
# degrees of freedom; T1-penalties 2e-16); the 2,000 of the target's draws keep the check's power.
WRONG_RUNS = 500


@pytest.mark.slow
@pytest.mark.parametrize("sampling, adaptive", [
    (Sampling(temperature=1.0), False), (Sampling(temperature=0.9, top_k=6, min_p=0.05), False),
    (Sampling(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5), False),
    (Sampling(temperature=1.0), True)], ids=["T1", "T0.9-topk-minp", "T1-penalties", "T1-adaptive"])
def test_sampling_keeps_the_target_distribution_and_the_check_can_fail(monkeypatch, sampling, adaptive):
    """The first two new tokens of 2,000 seeded continuations: the first from the prefill, the second
    the first speculative one (a round with K = 2 after it; caches rewound to the prompt between
    draws, so each draw is a fresh continuation at the cost of one round; `adaptive`: K in 1..4
    chosen by one generate/spec_length.py AdaptiveLength from the rounds of the draws before, so K
    varies with the history as in a generation and each K's rounds must be exact). With top-k and min-p, the
    target's and the draft's distributions are both filtered (sampling_probs), and the output keeps
    the target's filtered distribution; with the penalties, each verified position and each draft step
    is penalised with the tokens before it (Processors.chain), and the output keeps the target's
    penalised distribution."""
    import longctx.generate.speculative as sp
    from longctx.generate.acceptance import choose, sampling_probs
    from longctx.generate.local import prefill
    from longctx.generate.sampling import Processors
    from longctx.models.kv_cache import KVCache

    vocab, runs = 8, 2000
    target, draft = _model(1, layers=1, vocab=vocab, dim=32), _model(7, layers=1, vocab=vocab, dim=32)
    with torch.no_grad():  # distributions of some conviction, and different ones (a random model's are flat)
        for m in (target, draft):
            m.lm_head_weight.mul_(6.0)
    prompt = [3, 1, 4]

    def after(generated):  # the penalties' state after the prompt and `generated` (None: no penalty)
        if not sampling.penalised:
            return None
        state = Processors(sampling, [prompt], vocab, [], "cpu")
        for t in generated:
            state.chosen(torch.tensor([t]))
        return state

    with torch.inference_mode():  # the target's exact distribution of the first two tokens
        p1 = sampling_probs(target(torch.tensor([prompt]))[:, -1], sampling, after([]))[0]
        seconds = torch.cat([sampling_probs(target(torch.tensor([prompt + [a]]))[:, -1], sampling, after([a]))
                             for a in range(vocab)])
        exact = (p1[:, None] * seconds).flatten().double().numpy()
        cache = KVCache.for_model(target, 1, 16)
        first = sampling_probs(prefill(target, cache, torch.tensor([prompt]), 64), sampling, after([]))[0]
        drafter = ModelDrafter(draft, 16)
        drafter.start(prompt)
    length = AdaptiveLength(4, 0.1) if adaptive else None

    def draw_pair(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            a = int(torch.multinomial(first, 1, generator=g))
            cache.truncate(len(prompt))
            drafter.rewind(prompt)
            # (K = 0, the policy's plain step, is plain decoding's own draw: a round here proposes >= 1)
            k = max(1, length.next()) if length is not None else 2
            kept, following, made = sp.speculative_round(target, cache, drafter, a, k, sampling, g, 0.0, after([a]))
            if length is not None:
                length.observe(len(kept), made)
        return a, (kept + [following])[0]

    def pvalue(counts):
        return pooled_chisquare(counts, exact, int(counts.sum()))

    counts = _pairs(draw_pair, runs, vocab)
    assert counts[exact == 0].sum() == 0
    if length is not None:  # every K was drawn from
        assert {1, 2, 3, 4} <= set(length.chosen), sorted(set(length.chosen))
    p_exact = pvalue(counts)
    print(f"speculative sampling chi-square p = {p_exact:.3g}")
    assert p_exact > 0.01
    # a biased sampler: every proposal kept (the draft's distribution): the same check rejects it
    monkeypatch.setattr(sp, "accept", lambda proposals, q, p, s, g: (len(proposals), choose(p[-1], s, g)))
    biased = _pairs(draw_pair, WRONG_RUNS, vocab)
    assert biased[exact == 0].sum() > 0 or pvalue(biased) < 0.01


def test_a_prompt_speculates_from_its_own_seed():
    """speculate_one(seed=...): the same seed gives the same tokens, another seed others."""
    from longctx.generate.speculative import speculate_one

    target, draft = _model(1), _model(2, layers=1)
    prompt, s = _prompt(20, seed=3), Sampling(temperature=1.0)
    runs = [speculate_one(target, draft, prompt, 24, k=3, sampling=s, eos_ids=(), prefill_chunk=64, seed=seed)
            for seed in (77, 77, 78)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens and runs[0].seed == 77


@pytest.mark.parametrize("draft", ["itself", "another", "noisy"])
def test_greedy_with_penalties_is_plain_greedy_with_them(draft):
    """T = 0 with the repetition, presence and frequency penalties and min_new_tokens (an EOS the run
    emits early): each verified position penalised with the proposals before it (the chain), or each
    tree node with its ancestors (CaPE, alternatives everywhere), the output is plain decoding's with
    the same settings, token for token, and so are its logprobs (1e-5)."""
    from longctx.generate.cape import CapeTable

    target = _model(1)
    drafter_model = target if draft == "itself" else _model(2, layers=1) if draft == "another" else _model(1)
    if draft == "noisy":  # the target with a noisy head: it hesitates, CaPE adds alternatives and some are kept
        with torch.no_grad():
            w = drafter_model.lm_head_weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.8)
    prompt = _prompt(40, seed=5) + _prompt(10, seed=5)
    free = generate(target, [prompt], max_new_tokens=30)[0].tokens
    for s in (Sampling(repetition_penalty=1.3), Sampling(presence_penalty=0.7, frequency_penalty=0.4),
              Sampling(repetition_penalty=0.9, frequency_penalty=0.3, min_new_tokens=12)):
        plain = generate(target, [prompt], max_new_tokens=30, sampling=s, eos_ids=[free[4]], logprobs=2)[0]
        assert plain.tokens != free
        for cape in (None, CapeTable.parse("0.5:4,0.8:2,1:1")):
            spec = speculative_generate(target, ModelDrafter(drafter_model, 160), prompt, max_new_tokens=30, k=3,
                                        sampling=s, eos_ids=[free[4]], cape=cape, logprobs=2)
            assert spec.tokens == plain.tokens, (s, cape)
            assert max(abs(a - b) for a, b in zip(spec.logprobs, plain.logprobs)) <= 1e-5
            assert [[i for i, _ in t] for t in spec.top_logprobs] == [[i for i, _ in t] for t in plain.top_logprobs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_target_processed_distribution(temperature):
    """logprobs=3: each token's log-probability (and the top 3) under the target's processed logits at
    its position (the verification call's row; the first, the prefill's): at T = 0 those of plain
    decoding with the same settings (1e-5); at T = 0.8 with top-k and the penalties, log_softmax of
    the processors applied to a full forward of the sequence drawn."""
    from longctx.generate.sampling import Processors, process

    target, draft = _model(1), _model(2, layers=1)
    prompt = _prompt(30, seed=7)
    s = Sampling(temperature=temperature, top_k=40, repetition_penalty=1.2, presence_penalty=0.3, seed=2)
    spec = speculative_generate(target, ModelDrafter(draft, 100), prompt, max_new_tokens=24, k=3, sampling=s,
                                logprobs=3)
    assert len(spec.logprobs) == len(spec.top_logprobs) == len(spec.tokens) == 24
    if temperature == 0:
        plain = generate(target, [prompt], max_new_tokens=24, sampling=s, logprobs=3)[0]
        assert spec.tokens == plain.tokens
        want, want_top = plain.logprobs, plain.top_logprobs
    else:
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + spec.tokens]))[0].float()
        state, want, want_top = Processors(s, [prompt], logits.shape[-1], [], "cpu"), [], []
        for t, token in enumerate(spec.tokens):
            lp = torch.log_softmax(process(logits[len(prompt) + t - 1][None], s, state), -1)[0]
            want.append(float(lp[token]))
            top = lp.topk(3)
            want_top.append(list(zip(top.indices.tolist(), top.values.tolist())))
            state.chosen(torch.tensor([token]))
    assert max(abs(a - b) for a, b in zip(spec.logprobs, want)) <= 1e-5
    for got, exp in zip(spec.top_logprobs, want_top):
        assert [i for i, _ in got] == [i for i, _ in exp]
        assert max(abs(a[1] - b[1]) for a, b in zip(got, exp)) <= 1e-5


@pytest.mark.parametrize("draft", ["itself", "noisy"])
def test_cape_tree_is_token_identical_and_keeps_more(draft):
    """CaPE: the chain plus alternatives where the draft hesitates, verified as one tree: the output is
    plain greedy decoding; it keeps more tokens per pass than the chain alone with a draft that often
    hesitates (the target with a noisy LM head), as many with one that never does (the target); a
    table that does not cover [0, 1] is refused."""
    from longctx.errors import ConfigError
    from longctx.generate.cape import CapeTable

    target = _model(1)
    drafter_model = _model(1)
    if draft == "noisy":
        with torch.no_grad():
            w = drafter_model.lm_head_weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.8)
    table = CapeTable.parse("0.5:4,0.8:2,1:1")
    taus = {}
    for name, cape in (("chain", None), ("cape", table)):
        kept = passes = 0
        for n in (1, 33):
            prompt = _prompt(n, seed=n + 5)
            plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
            spec = speculative_generate(target, ModelDrafter(drafter_model, n + 40), prompt, max_new_tokens=30,
                                        k=3, cape=cape)
            assert spec.tokens == plain, name
            kept, passes = kept + sum(spec.accepted) + spec.passes, passes + spec.passes
        taus[name] = kept / passes
    assert taus["cape"] > taus["chain"] if draft == "noisy" else taus["cape"] == taus["chain"]
    for bad in ("0.5:1,0.9:0", "0.5:1,0.4:2,1:0", "x", "0:1,1:0"):
        with pytest.raises(ConfigError, match="cape-table"):
            CapeTable.parse(bad)


@pytest.mark.parametrize("cape", [False, True])
def test_a_confidence_stop_ends_rounds_early_and_keeps_the_output(cape):
    """--confidence-stop P: a round's proposals end after one the draft gives below P. The output stays
    plain greedy decoding (chain and CaPE tree); rounds get shorter where the draft hesitates, and
    a stop of 0 makes every round K long."""
    from longctx.generate.cape import CapeTable

    target, drafter_model = _model(1), _model(1)
    with torch.no_grad():  # the target with a noisy head: sure of some tokens, not of others
        w = drafter_model.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.8)
        w.mul_(20.0)  # confidences from ~0.2 to ~1 (median ~0.7)
    table = CapeTable.parse("0.5:2,1:0") if cape else None
    prompt = _prompt(33, seed=3)
    plain = generate(target, [prompt], max_new_tokens=40)[0].tokens
    made = {}
    for stop in (0.0, 0.5):
        spec = speculative_generate(target, ModelDrafter(drafter_model, 120), prompt, max_new_tokens=40, k=4,
                                    cape=table, stop_below=stop)
        assert spec.tokens == plain, stop
        assert len(spec.proposed) == spec.passes and all(1 <= p <= 4 for p in spec.proposed)
        made[stop] = spec.proposed
    assert all(p == 4 for p in made[0.0])
    assert min(made[0.5]) < 4 and max(made[0.5]) > 1, made[0.5]  # both kinds of rounds happen


@pytest.mark.parametrize("stop, window, message", [(1.0, 0, r"--confidence-stop must be in \[0, 1\)"),
                                                   (-0.1, 0, "--confidence-stop"), (0.5, -1, "--draft-window")])
def test_bad_speculation_settings_are_refused_before_any_weight(stop, window, message):
    from longctx.errors import ConfigError
    from longctx.generate.drafts import draft_config

    with pytest.raises(ConfigError, match=message):
        draft_config("no/such/draft", "no/such/target", 4, None, "byte", stop, window)
