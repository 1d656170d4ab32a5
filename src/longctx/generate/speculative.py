"""Speculative decoding on one device: a draft proposes K tokens, the target verifies them in one pass.

One round, with the target's cache holding the prompt and every emitted token but the last (the
`pending` token, not yet fed):
1. the draft proposes d_1..d_K autoregressively, with its distribution q_i of each (its sampling
   distribution: every processor of generate/sampling.py applied, as to the target's; the penalties
   and min_new_tokens with the tokens before the position, proposals included);
2. the target runs [pending, d_1..d_K] in one cached call (the new tokens attend to the cache and,
   causally, to each other: models/cache.py's chunk attention) and gets p_1..p_{K+1};
3. acceptance. Greedy (T = 0): d_i is kept while it is the target's argmax; the first disagreement
   is replaced by the target's own choice, and when every d_i is kept the target's next choice is
   a bonus token. So the output is token-identical to plain greedy decoding. Sampling (T > 0), the
   rejection rule of speculative sampling (Leviathan et al., Chen et al.): d_i is kept with
   probability min(1, p_i(d_i) / q_i(d_i)); the first rejected position draws from
   norm(max(0, p_i - q_i)); when all are kept the bonus draws from p_{K+1}. The tokens are then
   distributed exactly as the target's own sampling;
4. the target's cache keeps [pending, the kept d_i] and forgets the rest (its lengths go back: the
   slots are overwritten later); the replaced or bonus token becomes the new pending one.

`ModelDrafter` is a plain draft model with its own cache (the baseline GliDe is measured against).
A drafter is anything with `start(prompt)`, `propose(pending, k, sampling, generator) -> (tokens,
q)` and `accepted(n)`; GliDe's reads the target's cache instead of keeping one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..models.cache import KVCache
from .engine import GREEDY, LOCAL, prefill
from .sampling import Processors, Sampling, process


def sampling_probs(logits: torch.Tensor, sampling: Sampling, processors: Processors | None = None) -> torch.Tensor:
    """The distribution a token is drawn from (fp32 [rows, vocab]): the penalties and min_new_tokens
    (`processors`: each row's state, the tokens before its position), then temperature, top-k, top-p
    and min-p (sampling.warp); greedy: one-hot on the argmax of the penalised logits."""
    return _probs(process(logits, sampling, processors), sampling)


def _probs(processed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution of processed logits (sampling.process): one-hot on the argmax when greedy."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(processed.argmax(-1), processed.shape[-1]).float()
    return processed.softmax(-1)


def _logprob(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """A token's log-probability under processed logits `row` [vocab], and the `top` most likely (id,
    log-probability), those at -inf left out: as the engine's --logprobs."""
    lp = torch.log_softmax(row, -1)
    best = torch.topk(lp, min(top, lp.shape[-1])) if top else None
    pairs = [] if best is None else [(i, v) for i, v in zip(best.indices.tolist(), best.values.tolist())
                                     if v != float("-inf")]
    return float(lp[token]), pairs

class ModelDrafter:
    """A draft model with its own KV cache, fed the same tokens as the target."""

    def __init__(self, model, max_len: int, prefill_chunk: int = 4096):
        self.model, self.max_len, self.chunk = model, max_len, prefill_chunk
        self.cache: KVCache | None = None
        self._unfed: list[int] = []  # kept tokens the draft has not been fed yet (a last proposal kept)
        self._base = 0  # the cache's length with the pending token fed, in the current round

    def start(self, prompt: Sequence[int], target_cache=None) -> None:
        """The prompt but its last token (which the first `propose` feeds as the pending one).
        `target_cache`: the target's cache (a plain draft does not read it)."""
        self.cache = KVCache.for_model(self.model, 1, self.max_len)
        if len(prompt) > 1:
            prefill(self.model, self.cache, torch.tensor([list(prompt[:-1])], device=self.cache.k.device), self.chunk)
        self._unfed = [int(prompt[-1])]

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's logits [vocab] after feeding `tokens` [1, n] to its cache."""
        return self.model(tokens, cache=self.cache)[0, -1]

    def propose(self, pending: int, k: int, sampling: Sampling, generator,
                stop_below: float = 0.0, processors: Processors | None = None) -> tuple[list[int], torch.Tensor]:
        """Up to k proposals after `pending` and the distribution each was drawn from. `stop_below`:
        the round ends after a proposal to which the draft gives a probability below it (at T = 0
        its softmax's top probability): a draft that hesitates is likely wrong, and every further
        proposal costs a draft step. The stop reads only the draft, so sampling stays exact.
        `processors`: the penalties' state after pending (updated here with each proposal, on a copy),
        so the draft's q is processed as the target's p is."""
        device = self.cache.k.device
        processors = processors.copy() if processors is not None else None
        token, tokens, qs = torch.tensor([[*self._unfed, pending]], device=device), [], []
        self._unfed = []
        for i in range(k):
            logits = self._logits(token)
            if i == 0:
                self._base = int(self.cache.lengths[0])
            q = sampling_probs(logits[None], sampling, processors)[0]
            # (no generator: the most likely token, with q the full distribution: CaPE's confidences)
            greedy = sampling.greedy or generator is None
            choice = int(q.argmax()) if greedy else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(choice)
            qs.append(q)
            if stop_below and i + 1 < k and _confidence(logits, q, choice, sampling) < stop_below:
                break
            token = torch.tensor([[choice]], device=device)
            if processors is not None:
                processors.chosen(token[0])
        self._last = tokens[-1]
        return tokens, torch.stack(qs)

    def rewind(self, prompt: Sequence[int]) -> None:
        """Back to the state `start(prompt)` left (the cache keeps the prompt's slots: no prefill)."""
        self.cache.truncate(len(prompt) - 1)
        self._unfed = [int(prompt[-1])]

    def accepted(self, n: int, k: int, extra: int | None = None) -> None:
        """n of the k proposals were kept (and, with CaPE, `extra`: an alternative kept after them).
        The cache holds pending, d_1..d_{k-1} (d_k was never fed): keep pending and d_1..d_n; a kept
        d_k, or the alternative, is fed with the next pending token."""
        self.cache.truncate(self._base + min(n, k - 1))
        if n == k:
            self._unfed = [self._last]
        elif extra is not None:
            self._unfed = [extra]


def _confidence(logits: torch.Tensor, q: torch.Tensor, choice: int, sampling: Sampling) -> float:
    """The draft's probability of its choice: from q when q is a distribution, from the logits'
    softmax when greedy decoding made q one-hot."""
    return float(torch.softmax(logits.float(), -1)[choice]) if sampling.greedy else float(q[choice])


class GlideDrafter(ModelDrafter):
    """A GliDe draft (models/glide.py): its own cache holds only its few layers' keys, and its
    cross-attention reads the target's cache as the last verification left it (every proposal of a
    round sees the same target slots, as in training's block-stale mask). The target's cache is on
    one device (models/cache.KVCache) or sharded over head x ctx ranks (generate/sharded.py: read
    through its read_attention, each rank its share, merged), the draft run alike on every rank."""

    def __init__(self, draft, target, max_len: int, block: int, window: int = 0):
        super().__init__(draft, max_len)
        self.target, self.block, self.window = target, block, window
        self.target_cache = None
        self.offset = 0  # the position of the draft cache's first slot (its prompt pass starts there)

    def start(self, prompt: Sequence[int], target_cache=None) -> None:
        """The draft's pass over the prompt (but its last token), each position reading the target
        slots before its block as training's mask does. With a `window` (LongSpec's), only the last
        `window` positions: the draft's own cache then holds those, and the target's cache, which
        holds everything, gives the rest of the context through the cross-attention."""
        from ..models.glide import block_stale_visible

        cfg, w = self.target.cfg, self.target.tok_embeddings.weight
        self.target_cache = target_cache
        self.cache = KVCache(len(self.model.layers), 1, self.max_len, cfg.kv_heads, cfg.resolved_head_dim,
                             dtype=w.dtype, device=w.device)
        n = len(prompt) - 1
        self.offset = max(0, n - self.window) if self.window else 0
        if n > self.offset:
            visible = block_stale_visible(n, self.block, w.device)[None, self.offset:]
            self.model.hidden_states(self.target, torch.tensor([list(prompt[self.offset:-1])], device=w.device),
                                     torch.arange(self.offset, n, device=w.device)[None], self._target_kv(),
                                     visible, cache=self.cache, fill_only=True)
        self._unfed = [int(prompt[-1])]

    def rewind(self, prompt: Sequence[int]) -> None:
        self.cache.truncate(len(prompt) - 1 - self.offset)
        self._unfed = [int(prompt[-1])]

    def _target_kv(self):
        tc = self.target_cache
        if isinstance(tc, KVCache):
            return [(tc.k[layer], tc.v[layer]) for layer in self.model.target_layers]
        return [functools.partial(tc.read_attention, layer) for layer in self.model.target_layers]

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        device, n = tokens.device, tokens.shape[1]
        positions = self.offset + int(self.cache.lengths[0]) + torch.arange(n, device=device)
        slots = int(self.target_cache.lengths[0])
        # one cache: every query reads its first `slots` (models/glide.py prefix_attention); sharded, the
        # reader takes a per-query limit
        visible = slots if isinstance(self.target_cache, KVCache) else torch.full((1, n), slots, device=device)
        return self.model(self.target, tokens, positions[None], self._target_kv(), visible, cache=self.cache)[0, -1]


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
            pending = _draw(_probs(processed, sampling)[0], sampling, generator)
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


def speculative_round(target, cache: KVCache, drafter, pending: int, k: int, sampling: Sampling,
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
    p = _probs(processed, sampling)  # [k + 1, vocab]
    kept, following = _accept(proposals, q, p, sampling, generator)
    if rows is not None:
        rows.extend(processed[:kept + 1])
    cache.truncate(int(cache.lengths[0]) - (k - kept))
    drafter.accepted(kept, k)
    return proposals[:kept], following, k


def _draw(probs: torch.Tensor, sampling: Sampling, generator) -> int:
    return int(probs.argmax()) if sampling.greedy else int(torch.multinomial(probs, 1, generator=generator))


def _accept(proposals: list[int], q: torch.Tensor, p: torch.Tensor, sampling: Sampling, generator):
    """(how many proposals are kept, the token after them): the greedy rule, or the rejection rule."""
    for i, d in enumerate(proposals):
        if sampling.greedy:
            if int(p[i].argmax()) != d:
                return i, int(p[i].argmax())
            continue
        ratio = float(p[i, d]) / max(float(q[i, d]), 1e-30)
        if float(torch.rand((), generator=generator, device=p.device)) >= min(1.0, ratio):
            residual = (p[i] - q[i]).clamp(min=0)
            total = float(residual.sum())
            residual = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(proposals), _draw(p[len(proposals)], sampling, generator)


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


def drafter_for(target, draft, max_len: int, prefill_chunk: int = 4096, window: int | None = None) -> ModelDrafter:
    """The drafter of `draft`: a GliDe draft (models/glide.py, its `block` set by its checkpoint) reads
    the target's cache, its own prompt pass over the last `window` tokens (0 = all; None = the
    sequence length it was trained on, where its checkpoint records it: a longer self-attention is
    outside what it learned, and at long prompts the pass is most of its cost); any other model
    drafts with its own."""
    from ..models.glide import GlideDraft

    if isinstance(draft, GlideDraft):
        return GlideDrafter(draft, target, max_len, draft.block, draft_window(draft, window))
    return ModelDrafter(draft, max_len, prefill_chunk)


def draft_window(draft, window: int | None) -> int:
    """A GliDe draft's prompt window: `window` as given, or (None) the sequence length its checkpoint
    records it was trained on (0, the whole prompt, for a checkpoint that records none)."""
    return window if window is not None else getattr(draft, "trained_seq_len", 0)


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
