"""An independent reference of speculative decoding's rounds (tests/unit/test_specfuzz121.py), written from
docs/generate.md and the papers, not from generate/: every distribution is a full forward of the whole
sequence (no cache), processed as the docs state (generate_reference.py's step 1, then temperature, top-k,
top-p, min-p); a plain draft's greedy proposals are its own full forwards with the same processors over the
history and the proposals before them; a round keeps the proposals while each is the target's greedy choice
and emits the target's token after them (CaPE: a kept alternative ends the path); the adaptive K is
Leviathan et al.'s rule (2023, 3.4) with docs/generate.md's moving averages and probes. The rounds' counts
(kept, made), `unused` and tau follow from the same end rules as generate_reference.reference. A decision
within TIE of another (two logits, a confidence and its bound) is a near-tie rounding may flip: NearTie.
Also what a cache after a round is held to (a fresh prefill of the tokens it should hold) and a chi-square p."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from generate_reference import TIE, _processed
from longctx.generate.drafters import ModelDrafter
from longctx.generate.local import prefill
from longctx.models.kv_cache import KVCache


class NearTie(Exception):
    """A decision rounding may flip: the case is drawn again (a seeded redraw, so still deterministic)."""


def step1(model, prompt, out, sampling, eos) -> torch.Tensor:
    """The penalised fp64 logits after prompt + out (out: the tokens generated or proposed so far)."""
    with torch.inference_mode():
        logits = model(torch.tensor([[*prompt, *out]]))[0, -1]
    return _processed(logits, prompt, out, sampling, eos)


def step2_probs(logits: torch.Tensor, sampling) -> torch.Tensor:
    """Sampling's distribution of step-1 logits (fp64), each filter on what the one before left."""
    z = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < len(z):
        z = torch.where(z < torch.sort(z, descending=True).values[sampling.top_k - 1], float("-inf"), z)
    if sampling.top_p < 1.0:
        p = z.softmax(-1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]  # mass of the tokens more likely than this one
        z = z.clone()
        z[order[before >= sampling.top_p]] = float("-inf")
    if sampling.min_p > 0:
        p = z.softmax(-1)
        z = torch.where(p < sampling.min_p * p.max(), float("-inf"), z)
    return z.softmax(-1)


def sure_argmax(logits: torch.Tensor) -> int:
    top = torch.topk(logits, 2)
    if float(top.values[0] - top.values[1]) < TIE:
        raise NearTie("argmax")
    return int(top.indices[0])


def speculative_token_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution of a round's first emitted token by the rule of speculative sampling (Leviathan et al.
    2023, Chen et al. 2023): d ~ q kept with probability min(1, p(d) / q(d)), else a draw from
    norm(max(0, p - q)): min(p, q) + (1 - sum min(p, q)) x the residual."""
    kept = torch.minimum(p, q)
    residual = (p - q).clamp(min=0)
    rejected = 1 - float(kept.sum())
    return kept + (rejected * residual / residual.sum() if float(residual.sum()) > 0 else 0)


class Adaptive:
    """--speculate-adaptive's K per round, from the docs: the first round the cap; then the K in 0..cap of the most
    E(K) / (K (c + w width) + 1), E(K) = (1 - a^(K+1)) / (1 - a), the smallest on a tie; a plain round's K = 0;
    after `probe` plain rounds in a row, the best K >= 1 (a probe: one that keeps nothing doubles the wait up to
    256, one that keeps resets it); a = kept / tested (tested: kept + the first rejected), width = verified /
    made, each an exponential moving average weighing the newest round 0.3."""

    def __init__(self, cap: int, c: float, w: float = 0.0, probe: int = 16):
        self.cap, self.c, self.w, self.probe = cap, c, w, probe
        self.kept = self.tested = 0.0
        self.width, self.wait, self.plain, self.probing, self.started = 1.0, probe, 0, False, False

    def _best(self, low: int) -> int:
        a = self.kept / self.tested
        rates = {k: ((k + 1.0) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)) / (k * (self.c + self.w * self.width) + 1)
                 for k in range(low, self.cap + 1)}
        if low == 0:
            rates[0] = 1.0
        best = max(rates.values())
        ranked = sorted(rates.values())
        if len(ranked) > 1 and ranked[-1] != ranked[-2] and ranked[-1] - ranked[-2] < 1e-9 * best:
            raise NearTie("K")
        return min(k for k, r in rates.items() if r >= best * (1 - 1e-12))

    def next(self) -> int:
        if not self.started:
            k = self.cap
        else:
            k = self._best(0)
            self.probing = k == 0 and self.plain >= self.wait
            k = self._best(1) if self.probing else k
        self.started = True
        self.plain = self.plain + 1 if k == 0 else 0
        return k

    def observe(self, kept: int, made: int, verified: int) -> None:
        if made == 0:
            return
        if self.probing:
            self.wait = min(2 * self.wait, 256) if kept == 0 else self.probe
            self.probing = False
        self.kept = 0.7 * self.kept + 0.3 * kept
        self.tested = 0.7 * self.tested + 0.3 * (kept + (kept < made))
        self.width = 0.7 * self.width + 0.3 * verified / made


def plain_proposals(draft, prompt, out, k, sampling, eos, stop_below=0.0, cape=None):
    """A plain draft model's greedy chain after prompt + out (up to k) and, under a CaPE table, each depth's
    alternatives: the most likely tokens of its processed softmax (T = 1) but the chain's, as many as the bin
    of the chain token's probability says. A confidence stop ends the chain after a proposal the draft gives less
    than stop_below: the top probability of the softmax its greedy choice was made from (docs/generate.md
    --confidence-stop: at T = 0 the penalised logits' softmax, as CaPE's tree reads it)."""
    chain, alts = [], []
    for i in range(k):
        logits = step1(draft, prompt, [*out, *chain], sampling, eos)
        d = sure_argmax(logits)
        chain.append(d)
        q = logits.softmax(-1)  # the distribution its greedy choice is the top of
        conf = float(q[d])
        if cape is not None:
            bound = next(b for b, _ in cape.bins if conf <= b)
            if abs(conf - bound) < 1e-6:
                raise NearTie("bin")
            extra = next(n for b, n in cape.bins if conf <= b)
            ranked = [t for t in torch.argsort(q, descending=True).tolist() if t != d and float(q[t]) > 0]
            if extra and len(ranked) > extra and float(q[ranked[extra - 1]] - q[ranked[extra]]) < 1e-6:
                raise NearTie("alternatives")
            alts.append(ranked[:extra])
        if stop_below and i + 1 < k:
            if abs(conf - stop_below) < 1e-6:
                raise NearTie("confidence")
            if conf < stop_below:
                break
    return chain, alts


def greedy_round(target, prompt, out, chain, alts, sampling, eos):
    """(the round's tokens: the kept proposals and the target's after them, kept, made, verified) for a chain
    (alts None) or a tree (alts: each depth's alternatives)."""
    kept = []
    for i, d in enumerate(chain):
        choice = sure_argmax(step1(target, prompt, [*out, *kept], sampling, eos))
        if choice == d:
            kept.append(d)
            continue
        if alts is not None and choice in alts[i]:  # a kept alternative is a leaf: its path ends there
            kept.append(choice)
            break
        return [*kept, choice], len(kept), len(chain), len(chain) + sum(map(len, alts or []))
    following = sure_argmax(step1(target, prompt, [*out, *kept], sampling, eos))
    return [*kept, following], len(kept), len(chain), len(chain) + sum(map(len, alts or []))


def greedy_spec(target, prompt, limit, sampling, eos, ended, proposer, k, adaptive=None, cape=None):
    """Speculative greedy decoding by full forwards: tokens, finish reason, kept and made per round, unused,
    and the K each round was given. `ended(out)`: a stop string in the row's text. `proposer(out, k)`: the
    round's (chain, alternatives), the draft after prompt + out."""
    out, reason, book = [], None, {"kept": [], "made": [], "ks": [], "unused": 0, "trees": []}

    def take(tokens, kept):
        nonlocal reason
        for j, t in enumerate(tokens):
            if t in eos:
                reason = "eos"
            else:
                out.append(t)
                reason = "stop" if ended(out) else "length" if len(out) >= limit else None
            if reason is not None:
                if kept is not None:
                    book["unused"] = max(0, kept - j)
                return

    reason = "length" if limit <= 0 else None
    if reason is None:
        take([sure_argmax(step1(target, prompt, [], sampling, eos))], None)
    while reason is None:
        kk = k if adaptive is None else adaptive.next()
        book["ks"].append(kk)
        if kk == 0:
            tokens, kept, made, verified = [sure_argmax(step1(target, prompt, out, sampling, eos))], 0, 0, 0
        else:
            chain, alts = proposer(list(out), kk)
            book["trees"].append((kk, chain, *([alts] if cape else [])))
            tokens, kept, made, verified = greedy_round(target, prompt, out, chain, alts if cape else None,
                                                       sampling, eos)
        if adaptive is not None:
            adaptive.observe(kept, made, verified)
        book["kept"].append(kept)
        book["made"].append(made)
        take(tokens, kept)
    return out, reason, book


def tau(book) -> float:
    """Tokens emitted per target pass: each round's kept proposals and its token after them, less the last
    round's kept proposals after the row's end."""
    return (sum(book["kept"]) - book["unused"] + len(book["kept"])) / max(len(book["kept"]), 1)


def cache_gap(model, cache, tokens) -> float:
    """The largest difference between `cache`'s first row and a fresh prefill of `tokens` (keys and values)."""
    if not tokens:
        return 0.0
    fresh = KVCache.for_model(model, 1, len(tokens) + 1)
    prefill(model, fresh, torch.tensor([tokens]), 4096)
    n = len(tokens)
    return max(float((cache.k[:, :1, :, :n] - fresh.k[:, :, :, :n]).abs().max()),
               float((cache.v[:, :1, :, :n] - fresh.v[:, :, :, :n]).abs().max()))


def chisquare_p(counts, expected) -> float:
    """p of counts against the expected probabilities, cells expected below 5 pooled (none may be drawn where the
    probability is 0)."""
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    e = expected * counts.sum()
    small = (e < 5) & (e > 0)
    obs = np.append(counts[e >= 5], counts[small].sum())
    exp = np.append(e[e >= 5], e[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] / exp[keep].sum() * obs[keep].sum()).pvalue)


class Watched:
    """The engine's rounds (contracts.Rounds) with a check after each: the target's cache holds the prompt and
    every token the rounds gave but the last (the pending one), as a fresh prefill of them leaves it; a plain
    draft's cache, a fresh prefill of the prefix it was fed. The largest difference seen is kept."""

    def __init__(self, rounds, target, prompt):
        self.rounds, self.room, self.target, self.seq = rounds, rounds.room, target, list(prompt)
        self.worst, self.lengths_ok = 0.0, True

    def first(self, cache, logits, prompts, seeds, processors):
        return self._check(cache, self.rounds.first(cache, logits, prompts, seeds, processors))

    def next(self, cache, processors):
        return self._check(cache, self.rounds.next(cache, processors))

    def _check(self, cache, taken):
        self.seq += taken.tokens[0].tolist()
        held = len(self.seq) - 1
        self.lengths_ok &= int(cache.lengths[0]) == held
        self.worst = max(self.worst, cache_gap(self.target, cache, self.seq[:held]))
        drafter = self.rounds.drafter
        if type(drafter) is ModelDrafter:
            fed = int(drafter.cache.lengths[0])
            self.lengths_ok &= fed <= held
            self.worst = max(self.worst, cache_gap(drafter.model, drafter.cache, self.seq[:fed]))
        return taken
