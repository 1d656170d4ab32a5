"""Speculative decoding (one sequence): a drafter proposes K tokens, the target verifies them in one pass.

One round, with the target's cache holding the prompt and every emitted token but the last (the
`pending` token, not yet fed):
1. the drafter (generate/drafters.py) proposes d_1..d_K with the distribution q_i of each;
2. the target runs [pending, d_1..d_K] in one cached call (the new tokens attend to the cache and,
   causally, to each other: models/cached_attention.py) and gets p_1..p_{K+1};
3. the acceptance rule (generate/acceptance.py) keeps a prefix of the proposals and gives the token
   after them (the target's replacement, or a bonus when every proposal was kept);
4. the target's cache keeps [pending, the kept d_i] and forgets the rest (its lengths go back: the
   slots are overwritten later); the replaced or bonus token becomes the new pending one.
With a CaPE table the round is a tree instead (generate/cape.py tree_round, greedy). Either way the
rounds run in the decode loop every decoding shares (generate/loop.py): `SpeculativeRounds` is the
chain's and the tree's contracts.Rounds. K is the same every round, or (`adaptive`,
--speculate-adaptive) chosen each round up to it from the proposals kept so far (generate/spec_length.py;
under CaPE, the depth of the tree's chain).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ..models.static_decode import CompiledStep, compiled_step
from .acceptance import accept, choose, token_probs
from .cape import tree_round
from .contracts import Backend, Cache, Drafter, Round
from .drafters import check_draft_vocab, drafter_for
from .local import LOCAL
from .loop import decode, generating
from .results import Result
from .sampling import GREEDY, Processors, Sampling, process
from .spec_length import AdaptiveLength, length_policy


def speculative_round(target, cache: Cache, drafter: Drafter, pending: int, k: int, sampling: Sampling,
                      generator, stop_below: float = 0.0, state: Processors | None = None,
                      rows: list | None = None) -> tuple[list[int], int, int]:
    """One draft-then-verify round of the chain after `pending` (the last emitted token, not in `cache`
    yet): the kept proposals, the token after them (the target's replacement or bonus: the next
    pending) and how many proposals were made. `state`: the penalties' state after pending (one row);
    verified position i is processed with proposals d_1..d_i added (Processors.chain), the draft's
    alike, so p and q are the processed distributions and the rule stays exact. `rows`, when given,
    receives the target's processed logits of the kept proposals and of the token after them
    (logprobs). Leaves `cache` holding pending and the kept proposals, and the drafter told."""
    if k < 1:
        raise ValueError(f"a speculative round proposes at least one token, got k = {k} (a plain step is "
                         f"SpeculativeRounds' K = 0)")
    proposals, q = drafter.propose(pending, k, sampling, generator, stop_below, state)
    k = len(proposals)  # (fewer where the draft stopped on a hesitation)
    fed = torch.tensor([[pending, *proposals]], device=cache.k.device)
    processed = process(target(fed, cache=cache)[0].float(), sampling,
                        state.chain(proposals) if state is not None else None)
    p = token_probs(processed, sampling)  # [k + 1, vocab]
    kept, following = accept(proposals, q, p, sampling, generator)
    if rows is not None:
        rows.extend(processed[:kept + 1])
    cache.truncate(int(cache.lengths[0]) - (k - kept))
    drafter.accepted(kept, k, nodes=list(range(kept + 1)))  # (the call's rows kept: pending and the kept)
    return proposals[:kept], following, k


class SpeculativeRounds:
    """Speculative decoding's rounds (contracts.Rounds, one row): the first token drawn from the
    prefill's logits, then per round the chain's kept proposals (or, with a CaPE `cape` table, the
    tree's accepted path) and the target's token after them."""

    def __init__(self, target, drafter: Drafter, k: int, sampling: Sampling, generator: torch.Generator | None,
                 stop_below: float = 0.0, cape=None, logprobs: bool = False, length: AdaptiveLength | None = None):
        self.target, self.drafter, self.k, self.sampling, self.generator = target, drafter, k, sampling, generator
        self.stop_below, self.cape, self.logprobs = stop_below, cape, logprobs
        self.length = length  # None: k every round; else each round's k (<= k) from the rounds before
        self.room = verify_room(k, cape)
        self.pending = 0

    def first(self, cache: Cache, logits: torch.Tensor, prompts, seeds, processors: Processors | None) -> Round:
        processed = process(logits, self.sampling, processors)  # [1, vocab]
        self.pending = choose(token_probs(processed, self.sampling)[0], self.sampling, self.generator)
        self.drafter.start(list(prompts[0]), cache)
        return self._round([self.pending], [processed[0]] if self.logprobs else None)

    def next(self, cache: Cache, processors: Processors | None) -> Round:
        rows = [] if self.logprobs else None  # the processed logits of each token the round gives
        k = self.k if self.length is None else self.length.next()
        if k == 0:  # adaptive K's plain step: the draft would not pay (generate/spec_length.py)
            kept, self.pending, proposed = [], self._plain_step(cache, processors, rows), 0
            verified = 0
        elif self.cape is not None:
            kept, self.pending, proposed, verified = tree_round(self.target, cache, self.drafter, self.pending, k,
                                                                self.cape, self.stop_below, processors, rows)
        else:
            kept, self.pending, proposed = speculative_round(self.target, cache, self.drafter, self.pending, k,
                                                             self.sampling, self.generator, self.stop_below,
                                                             processors, rows)
            verified = proposed
        if self.length is not None:
            self.length.observe(len(kept), proposed, verified)
        return self._round([*kept, self.pending], rows, [len(kept)], [proposed])

    def _plain_step(self, cache: Cache, processors: Processors | None, rows: list | None) -> int:
        """The target alone takes the pending token and draws the next, as plain decoding does (the same
        processing and draw: lossless at any temperature); the drafter is told, to feed it later."""
        fed = torch.tensor([[self.pending]], device=cache.k.device)
        processed = process(self.target(fed, cache=cache)[0].float(), self.sampling, processors)  # [1, vocab]
        if rows is not None:
            rows.append(processed[0])
        self.drafter.skipped(self.pending)
        return choose(token_probs(processed, self.sampling)[0], self.sampling, self.generator)

    def _round(self, tokens: list[int], rows: list | None, kept=None, proposed=None) -> Round:
        device = self.target.tok_embeddings.weight.device
        return Round(torch.tensor([tokens], device=device), None if rows is None else torch.stack(rows)[None],
                     kept, proposed)


def speculative_generate(target, drafter: Drafter, prompt: Sequence[int], *, max_new_tokens: int, k: int,
                         sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
                         generator: torch.Generator | None = None, backend: Backend = LOCAL, cape=None,
                         stop_below: float = 0.0, logprobs: int | None = None, seed: int | None = None,
                         compile: bool | CompiledStep = False, adaptive: bool | AdaptiveLength = False,
                         draft_cost: float | None = None, verify_cost: float = 0.0, stop=None) -> Result:
    """Continue `prompt` (batch 1) by up to max_new_tokens tokens, up to k proposals per target pass
    (fewer after a proposal the draft gives less than `stop_below`: ModelDrafter.propose).
    `adaptive`: each round's proposals chosen up to k from the proposals kept so far
    (generate/spec_length.py; True: c = `draft_cost`, else the models' FLOPs ratio, and w = `verify_cost`;
    an AdaptiveLength: that one, whose `chosen` then lists each round's K, 0 for a plain step).
    `backend`: the target's cache and prefill (generate/local.py's; generate/sharded.py's
    ShardedGeneration on every rank of a head x ctx layout, the draft then run alike on every rank).
    `cape`: a generate/cape.py CapeTable, to verify each round's proposals as a tree (greedy).
    `logprobs`: as generate's (None, 0 or N): each token's from the target's processed logits at its
    position (the verification call's row, or the prefill's; a CaPE tree's: the accepted path's rows).
    Draws come from `generator`, else one seeded `seed` (default: the run's, sampling.seed).
    `compile`: the target's verifications through a compiled static-shape step (generate's). `stop`: as
    generate's (`stop(row, tokens)`, row 0): the row ends at the token that completes a stop string, the
    rest of that round's kept proposals dropped."""
    if k < 1:
        raise ValueError(f"speculate at least one token per pass, got {k}")
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    if cape is not None and not sampling.greedy:
        raise ValueError("CaPE's tree is verified greedily (temperature 0)")
    check_draft_vocab(target, drafter)
    device = target.tok_embeddings.weight.device
    seed = sampling.seed if seed is None else seed
    generator = generator if generator is not None else sampling.generator(device, seed)
    length = length_policy(adaptive, k, target, getattr(drafter, "model", None), draft_cost, verify_cost)
    rounds = SpeculativeRounds(target, drafter, k, sampling, generator, stop_below, cape, logprobs is not None,
                               length)
    # (the draft as decode runs the target; a drafter's cache leased for the generation where it has a `generation`)
    with generating(getattr(drafter, "model", None)), getattr(drafter, "generation", nullcontext)():
        return decode(target, [prompt], rounds, limits=[max_new_tokens], seeds=[seed], sampling=sampling,
                      backend=backend, eos_ids=eos_ids, prefill_chunk=prefill_chunk, device=device,
                      logprobs=logprobs, compiled=compiled_step(compile), stop=stop)[0]


def verify_room(k: int, cape=None) -> int:
    """The new tokens of one round's target call at up to `k` proposals: K + 1 nodes, or CaPE's tree (the
    room the target's cache keeps past the tokens kept)."""
    return k + 1 if cape is None else 1 + k * (1 + max(n for _, n in cape.bins))


def warm_up(step: CompiledStep, target, draft, k: int, cape=None, target_too: bool = True,
            adaptive: bool = False) -> None:
    """Compile now, on scratch caches, what speculation at up to `k` proposals runs through `step`: every
    verification's bucket (`target_too`: a target on one device; a sharded cache decodes eagerly) and a plain
    draft's steps (drafter_for: a GliDe or Clover draft decodes eagerly), so that none compiles inside a
    prompt's timing (speculate_one counts its draft's set-up as decoding). A draft step feeds one or two
    tokens; `adaptive`, any number (ModelDrafter.skipped: each plain step's token waits for the next round)."""
    from ..models.clover import CloverDraft
    from ..models.glide import GlideDraft
    from ..models.static_decode import BUCKETS

    if target_too:
        step.warm_up(target, range(1, verify_room(k, cape) + 1))
    if not isinstance(draft, (GlideDraft, CloverDraft)):
        step.warm_up(draft, BUCKETS if adaptive else (1, 2))


def speculate_one(target, draft, ids: list[int], limit: int, *, k: int, sampling: Sampling, eos_ids,
                  prefill_chunk: int, stop=None, backend: Backend = LOCAL, cape=None, stop_below: float = 0.0,
                  window: int | None = None, seed: int | None = None, logprobs: int | None = None,
                  compile: bool | CompiledStep = False, adaptive: bool = False,
                  draft_cost: float | None = None, verify_cost: float = 0.0) -> Result:
    """`longctx generate --draft`: one prompt by speculative decoding with a draft model (plain or
    GliDe). `seed`: the request's (its prompt's, or its sample's: generate/sampling.py), seeding the
    generator every draw of its rounds comes from (default: the run's). A stop string (`stop(row,
    tokens)`, generate/output.py's StopStrings) ends the rounds at the token that completes it, as in
    plain decoding (tau and the target passes count the rounds that ran). `adaptive`,
    `draft_cost`, `verify_cost`: --speculate-adaptive, --draft-cost and --verify-cost (speculative_generate's)."""
    t0 = time.perf_counter()
    step = compiled_step(compile)  # (one step, target and draft: its graphs serve both)
    drafter = drafter_for(target, draft, len(ids) + limit + k + 2, prefill_chunk, window, step or False)
    r = speculative_generate(target, drafter, ids, max_new_tokens=limit, k=k, sampling=sampling, eos_ids=eos_ids,
                             prefill_chunk=prefill_chunk, backend=backend, cape=cape, stop_below=stop_below,
                             logprobs=logprobs, seed=seed, compile=step or False, adaptive=adaptive,
                             draft_cost=draft_cost, verify_cost=verify_cost, stop=stop)
    # (the draft's own set-up and prompt pass count as decoding: speculation's own cost)
    r.decode_seconds = time.perf_counter() - t0 - r.prefill_seconds
    return r
