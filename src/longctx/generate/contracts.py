"""The contracts of generate/: what a KV cache, a backend, a drafter and a decoding's rounds promise.

Each is a `typing.Protocol`, runtime-checkable (isinstance says an object has the members;
tests/unit/test_generate_contracts.py also holds each implementation's signatures to these):

| contract | implementations |
|---|---|
| `Cache`, `CacheLayer` | models/kv_cache.py KVCache (one device), generate/sharded.py ShardedKVCache (a rank's share) |
| `Backend` | generate/local.py LocalGeneration, generate/sharded.py ShardedGeneration |
| `FlatPrefill` | LocalGeneration (prompts of different lengths in one prefill call) |
| `LeasedCaches` | LocalGeneration (caches kept across generations: generate/cache_pool.py) |
| `Drafter` | generate/drafters.py ModelDrafter, GlideDrafter, CloverDrafter |
| `Rounds` | generate/engine.py PlainRounds, generate/speculative.py SpeculativeRounds (chain or CaPE tree) |

The decode loop (generate/loop.py) is written against these alone: it never asks which cache,
backend or decoding it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..models.cached_attention import CacheStep
from .sampling import Processors, Sampling


@runtime_checkable
class CacheLayer(Protocol):
    """One layer's view of a cache: what a block's attention calls with the new tokens' q, k, v."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [batch, new, heads, head_dim] and k, v [batch, new, kv_heads, head_dim] of the running
        call's new tokens (every head, on every rank) -> the attention output [batch, new, heads,
        head_dim] (q's dtype) over everything each row holds, the new keys and values appended first:
        the new token at position p sees positions 0..p, or, after `Cache.among`, the held ones and
        the new tokens the tree mask names."""


@runtime_checkable
class Cache(Protocol):
    """Every layer's keys and values of `batch` rows of up to `max_len` tokens, behind the model's
    `cache=` seam: `model(tokens [batch, new], positions, cache=cache)` (models/llama.py) calls
    `begin(new)`, then `layer(i).attend(q, k, v)` for every layer, then `end(ok)`.

    - `k`, `v`: [layers, batch, kv_heads, slots, head_dim] in the model's dtype on its device (a
      sharded cache: this rank's kv heads and slots); `k.device` is where the cache lives. A slot
      past a row's tokens holds zeros or a forgotten token's values, never a NaN.
    - `lengths`: np.int64 [batch] on the host, the tokens each row holds (all ranks' together); read
      by callers, written only by the cache. Rows of a call may hold different lengths.
    - `step`: the running call's CacheStep (None between calls).
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: np.ndarray
    max_len: int
    step: CacheStep | None

    @property
    def batch(self) -> int:
        """Rows."""

    @property
    def nbytes(self) -> int:
        """Bytes of `k` and `v` (on this rank)."""

    def rows(self, start: int, stop: int) -> Cache:
        """Rows [start, stop) as a cache of their own, sharing storage and lengths with this one (a
        prefill group writes them in place)."""

    def layer(self, index: int) -> CacheLayer:
        """Layer `index`'s view, for the running call."""

    def begin(self, new: int, device=None) -> CacheStep:
        """Start a call appending `new` tokens to every row (positions on `device`). Raises when a call
        is running or the tokens do not fit in `max_len`."""

    def end(self, ok: bool = True) -> None:
        """Finish the running call: with `ok` the rows now hold its tokens; else it is forgotten (what
        it wrote lies past the lengths and is written over later)."""

    def truncate(self, length: int) -> None:
        """Every row forgets its tokens past `length` (at most every row's length; a sharded cache:
        only tokens of the last call), speculation's rejected proposals."""

    def among(self, visible: torch.Tensor) -> None:
        """For the next call only: its new token j sees new token i when visible[j, i] ([new, new]
        bool, a speculative tree: ancestors and itself), instead of causally."""

    def keep(self, nodes: list[int]) -> None:
        """After a call on rows holding one length: keep only `nodes` of its tokens (indices in the
        call, in the order the rows continue with) after what the rows held; forget the others."""

    def reset(self) -> None:
        """Every row empty."""


@runtime_checkable
class Backend(Protocol):
    """Where a generation's cache lives and how prompts fill it: one device, or this rank's part of
    a head x ctx layout (every rank then makes the same calls and gets the same logits)."""

    def cache(self, model, batch: int, max_len: int, core=None) -> Cache:
        """An empty cache for `model` (its dtype and device) of `batch` rows of up to `max_len`
        tokens. `core`: another attention core (one device only; a sharded cache refuses one)."""

    def prefill(self, model, cache: Cache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        """Prompts `tokens` [rows, length] (one length, long) appended to `cache`'s rows (a sharded
        cache: empty rows) -> the logits [rows, vocab] fp32 of their last position. `chunk`: prompt
        tokens per model call on one device (a sharded prefill is one call)."""

    def repeat_rows(self, cache: Cache, rows: int, times: int) -> None:
        """Rows [0, rows) copied to [s x rows, (s + 1) x rows) for s = 1..times-1 (a prompt's samples
        share its prefill)."""


@runtime_checkable
class FlatPrefill(Backend, Protocol):
    """A backend that also prefills prompts of different lengths in one call."""

    def prefill_flat(self, model, cache: Cache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prompts (token ids, any lengths) into empty cache rows, one each in order -> the logits
        [rows, vocab] fp32 of each prompt's last token."""


@runtime_checkable
class LeasedCaches(Backend, Protocol):
    """A backend that keeps caches across generations (what was built on one, its compiled step's graphs,
    then serves the next): a generation leases one for its duration instead of making one."""

    def lease(self, model, batch: int, max_len: int, core=None) -> AbstractContextManager[Cache]:
        """A context giving an empty cache for `model` of `batch` rows of at least `max_len` tokens, no other
        lease's while it lasts. `core`: another attention core (such a cache is the caller's alone)."""


@runtime_checkable
class Drafter(Protocol):
    """What proposes the tokens a target verifies (speculative decoding, one sequence). Between
    rounds the target's cache holds the prompt and every emitted token but the last (`pending`).
    Optionally `generation()`, a context around one generation (generate/drafters.py's: the draft's cache
    leased from generate/cache_pool.py for it, and no pooled cache held after it)."""

    def start(self, prompt: Sequence[int], target_cache: Cache | None = None) -> None:
        """After the target's prefill of `prompt` into `target_cache`: ready to propose after it (the
        prompt's last token is fed with the first `pending`)."""

    def propose(self, pending: int, k: int, sampling: Sampling, generator: torch.Generator | None,
                stop_below: float = 0.0, processors: Processors | None = None) -> tuple[list[int], torch.Tensor]:
        """1..k tokens after `pending` and q [tokens, vocab] fp32, the distribution each was drawn from
        (`sampling`, with `processors`' state after pending and the proposals before it: the target's
        processing). Greedy, or no generator: the most likely token (q then the softmax, CaPE's
        confidences). Fewer than k after a proposal given less than `stop_below`."""

    def accepted(self, n: int, k: int, extra: int | None = None, nodes: list[int] | None = None) -> None:
        """n of the k last proposals were kept (and `extra`, a CaPE alternative kept after them): the
        drafter's state follows. `nodes`: the rows of the last verification call that were kept, in
        order (the chain: 0..n; a CaPE tree: its root and accepted path); None: 0..n."""

    def skipped(self, pending: int) -> None:
        """The target took `pending` alone, in a plain step (adaptive speculation's K = 0: no proposals
        this round): the drafter's state follows, as after a round that kept none."""

    def rewind(self, prompt: Sequence[int]) -> None:
        """Back to the state `start(prompt)` left."""


@dataclass
class Round:
    """What one round of decoding gives: each row's new tokens, in order, and the processed logits
    each was chosen from (generate/sampling.py process: what --logprobs reports)."""

    tokens: torch.Tensor                  # [rows, m] long (m >= 1)
    processed: torch.Tensor | None        # [rows, m, vocab] fp32; None when no logprobs were asked for
    kept: list[int] | None = None         # per row, proposals kept this round (speculation; None: plain)
    proposed: list[int] | None = None     # per row, proposals made this round
    followed: bool = False                # the processors' state already follows every token (a block's steps)


@runtime_checkable
class Rounds(Protocol):
    """How the decode loop's rounds choose tokens: plain decoding (one per row), a speculative chain
    or CaPE's tree (the kept proposals and the target's token after them). The loop owns the rest:
    the prefill, the penalties' state (`processors`, after every token of the earlier rounds), EOS,
    stops, limits, logprobs and the results."""

    room: int  # cache slots a round needs past the tokens the rows keep (a verification's new tokens)

    def first(self, cache: Cache, logits: torch.Tensor, prompts: Sequence[Sequence[int]],
              seeds: Sequence[int | None], processors: Processors | None) -> Round:
        """The first token of each row from its prefill's last logits [rows, vocab] fp32 (`cache`
        holds the prompts; `seeds`: each row's request seed, None when greedy: plain decoding draws
        from them, speculation from the generator it was given)."""

    def next(self, cache: Cache, processors: Processors | None) -> Round:
        """The next round's tokens, after every token of the rounds before."""
