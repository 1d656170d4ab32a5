"""The drafters of speculative decoding (contracts.Drafter): what proposes the tokens a target verifies.

- `ModelDrafter`: a plain draft model (a smaller model of the target's tokenizer) with its own KV
  cache, fed the same tokens as the target: the baseline GliDe is measured against.
- `GlideDrafter`: a GliDe draft (models/glide.py), its own cache holding only its few layers' keys,
  its cross-attention reading the target's cache as the last verification left it.
- `CloverDrafter`: a Clover draft (models/clover.py), reading the target's final hidden states of
  the verified tokens (a hook on the target's final norm) through its Augmenting Block and memory.
A drafter proposes up to K tokens autoregressively after the pending one, with the distribution q_i
of each (its sampling distribution: every processor of generate/sampling.py applied, as to the
target's; the penalties and min_new_tokens with the tokens before the position, proposals
included), and is told how many were kept (`accepted`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

import torch

from ..errors import ConfigError
from ..models.glide import block_stale_visible, decode_visible, masked_prefix_attention
from ..models.kv_cache import KVCache
from ..models.static_decode import CompiledStep, compiled_step, install
from .acceptance import sampling_probs
from .cache_pool import POOL
from .local import prefill
from .sampling import UNCHOSEN, Processors, Sampling, check_chosen, process


def _sampled(q: torch.Tensor, generator) -> int:
    """A token drawn from the draft's q, read with q's finiteness in one transfer: a non-finite q (its
    q enters the rejection rule's ratio) is an error, never a token (multinomial sees a stand-in, so
    that it raises nothing on the device first)."""
    finite = torch.isfinite(q).all()
    drawn = torch.multinomial(torch.where(finite, q, torch.ones_like(q)), 1, generator=generator)
    choice, ok = torch.stack([drawn[0], finite.long()]).tolist()
    if not ok:
        check_chosen(UNCHOSEN, "the draft's")
    return choice


class ModelDrafter:
    """A draft model with its own KV cache, fed the same tokens as the target (contracts.Drafter)."""

    def __init__(self, model, max_len: int, prefill_chunk: int = 4096, compile: bool | CompiledStep = False):
        self.model, self.max_len, self.chunk = model, max_len, prefill_chunk
        # the draft's steps through a compiled static-shape step (models/static_decode.py) after its
        # prefill (its cache then holds one spare slot)
        self.compiled = compiled_step(compile)
        self.cache: KVCache | None = None
        self._unfed: list[int] = []  # kept tokens the draft has not been fed yet (a last proposal kept)
        self._base = 0  # the cache's length with the pending token fed, in the current round
        self._leases: ExitStack | None = None  # inside `generation`: where `start` leases the draft's cache
        self._leased = False  # whether `cache` is leased (let go of when the generation ends)

    @contextmanager
    def generation(self):
        """The span of one generation (speculative_generate's decode): the draft's cache that `start` makes is
        leased from generate/cache_pool.py's pool for it, as the target's is (what its compiled step built on
        it then serves the next generation), and the drafter lets go of it after: back in the pool, another
        generation may lease it, and a propose or rewind after would write into that one's rows."""
        with ExitStack() as leases:
            self._leases = leases
            try:
                yield
            finally:
                self._leases = None
                if self._leased:
                    self.cache, self._leased = None, False

    def start(self, prompt: Sequence[int], target_cache=None) -> None:
        """The prompt but its last token (which the first `propose` feeds as the pending one).
        `target_cache`: the target's cache (a plain draft does not read it)."""
        self.cache = self._own_cache(self.max_len + (self.compiled is not None))
        if len(prompt) > 1:
            prefill(self.model, self.cache, torch.tensor([list(prompt[:-1])], device=self.cache.k.device), self.chunk)
        if self.compiled is not None:
            install(self.cache, self.model, self.compiled)
        self._unfed = [int(prompt[-1])]

    def _own_cache(self, max_len: int) -> KVCache:
        """The draft's cache: leased for the generation (`generation`), else new (a drafter used on its own)."""
        if self._leases is None:
            return KVCache.for_model(self.model, 1, max_len)
        self._leased = True
        return self._leases.enter_context(POOL.lease(self.model, 1, max_len))

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's logits [vocab] after feeding `tokens` [1, n] to its cache."""
        return self.model(tokens, cache=self.cache)[0, -1]

    def propose(self, pending: int, k: int, sampling: Sampling, generator,
                stop_below: float = 0.0, processors: Processors | None = None) -> tuple[list[int], torch.Tensor]:
        """Up to k proposals after `pending` and the distribution each was drawn from. `stop_below`:
        the round ends after a proposal to which the draft gives a probability below it (at T = 0
        the top probability of its penalised logits' softmax): a draft that hesitates is likely wrong,
        and every further proposal costs a draft step. The stop reads only the draft, so sampling stays exact.
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
            choice = int(q.argmax()) if greedy else _sampled(q, generator)
            tokens.append(choice)
            qs.append(q)
            if stop_below and i + 1 < k and _confidence(logits, q, choice, sampling, processors) < stop_below:
                break
            token = torch.tensor([[choice]], device=device)
            if processors is not None:
                processors.chosen(token[0])
        self._last = tokens[-1]
        return tokens, torch.stack(qs)

    def skipped(self, pending: int) -> None:
        """A plain step took `pending` (contracts.Drafter): it is fed with the next round's (one call)."""
        self._unfed.append(int(pending))

    def rewind(self, prompt: Sequence[int]) -> None:
        """Back to the state `start(prompt)` left (the cache keeps the prompt's slots: no prefill)."""
        self.cache.truncate(len(prompt) - 1)
        self._unfed = [int(prompt[-1])]

    def accepted(self, n: int, k: int, extra: int | None = None, nodes: list[int] | None = None) -> None:
        """n of the k proposals were kept (and, with CaPE, `extra`: an alternative kept after them;
        `nodes`, the verification call's kept rows, matter to a drafter that reads them: Clover's).
        The cache holds pending, d_1..d_{k-1} (d_k was never fed): keep pending and d_1..d_n; a kept
        d_k, or the alternative, is fed with the next pending token."""
        self.cache.truncate(self._base + min(n, k - 1))
        if n == k:
            self._unfed = [self._last]
        elif extra is not None:
            self._unfed = [extra]


def _confidence(logits: torch.Tensor, q: torch.Tensor, choice: int, sampling: Sampling,
                processors: Processors | None = None) -> float:
    """The draft's probability of its choice: from q when q is a distribution, from the softmax of the
    logits it was chosen from (penalised by `processors`, the state before the choice: step 1 of
    generate/sampling.py) when greedy decoding made q one-hot. The raw logits' softmax, read until
    2026-12-07, ignored the penalties: a self draft under --repetition-penalty 0.6 --confidence-stop 0.5
    kept every proposal yet stopped each round after one (tau 1.92 for 4.6; CaPE's tree, whose q is
    the penalised softmax, read that already)."""
    if not sampling.greedy:
        return float(q[choice])
    return float(torch.softmax(process(logits[None], sampling, processors)[0], -1)[choice])


class GlideDrafter(ModelDrafter):
    """A GliDe draft (models/glide.py): its own cache holds only its few layers' keys, and its
    cross-attention reads the target's cache as the last verification left it (every proposal of a
    round sees the same target slots, as in training's block-stale mask; a verified token fed late,
    the slots training shows its position). The target's cache is on
    one device (models/kv_cache.KVCache) or sharded over head x ctx ranks (generate/sharded.py: read
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

    @contextmanager
    def generation(self):
        """One generation (ModelDrafter's; a GliDe draft's own cache, eager and of the draft's few layers, is
        made at `start`): the target's cache let go of after it, back in the pool (generate/cache_pool.py), so
        that a later propose reads no other generation's rows."""
        try:
            yield
        finally:
            self.target_cache = None

    def rewind(self, prompt: Sequence[int]) -> None:
        self.cache.truncate(len(prompt) - 1 - self.offset)
        self._unfed = [int(prompt[-1])]

    def _target_kv(self):
        tc = self.target_cache
        if isinstance(tc, KVCache):
            return [(tc.k[layer], tc.v[layer]) for layer in self.model.target_layers]
        return [functools.partial(tc.read_attention, layer) for layer in self.model.target_layers]

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's logits after `tokens` [1, n]: the round's (at positions >= the target's slots) read
        every slot; verified tokens fed before the pending one read what training shows their positions
        (models/glide.py decode_visible). Until 2026-12-07 they read every slot too, their own and, after a
        run of adaptive K's plain steps, every later one: what a 2+ layer draft's own cache kept of them
        (its layers past the first) was computed from reads training never showed it."""
        device, n = tokens.device, tokens.shape[1]
        first = self.offset + int(self.cache.lengths[0])
        slots = int(self.target_cache.lengths[0])
        positions = first + torch.arange(n, device=device)[None]
        kv = self._target_kv()
        if first >= slots:  # (no verified token in the feed) one cache: every query reads its first `slots`,
            # one kernel call without a mask (prefix_attention)
            visible = slots if isinstance(self.target_cache, KVCache) else torch.full((1, n), slots, device=device)
        else:
            visible = decode_visible(positions, slots, self.block)
            if isinstance(self.target_cache, KVCache):  # (a reader: the masked read of the first `slots`)
                kv = [functools.partial(masked_prefix_attention, k, v, slots) for k, v in kv]
        return self.model(self.target, tokens, positions, kv, visible, cache=self.cache)[0, -1]


class _StateSink:
    """Where the hook on the target's final norm leaves its outputs (the final hidden states of every
    target call: the prefill's chunks, then each verification's rows). Holds no drafter, so a drafter
    is collected as usual and its finalizer removes the hook; keeps at most `rows` rows (oldest
    dropped: a target run with no speculation meanwhile, e.g. plain decoding, cannot grow it)."""

    def __init__(self, rows: int):
        self.rows, self.held = rows, []

    def hook(self, module, inputs, output) -> None:
        self.held.append(output.detach())
        while len(self.held) > 1 and sum(h.shape[1] for h in self.held[1:]) >= self.rows:
            self.held.pop(0)

    def take(self) -> list[torch.Tensor]:
        held, self.held = self.held, []
        return held


class CloverDrafter(ModelDrafter):
    """A Clover draft (models/clover.py): it reads the target's final hidden states, captured by a
    forward hook on the target's final norm (`norm`), registered here and removed when the drafter is
    collected. Its Augmenting Block and Attention Decoder memory (one KVCache of two layers) hold the
    verified positions from `offset` on (the prompt's last `window`, then every kept token); a round
    starts from the augmented state of the last verified position. One device, eager (drafter_for and
    start refuse the rest)."""

    def __init__(self, draft, target, max_len: int, block: int, window: int = 0):
        super().__init__(draft, max_len)
        self.target, self.block, self.window = target, block, window
        self.sink = _StateSink(max_len)
        handle = target.norm.register_forward_hook(self.sink.hook)
        self._unhook = weakref.finalize(self, handle.remove)
        self.offset = 0   # the first position the draft's cache holds
        self.base = 0     # the position of the pending token (the next to verify)
        self.state = self._start_state = None  # [1, 1, dim]: the augmented state at base - 1

    def start(self, prompt: Sequence[int], target_cache=None) -> None:
        """After the target's prefill of `prompt` (its final states captured chunk by chunk): the
        Augmenting Block over the last `window` positions of it, the memory filled."""
        if not isinstance(target_cache, KVCache):
            raise ConfigError("a Clover draft decodes on one device: it reads the target's final hidden states of "
                              "every verified token, which a cache sharded over head x ctx ranks does not gather; "
                              "run with --nproc 1 (or use a GliDe draft).")
        n = len(prompt)
        held = self.sink.take()
        hidden = torch.cat(held, dim=1)[:, -n:] if held else None
        if hidden is None or hidden.shape[1] < n:
            raise RuntimeError("a CloverDrafter must exist before the target's prefill of the prompt (its hook "
                               "captures the prompt's final hidden states)")
        cfg, w = self.target.cfg, self.target.tok_embeddings.weight
        self.cache = KVCache(2, 1, self.max_len, cfg.kv_heads, cfg.resolved_head_dim, dtype=w.dtype, device=w.device)
        self.offset = max(0, n - self.window) if self.window else 0
        positions = torch.arange(self.offset, n, device=w.device)[None]
        augmented = self.model.extend(hidden[:, self.offset:].to(w.dtype), positions, self.cache)
        self.state = self._start_state = augmented[:, -1:]
        self.base = n
        self._unfed = []

    def rewind(self, prompt: Sequence[int]) -> None:
        self.cache.truncate(len(prompt) - self.offset)
        self.state, self.base, self._unfed = self._start_state, len(prompt), []
        self.sink.take()

    def propose(self, pending: int, k: int, sampling: Sampling, generator, stop_below: float = 0.0,
                processors: Processors | None = None) -> tuple[list[int], torch.Tensor]:
        self._step_state, self._step = self.state, 0
        self.sink.take()  # (the states before this round were learned; the verification's come next)
        return super().propose(pending, k, sampling, generator, stop_below, processors)

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """One regressive step: tokens [1, 1] at position base + step, from the previous step's state,
        reading every memory slot (all verified before this round: block-stale)."""
        position = torch.full((1, 1), self.base + self._step, device=tokens.device)
        slots = int(self.cache.lengths[0])
        self._step_state = self.model.step(self._step_state, self.target.tok_embeddings(tokens), position,
                                           self.cache.k[1], self.cache.v[1], slots)
        self._step += 1
        return self.model.logits(self.target, self._step_state)[0, -1]

    def skipped(self, pending: int) -> None:
        """A plain step took `pending`: its call's one row continues the Augmenting Block and the memory."""
        self.accepted(0, 0, nodes=[0])

    def accepted(self, n: int, k: int, extra: int | None = None, nodes: list[int] | None = None) -> None:
        """The last verification call's rows that were kept (`nodes`: a CaPE tree's root and accepted
        path; default rows 0..n: pending and the n kept proposals) continue the Augmenting Block and the
        memory; the last one's augmented state starts the next round."""
        rows = list(range(n + 1)) if nodes is None else list(nodes)
        held = self.sink.take()
        if not held or held[-1].shape[1] <= max(rows):
            raise RuntimeError("CloverDrafter.accepted follows a verification call of the target (its final "
                               "hidden states were not captured)")
        device = held[-1].device
        positions = self.base + torch.arange(len(rows), device=device)[None]
        hidden = held[-1][:, rows].to(self.target.tok_embeddings.weight.dtype)
        self.state = self.model.extend(hidden, positions, self.cache)[:, -1:]
        self.base += len(rows)


def check_draft_vocab(target, drafter) -> None:
    """A plain draft model's vocabulary is the target's (the command checks its --draft: drafts.py): else its
    proposals index the target's logits out of range, or its q and the target's p differ in size, errors from
    inside a round that name neither model (a smaller one decoded greedily, silently)."""
    if isinstance(drafter, ModelDrafter):
        own, theirs = getattr(getattr(drafter.model, "cfg", None), "vocab_size", None), target.cfg.vocab_size
        if own is not None and own != theirs:
            raise ValueError(f"the draft has a vocabulary of {own} tokens but the target has {theirs}: a draft "
                             f"must share the target's tokenizer")


def drafter_for(target, draft, max_len: int, prefill_chunk: int = 4096, window: int | None = None,
                compile: bool | CompiledStep = False) -> ModelDrafter:
    """The drafter of `draft`: a GliDe draft (models/glide.py, its `block` set by its checkpoint) reads
    the target's cache, its own prompt pass over the last `window` tokens (0 = all; None = the
    sequence length it was trained on, where its checkpoint records it: a longer self-attention is
    outside what it learned, and at long prompts the pass is most of its cost); any other model
    drafts with its own (`compile`: its steps compiled, as generate's; a GliDe draft's stay eager)."""
    from ..models.clover import CloverDraft
    from ..models.glide import GlideDraft

    if isinstance(draft, CloverDraft):
        if compile:
            raise ConfigError("a Clover draft decodes eagerly: its drafter reads the target's final hidden states "
                              "through a hook on the target's final norm, which a compiled step skips; drop "
                              "--compile (or use a GliDe draft).")
        return CloverDrafter(draft, target, max_len, draft.block, draft_window(draft, window))
    if isinstance(draft, GlideDraft):
        return GlideDrafter(draft, target, max_len, draft.block, draft_window(draft, window))
    return ModelDrafter(draft, max_len, prefill_chunk, compile)


def draft_window(draft, window: int | None) -> int:
    """A GliDe draft's prompt window: `window` as given, or (None) the sequence length its checkpoint
    records it was trained on (0, the whole prompt, for a checkpoint that records none)."""
    return window if window is not None else getattr(draft, "trained_seq_len", 0)
