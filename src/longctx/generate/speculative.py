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
With a CaPE table the round is a tree instead (generate/cape.py tree_round, greedy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .acceptance import accept, choose, token_probs
from .drafters import drafter_for
from .engine import GREEDY
from .local import LOCAL
from .sampling import Processors, Sampling, process


def _logprob(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """A token's log-probability under processed logits `row` [vocab], and the `top` most likely (id,
    log-probability), those at -inf left out: as the engine's --logprobs."""
    lp = torch.log_softmax(row, -1)
    best = torch.topk(lp, min(top, lp.shape[-1])) if top else None
    pairs = [] if best is None else [(i, v) for i, v in zip(best.indices.tolist(), best.values.tolist())
                                     if v != float("-inf")]
    return float(lp[token]), pairs


@dataclass
class SpeculativeResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # proposals kept per target pass
    proposed: list[int] = field(default_factory=list)  # proposals made per target pass (<= k)
    prefill_seconds: float = 0.0  # the target's prefill and first token (the draft's prompt pass is after it)
    logprobs: list[float] | None = None  # each token's, with speculative_generate's `logprobs`
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def passes(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per target pass, the replaced or bonus token included."""
        return (sum(self.accepted) + self.passes) / max(self.passes, 1)


def speculative_generate(target, drafter, prompt: Sequence[int], *, max_new_tokens: int, k: int,
                         sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (), prefill_chunk: int = 4096,
                         generator: torch.Generator | None = None, backend=LOCAL, cape=None,
                         stop_below: float = 0.0, logprobs: int | None = None) -> SpeculativeResult:
    """Continue `prompt` (batch 1) by up to max_new_tokens tokens, up to k proposals per target pass
    (fewer after a proposal the draft gives less than `stop_below`: ModelDrafter.propose).
    `backend`: the target's cache and prefill (engine.py's; generate/sharded.py's ShardedGeneration
    on every rank of a head x ctx layout, the draft then run alike on every rank). `cape`: a
    generate/cape.py CapeTable, to verify each round's proposals as a tree (greedy). `logprobs`: as
    the engine's (None, 0 or N): each token's from the target's processed logits at its position
    (the verification call's row, or the prefill's; a CaPE tree's: the accepted path's rows)."""
    if k < 1:
        raise ValueError(f"speculate at least one token per pass, got {k}")
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    if cape is not None and not sampling.greedy:
        raise ValueError("CaPE's tree is verified greedily (temperature 0)")
    device = target.tok_embeddings.weight.device
    eos = {int(e) for e in eos_ids}
    generator = generator if generator is not None else sampling.generator(device)
    out = SpeculativeResult([])
    rows = None if logprobs is None else []  # the processed logits of each token to come, in order
    if rows is not None:
        out.logprobs, out.top_logprobs = [], [] if logprobs else None

    def emit(token: int) -> None:
        out.tokens.append(token)
        if state is not None:
            state.chosen(torch.tensor([token], device=device))
        if rows is not None:
            lp, top = _logprob(rows.pop(0), token, logprobs)
            out.logprobs.append(lp)
            if logprobs:
                out.top_logprobs.append(top)

    was_training = target.training
    target.eval()
    try:
        with torch.inference_mode():
            # room for one round's call past the tokens kept: K + 1 nodes, or CaPE's tree
            call = k + 1 if cape is None else 1 + k * (1 + max(n for _, n in cape.bins))
            cache = backend.cache(target, 1, len(prompt) + max_new_tokens + call)
            t0 = time.perf_counter()
            logits = backend.prefill(target, cache, torch.tensor([list(prompt)], device=device), prefill_chunk)[0]
            # the penalties' state: the prompt and every emitted token (pending included)
            state = Processors(sampling, [list(prompt)], logits.shape[-1], sorted(eos), logits.device) \
                if sampling.penalised or sampling.min_new_tokens else None
            processed = process(logits[None], sampling, state)
            pending = choose(token_probs(processed, sampling)[0], sampling, generator)
            if rows is not None:
                rows.append(processed[0])
            out.prefill_seconds = time.perf_counter() - t0
            drafter.start(list(prompt), cache)
            while True:
                if pending in eos or len(out.tokens) >= max_new_tokens:
                    break
                emit(pending)
                if len(out.tokens) >= max_new_tokens:
                    break
                if cape is not None:
                    from .cape import tree_round

                    emitted, pending, proposed = tree_round(target, cache, drafter, pending, k, cape, stop_below,
                                                            state, rows)
                else:
                    emitted, pending, proposed = speculative_round(target, cache, drafter, pending, k, sampling,
                                                                   generator, stop_below, state, rows)
                out.accepted.append(len(emitted))
                out.proposed.append(proposed)
                for t in emitted:
                    if t in eos or len(out.tokens) >= max_new_tokens:
                        return out
                    emit(t)
    finally:
        target.train(was_training)
    return out


def speculative_round(target, cache, drafter, pending: int, k: int, sampling: Sampling,
                      generator, stop_below: float = 0.0, state: Processors | None = None,
                      rows: list | None = None) -> tuple[list[int], int, int]:
    """One draft-then-verify round after `pending` (the last emitted token, not in `cache` yet): the
    kept proposals, the token after them (the target's replacement or bonus: the next pending) and
    how many proposals were made. `state`: the penalties' state after pending (one row); verified
    position i is processed with proposals d_1..d_i added (Processors.chain), the draft's alike, so
    p and q are the processed distributions and the rule stays exact. `rows`, when given, receives
    the target's processed logits of the kept proposals and of the token after them (logprobs).
    Leaves `cache` holding pending and the kept proposals, and the drafter told."""
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
    drafter.accepted(kept, k)
    return proposals[:kept], following, k


@dataclass
class Speculated:
    """One prompt's speculative generation, read like an engine Result (plus tau and passes)."""
    prompt_tokens: int
    tokens: list[int]
    finish_reason: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    tau: float
    passes: int
    sample: int = 0             # which of the prompt's num_samples continuations
    seed: int | None = None     # the seed its draws came from (None when greedy)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def speculate_one(target, draft, ids: list[int], limit: int, *, k: int, sampling: Sampling, eos_ids,
                  prefill_chunk: int, stop=None, backend=LOCAL, cape=None, stop_below: float = 0.0,
                  window: int | None = None, seed: int | None = None, logprobs: int | None = None) -> Speculated:
    """`longctx generate --draft`: one prompt by speculative decoding with a draft model (plain or
    GliDe); a stop string (`stop(row, tokens)`, generate/output.py's StopStrings) is applied to the
    finished tokens. `seed`: the request's (its prompt's, or its sample's: generate/sampling.py),
    seeding the generator every draw of its rounds comes from (default: the run's)."""
    t0 = time.perf_counter()
    device = target.tok_embeddings.weight.device
    r = speculative_generate(target, drafter_for(target, draft, len(ids) + limit + k + 2, prefill_chunk, window), ids,
                             max_new_tokens=limit, k=k, sampling=sampling, eos_ids=eos_ids,
                             prefill_chunk=prefill_chunk, backend=backend, cape=cape, stop_below=stop_below,
                             generator=sampling.generator(device, seed), logprobs=logprobs)
    seconds = time.perf_counter() - t0
    tokens, reason = r.tokens, "length" if len(r.tokens) >= limit else "eos"
    if stop is not None:
        for n in range(1, len(tokens) + 1):
            if stop(0, tokens[:n]):
                tokens, reason = tokens[:n], "stop"
                break
    decode_s = seconds - r.prefill_seconds  # (the draft's prompt pass included: speculation's own cost)
    return Speculated(len(ids), tokens, reason, len(ids) / r.prefill_seconds if r.prefill_seconds > 0 else 0.0,
                      max(len(r.tokens) - 1, 0) / decode_s if decode_s > 0 else 0.0, r.tau, r.passes,
                      seed=None if sampling.greedy else (sampling.seed if seed is None else seed),
                      logprobs=None if r.logprobs is None else r.logprobs[:len(tokens)],
                      top_logprobs=None if r.top_logprobs is None else r.top_logprobs[:len(tokens)])
