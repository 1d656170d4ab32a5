"""Adaptive speculation length (`--speculate-adaptive`): K chosen each round from the acceptance so far.

A fixed K is right for one acceptance rate only: where the draft follows the target, every proposal
past K is a lost token; where it does not, every proposal is a draft step spent on a token the
target will replace. `AdaptiveLength` picks each round's K in 0..cap (cap = --speculate) from the
proposals kept so far, by the expected-speedup argument of Leviathan et al. 2023 ("Fast Inference
from Transformers via Speculative Decoding", section 3.4, choosing gamma): if each proposal is kept
with probability alpha, independently of the others, a round of K proposals gives
E(K) = (1 - alpha^(K+1)) / (1 - alpha) tokens (the kept prefix plus the target's replacement or bonus),
and costs K draft steps of c target passes each plus one verification of K + 1 tokens, 1 + K x w
target passes: K x (c + w) + 1. The K of the most tokens per unit of cost, E(K) / (K x (c + w) + 1),
is the round's, and K = 0, a plain decoding step (one token for one pass), when no K >= 1 gives
more than 1: a draft that does not pay is not run (Leviathan's speedup below 1, sglang #6783's
"slower than no speculation"). w, the verification's cost per extra token (`--verify-cost`), is 0
where verifying a few tokens costs one decode step (a GPU's memory-bound step); on a CPU it is not
(SmolLM2-135M on our 2-core VM: a 5-token verification costs 1.68 steps, w = 0.17).

A plain round tests no proposal, so alpha would never move again: after PROBE_EVERY plain rounds in
a row the next round proposes the best K >= 1 (a probe), and its outcome updates alpha as any
round's does. A probe that keeps nothing doubles the wait before the next (up to PROBE_MOST plain
rounds), one that keeps a proposal brings it back to PROBE_EVERY: a draft that never pays costs a
probe in 257 rounds at length, one that recovers is taken up within PROBE_EVERY of the recovery
once its probes keep proposals.

alpha is read from the history alone, never from timings, so a seeded sampling run draws the same
tokens every time, and at T = 0 the output is plain greedy decoding for any K: the rule only decides
how many proposals a round makes. Each round is a censored geometric trial: its kept proposals are
successes and the first rejected one (when there is one) a failure; proposals after it were never
tested. alpha = successes / trials, both as exponential moving averages over rounds (each round's
counts weighed by `smoothing`, the older ones decaying by 1 - smoothing), so a draft that follows the
target on one stretch of text and not on the next is tracked. (kept / proposed, the reported
acceptance rate, would count the untested proposals after a rejection as failures and read a long K
as a bad draft.) The first round proposes the cap.

Under CaPE (generate/cape.py) the rule sets the depth of the tree's chain, and alpha is the tree's
acceptance per depth: a kept alternative ends the path, so the depth after it counts as a failure,
which is what it is for the next round's tokens. The tree's alternatives are verified too: a round
of depth K verifies K x width nodes past the root, width (>= 1) the moving average of the nodes
verified per proposal (1 for a chain; CaPE's alternatives per depth come from the draft's
confidence), so the cost is K x (c + w x width) + 1. With w = 0 (a GPU) the extra nodes cost nothing
and CaPE's choice is the chain's.

c: the draft's cost per token over the target's, by default the ratio of their forward matmul
FLOPs per token (models/flops.py; a GliDe draft's own layers plus the target's LM head, which it
uses; a Clover draft's step and that head, models/clover.py): a fixed number of the two models, not
a measurement. `--draft-cost C` sets it (e.g. a ratio
measured on the machine: on a CPU a small draft's step costs more than its FLOPs say).
"""

from __future__ import annotations

import math

from ..errors import ConfigError

SMOOTHING = 0.3  # the weight of the newest round in the moving averages (about the last 3-6 rounds count)
PROBE_EVERY = 16  # plain rounds in a row before a probe round proposes again (the module docstring)
PROBE_MOST = 256  # ... after probes that kept nothing, at most this many


class AdaptiveLength:
    """The proposals of each round (`next`), 0..cap (0: a plain step), from the kept proposals of the
    earlier ones (`observe`): a pure function of that history. `chosen` lists every K it gave.
    `verify_cost`: w, a verification's cost per token past the first, in target passes."""

    def __init__(self, cap: int, draft_cost: float, smoothing: float = SMOOTHING, verify_cost: float = 0.0,
                 probe_every: int = PROBE_EVERY):
        if cap < 1:
            raise ValueError(f"the cap of adaptive speculation must be >= 1, got {cap}")
        if not (draft_cost > 0 and math.isfinite(draft_cost)):
            raise ValueError(f"the draft's cost relative to the target must be > 0, got {draft_cost}")
        if not (verify_cost >= 0 and math.isfinite(verify_cost)):
            raise ValueError(f"the verification's cost per extra token must be >= 0, got {verify_cost}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.cap, self.draft_cost, self.smoothing = cap, draft_cost, smoothing
        self.verify_cost, self.probe_every = verify_cost, probe_every
        self.wait, self.probing = probe_every, False  # plain rounds before the next probe; this round is one
        self.successes = self.trials = 0.0  # moving averages (ratio is alpha; both start at 0)
        self.width = 1.0  # moving average of the nodes verified per proposal (CaPE's tree: > 1)
        self.chosen: list[int] = []
        self.plain_run = 0  # plain rounds (K = 0) in a row just before this one

    @property
    def alpha(self) -> float | None:
        """The estimated probability that a proposal is kept (None before any round)."""
        return self.successes / self.trials if self.trials else None

    def next(self) -> int:
        """This round's K (said in `chosen`)."""
        if self.alpha is None:
            k = self.cap
        else:
            verify = self.verify_cost * self.width
            k = best_length(self.alpha, self.draft_cost, self.cap, verify)
            self.probing = k == 0 and self.plain_run >= self.wait
            if self.probing:  # alpha moves only on proposals
                k = best_length(self.alpha, self.draft_cost, self.cap, verify, plain=False)
        self.plain_run = self.plain_run + 1 if k == 0 else 0
        self.chosen.append(k)
        return k

    def observe(self, kept: int, proposed: int, verified: int | None = None) -> None:
        """A round kept `kept` of its `proposed` proposals (the draft may make fewer than K: a
        confidence stop), verifying `verified` nodes past the root (default `proposed`: a chain; more
        under CaPE). The first rejection is a tested failure; the proposals after it were not tested.
        A plain round (nothing proposed) tells nothing of the draft."""
        if not 0 <= kept <= proposed:
            raise ValueError(f"a round keeps 0..{proposed} proposals, got {kept}")
        verified = proposed if verified is None else verified
        if verified < proposed:
            raise ValueError(f"a round verifies at least its {proposed} proposals, got {verified} nodes")
        if proposed == 0:
            return
        if self.probing:  # back off after a probe that kept nothing; back to the start after one that kept
            self.wait = min(2 * self.wait, PROBE_MOST) if kept == 0 else self.probe_every
            self.probing = False
        trials = kept + (kept < proposed)
        w = self.smoothing
        self.successes = (1 - w) * self.successes + w * kept
        self.trials = (1 - w) * self.trials + w * trials
        self.width = (1 - w) * self.width + w * verified / proposed

    @property
    def mean(self) -> float:
        """The mean K chosen so far (0 before any round)."""
        return sum(self.chosen) / len(self.chosen) if self.chosen else 0.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k proposals gives when each is kept with probability alpha: the kept
    prefix (a truncated geometric) and the target's token after it; k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, draft_cost: float, cap: int, verify_cost: float = 0.0, plain: bool = True) -> int:
    """The k in 0..cap (1..cap with plain=False) of the most expected tokens per unit of cost
    (k x (draft_cost + verify_cost) + 1 target passes; k = 0, a plain step, gives 1 token per pass);
    the smallest such k on a tie (no draft step spent for nothing)."""
    best, best_rate = (0, 1.0) if plain else (None, -1.0)
    for k in range(1, cap + 1):
        rate = expected_tokens(alpha, k) / (k * (draft_cost + verify_cost) + 1.0)
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = k, rate
    return best


def matmul_flops(model, target) -> float:
    """Forward matmul FLOPs per token of `model`: a longctx model by its config (models/flops.py); a
    GliDe draft by its own layers' weights and the target's LM head rows it runs (all, or its reduced
    vocabulary's: models/draft_vocab.py); a Clover draft by one regressive step's weights and those rows
    (its Augmenting Block runs once per kept token, not per proposal: left out, as the verification's)."""
    from ..models.clover import CloverDraft
    from ..models.flops import forward_matmul_flops_per_token
    from ..models.glide import GlideDraft

    if isinstance(model, CloverDraft):  # a step: the regressive connection, query, output, MLP; then the head
        parts = (model.regressive, model.query, model.out, model.feed_forward)
        own = sum(p.numel() for part in parts for p in part.parameters() if p.dim() == 2)
        head = target.cfg.vocab_size if model.vocab is None else model.vocab.size
        return 2.0 * own + 2.0 * target.cfg.dim * head
    if isinstance(model, GlideDraft):
        own = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
        head = target.cfg.vocab_size if model.vocab is None else model.vocab.size
        return 2.0 * own + 2.0 * target.cfg.dim * head
    return forward_matmul_flops_per_token(model.cfg)


def draft_cost_ratio(target, draft) -> float:
    """c of the rule: the draft's forward matmul FLOPs per token over the target's."""
    return matmul_flops(draft, target) / matmul_flops(target, target)


def length_policy(adaptive, k: int, target, draft, draft_cost: float | None = None,
                  verify_cost: float = 0.0) -> AdaptiveLength | None:
    """What `speculative_generate(adaptive=...)` takes: False (None: every round k), True (a policy
    capped at k, c = draft_cost or the models' FLOPs ratio, w = verify_cost), or an AdaptiveLength
    (used as it is; the caller reads its `chosen`), whose cap may not exceed k (the verification's
    room is k's)."""
    if adaptive is False or adaptive is None:
        return None
    if adaptive is True:
        if draft is None and draft_cost is None:
            raise ValueError("adaptive speculation needs draft_cost for a drafter without a draft model")
        return AdaptiveLength(k, draft_cost if draft_cost is not None else draft_cost_ratio(target, draft),
                              verify_cost=verify_cost)
    if adaptive.cap > k:
        raise ValueError(f"an adaptive length capped at {adaptive.cap} for speculation of up to k = {k}")
    return adaptive


def check_adaptive_flags(draft: str, speculate: int, adaptive: bool, draft_cost: float | None,
                         verify_cost: float | None = None) -> None:
    """--speculate-adaptive, --draft-cost and --verify-cost, checked before any work: adaptive
    speculation needs a draft and a cap (--speculate) of at least 1; --draft-cost and --verify-cost
    mean something only with it; the first is a positive ratio, the second one >= 0."""
    if adaptive and not draft:
        raise ConfigError("--speculate-adaptive chooses how many tokens a draft proposes per target pass; give "
                          "the draft with --draft DIR (or drop --speculate-adaptive for plain decoding).")
    if adaptive and speculate < 1:
        raise ConfigError(f"--speculate is the most tokens --speculate-adaptive proposes per target pass and must be "
                          f">= 1, got {speculate}; e.g. --speculate 8 --speculate-adaptive.")
    if draft_cost is not None and not adaptive:
        raise ConfigError("--draft-cost is the draft/target cost ratio --speculate-adaptive weighs K by; add "
                          "--speculate-adaptive, or drop --draft-cost.")
    if draft_cost is not None and not (draft_cost > 0 and math.isfinite(draft_cost)):
        raise ConfigError(f"--draft-cost must be a ratio > 0 (a draft step's cost over one target pass, e.g. 0.1), "
                          f"got {draft_cost}.")
    if verify_cost is not None and not adaptive:
        raise ConfigError("--verify-cost is the verification's cost per extra token --speculate-adaptive weighs K by; "
                          "add --speculate-adaptive, or drop --verify-cost.")
    if verify_cost is not None and not (verify_cost >= 0 and math.isfinite(verify_cost)):
        raise ConfigError(f"--verify-cost must be >= 0 (a verification's cost per token past the first, in target "
                          f"passes: 0 on a GPU, e.g. 0.17 on a small CPU), got {verify_cost}.")
