"""InfLLM's context memory sharded over the ctx ranks of a layout (`--context-memory infllm --nproc N
--parallel.ctx N`): each rank holds the memory units of its tokens, and only the chosen ones are read.

The one-process memory (models/context_memory.py) attends each call to the initial tokens, the top-k
memory units and the local span. Here the cache's slots are placed by unit: position p < init lies on
rank 0, position p >= init on rank ((p - init) // block) mod ctx, so every unit is whole on one rank
(the span's slots, units not yet formed, follow the same rule). Each rank keeps its positions in order
in its own cache, and per call and layer:

1. writes the new tokens' keys and values it owns;
2. builds the representatives of the units that formed and are its own (models/context_memory.py
   representatives: they read only the unit's keys and the call's queries, which every rank has);
3. scores its own units; one all-reduce (max) of [batch, units] scores gives every rank every score,
   so every rank takes the same top-k (the one-process choice: the same formula, per unit);
4. attends its share of the initial tokens and of the chosen units (where --infllm-positions puts them:
   every rank knows the whole chosen list, so a unit's place is the same on every rank) and of
   the local span (real positions, causal by position): a partial (out, lse);
5. the ctx group merges the partials by their log-sum-exp in fp32 (generate/sharded.py's merge).

What one process computes as two attentions merged by their log-sum-exp is here 2 x ctx partials
merged the same way: the same keys, weights and values, summed in another order. Every rank runs the
model's other parts for every token (the cache, not the model, is what is sharded), so every rank has
the same logits and writes the same tokens. Per call a rank reads its slots of init + topk x block +
window + block keys and scans its own units' representatives: the memory per rank is 1 / ctx of it.
The prompt is prefilled in chunks (window / 2), as on one process. Heads are not sharded (head = 1),
speculation is refused (as on one process).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..job import comm
from ..models.cached_attention import CacheStep, full_attention
from ..models.context_memory import (
    GrowsOnly,
    InfLLMShape,
    check_after_units,
    place_far,
    refuse_ms_poe,
    representatives,
    rotate,
    top_units,
    unit_scores,
)
from ..models.kv_cache import CacheRows
from ..ops.attention import merge_partials
from .sharded import _held_slots, _new_slots, merge_over_ctx


def owners(positions: np.ndarray, shape: InfLLMShape, ctx: int) -> np.ndarray:
    """The ctx rank holding each position: rank 0 the initial tokens, then unit u's on rank u mod ctx."""
    unit = (positions - shape.init) // shape.block
    return np.where(positions < shape.init, 0, unit % ctx)


class ShardedInfLLMCache(GrowsOnly, CacheRows):
    """This rank's slots of `batch` rows of up to `max_len` tokens, placed by unit (module docstring),
    and its units' representatives; the contracts.Cache interface the model's calls use (no
    speculation: truncate, among and keep refuse)."""

    def __init__(self, shape: InfLLMShape, model, ctx_mesh, batch: int, max_len: int):
        refuse_ms_poe(model)
        cfg, w = model.cfg, model.tok_embeddings.weight
        self.shape, self.inv_freq, self.mesh = shape, model.inv_freq, ctx_mesh
        self.c, self.rank = ctx_mesh.size(), comm.local_rank(ctx_mesh)
        self.max_len = max_len
        everything = np.arange(max_len)
        self.positions = everything[owners(everything, shape, self.c) == self.rank]  # of each local slot, ascending
        units = max(0, (max_len - shape.init) // shape.block) + 1
        kv, d = cfg.kv_heads, cfg.resolved_head_dim
        self.k = torch.zeros(cfg.layers, batch, kv, len(self.positions), d, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)
        self.reps = torch.zeros(cfg.layers, batch, units, kv, d, device=w.device)  # this rank's units' only
        self.built = np.zeros(cfg.layers, dtype=np.int64)  # units formed so far (every rank's count)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.step: CacheStep | None = None
        # the most keys one call's attention read on this rank, in a box that rows() views share: prefill's
        # calls go through views, and their reads count too
        self._keys_read = [0]

    @property
    def keys_read(self) -> int:
        return self._keys_read[0]

    @keys_read.setter
    def keys_read(self, value: int) -> None:
        self._keys_read[0] = value

    def slots(self, lo: int, hi: int) -> slice:
        """The local slots holding positions [lo, hi) that this rank owns (ascending: one run)."""
        return slice(int(np.searchsorted(self.positions, lo)), int(np.searchsorted(self.positions, hi)))

    def rows(self, start: int, stop: int) -> ShardedInfLLMCache:
        if start != 0:
            raise ValueError("InfLLM's memory holds one prompt at a time (its rows from 0)")
        view = object.__new__(ShardedInfLLMCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v, view.reps, view.lengths = self.k[:, :stop], self.v[:, :stop], self.reps[:, :stop], \
            self.lengths[:stop]
        return view

    def layer(self, index: int) -> _Layer:
        return _Layer(self, index)

    def begin(self, new: int, device=None) -> CacheStep:
        self._check_room(new)
        if not np.all(self.lengths == self.lengths[0]):
            raise ValueError("InfLLM context memory attends for rows that hold the same number of tokens")
        start, positions = self._step_positions(new, device)
        self.step = CacheStep(start, new, positions)
        return self.step

    def end(self, ok: bool = True) -> None:
        if ok and self.step is not None:
            self.lengths += self.step.new
        self.step = None

    def reset(self) -> None:
        self.lengths[:] = 0
        self.built[:] = 0
        self.step = None


class _Layer:
    def __init__(self, cache: ShardedInfLLMCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The module docstring's steps 1-5 for q [b, n, heads, d], k/v [b, n, kv_heads, d] of the new tokens."""
        c, i = self.cache, self.index
        shape, s, n = c.shape, int(c.step.start[0]), c.step.new
        end = s + n
        mine = c.slots(s, end)
        owned = torch.as_tensor(c.positions[mine] - s, device=k.device)  # the new tokens this rank holds
        c.k[i, :, :, mine] = k[:, owned].transpose(1, 2)
        c.v[i, :, :, mine] = v[:, owned].transpose(1, 2)
        init = min(shape.init, end)
        units = max(0, (end - shape.window - init) // shape.block)
        query_pos = c.step.positions  # [b, n]
        lo = init + units * shape.block if units else 0  # the span attended at real distances: [lo, end)
        check_after_units(s, n, lo, shape)
        out, lse = self._span(q, lo, end)
        if units:
            self._build(q, units)
            far_out, far_lse = self._far(q, query_pos, units, init)
            out, lse = merge_partials(out, lse, far_out, far_lse)
        if c.c > 1:
            out = merge_over_ctx(out, lse, c.mesh)
        return out.to(q.dtype)

    def _span(self, q, lo: int, end: int):
        """(out, lse) over this rank's slots of positions [lo, end), each query seeing those at or before it.
        The slots of positions before the call's start every query sees: one kernel call, queries grouped
        per kv head (no copy of the keys per query head, no fp32 scores over them outside the kernel); a
        decode token sees every slot, so that is all. Of a call of n > 1 tokens (a prefill chunk), its own
        slots kept here (<= n) are seen causally by a masked softmax (sharded.py's _new_slots: indices and
        mask built once per call, kept on the step), merged by the log-sum-exp in fp32."""
        c, b, n = self.cache, q.shape[0], q.shape[1]
        held, new = c.slots(lo, end), c.slots(end - n, end)
        keys, values = c.k[self.index][:, :, held], c.v[self.index][:, :, held]
        if keys.shape[2] == 0:
            return _empty(q)
        c.keys_read = max(c.keys_read, keys.shape[2])
        if n == 1:  # every held slot is at or before the one query
            return full_attention(q, keys, values)
        before = new.start - held.start  # slots of positions [lo, start): every query sees them
        out = lse = None
        if new.stop > new.start:
            mine = np.broadcast_to(owners(np.arange(end - n, end), c.shape, c.c) == c.rank, (b, n))
            out, lse = _new_slots(q, keys, values, np.full(b, before), mine, c.step)
        if before == 0:
            return out, lse
        pre_out, pre_lse = full_attention(q, keys[:, :, :before], values[:, :, :before])
        return (pre_out, pre_lse) if out is None else merge_partials(pre_out, pre_lse, out, lse)

    def _build(self, q, units: int) -> None:
        """Representatives of the units formed since the last call that this rank holds."""
        c, shape = self.cache, self.cache.shape
        first = int(c.built[self.index])
        if units <= first:
            return
        for u in range(first + (c.rank - first) % c.c, units, c.c):  # this rank's units: u mod ctx == rank
            lo = shape.init + u * shape.block
            held = c.slots(lo, lo + shape.block)
            positions = torch.as_tensor(c.positions[held], device=q.device)
            c.reps[self.index, :, u:u + 1] = representatives(c.k[self.index][:, :, held], positions, q, shape,
                                                             c.inv_freq)
        c.built[self.index] = units

    def _far(self, q, query_pos, units: int, init: int):
        """(out, lse) over this rank's initial tokens and chosen units, seen where the placement puts them
        (shape.positions: at the one distance `far`, or laid end to end in order: place_far)."""
        c, shape = self.cache, self.cache.shape
        b = q.shape[0]
        q_far = rotate(q, shape.far - query_pos, c.inv_freq)
        mine = np.arange(c.rank, units, c.c)  # this rank's units (owners(): unit u on rank u mod ctx)
        scores = torch.full((b, units), -math.inf, device=q.device)
        if len(mine):
            index = torch.as_tensor(mine, device=q.device)
            scores[:, index] = unit_scores(q_far, c.reps[self.index][:, index])
        if c.c > 1:  # every unit's score on every rank: the same top-k everywhere
            scores = comm.all_reduce(scores, c.mesh, op=torch.distributed.ReduceOp.MAX, label="infllm_scores")
        chosen = top_units(scores, shape.topk)  # [b, k]
        # this rank's slots among the initial tokens and the chosen units (rows choose alike or not)
        slots = []
        for r in range(b):
            picked = [c.slots(0, init)] + [c.slots(shape.init + int(u) * shape.block, shape.init + (int(u) + 1)
                                                   * shape.block) for u in chosen[r].tolist()]
            slots.append(np.concatenate([np.arange(p.start, p.stop) for p in picked]))
        count = max(len(x) for x in slots)
        if count == 0:
            return _empty(q)
        # rows (a prompt's samples) may hold different numbers of their chosen slots here: each row's first,
        # padded with slot 0 after them; rows holding one count attend in one kernel call, unmasked
        counts = np.array([len(x) for x in slots])
        padded = np.zeros((b, count), dtype=np.int64)
        for r, x in enumerate(slots):
            padded[r, :len(x)] = x
        index = torch.as_tensor(padded, device=q.device)  # [b, G]
        gather = index[:, None, :, None].expand(b, c.k.shape[2], count, c.k.shape[4])
        far_k = c.k[self.index].gather(2, gather)
        far_v = c.v[self.index].gather(2, gather)
        positions = torch.as_tensor(c.positions[padded], device=q.device)  # [b, G]
        lo = init + units * shape.block
        q_far, far_k = place_far(q, q_far, far_k, positions, chosen, query_pos, lo, shape, c.inv_freq)
        c.keys_read = max(c.keys_read, count)
        return _held_slots(q_far, far_k, far_v, counts)


def _empty(q: torch.Tensor):
    """The partial of a rank holding no key for the call: out 0, lse -inf."""
    b, n, h, _ = q.shape
    return q.new_zeros(q.shape, dtype=torch.float32), torch.full((b, h, n), -math.inf, device=q.device)


class ShardedInfLLMGeneration:
    """The backend (contracts.Backend) of InfLLM's memory over the ctx ranks of `mesh` (head 1): every
    rank prefills the prompt in chunks and decodes the same tokens; each holds its units."""

    def __init__(self, shape: InfLLMShape, mesh):
        self.shape, self.mesh = shape.checked(), mesh
        self.memory: ShardedInfLLMCache | None = None

    def cache(self, model, batch: int, max_len: int, core=None) -> ShardedInfLLMCache:
        if core is not None:
            raise ValueError("InfLLM's sharded cache attends through its own core; pass no cache_core")
        if comm.sub_mesh(self.mesh, "head").size() > 1:
            raise ValueError("InfLLM's memory is sharded over ctx ranks only (parallel.head = 1)")
        self.memory = ShardedInfLLMCache(self.shape, model, comm.sub_mesh(self.mesh, "ctx"), batch, max_len)
        return self.memory

    def prefill(self, model, cache: ShardedInfLLMCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        from .local import prefill

        return prefill(model, cache, tokens, self.chunk(chunk))

    def chunk(self, chunk: int) -> int:
        """As on one process (generate/context_memory.py InfLLMGeneration.chunk)."""
        return max(1, min(chunk if chunk > 0 else self.shape.window, self.shape.window // 2))

    def repeat_rows(self, cache: ShardedInfLLMCache, rows: int, times: int) -> None:
        for s in range(1, times):
            dst = slice(s * rows, (s + 1) * rows)
            cache.k[:, dst] = cache.k[:, :rows]
            cache.v[:, dst] = cache.v[:, :rows]
            cache.reps[:, dst] = cache.reps[:, :rows]
            cache.lengths[dst] = cache.lengths[:rows]
