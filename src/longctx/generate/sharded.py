"""Generation under a head x ctx layout: the KV cache sharded the way training shards the sequence.

(generate/ sits above parallel/: the layout's attention and collectives come from there.)

A prompt's cache at 1M tokens does not fit one device (Llama-3-8B: 128 KB per token). Sharding it
by heads alone stops at the number of kv heads; our training layout already splits the right way:
the tokens over ctx ranks, the heads over head ranks. Every rank holds the full weights (the cache,
not the model, is what does not fit) and a 1/(head x ctx) share of the cache.

Prefill (`ShardedGeneration.prefill`): the prompt, padded at its end to the layout's multiple
(2 x ctx x head), runs through the model with training's 2D attention (distributed_attention). After
the head all-to-all each rank attends with the keys and values of its head slice at its context
rank's positions: exactly its cache shard, kept as it is (`on_kv`), less the padding, which lies
after every real token, so causal attention never lets a real token see it, and which is never
stored. The last real token's logits come from the rank that holds it (one all-reduce). A prompt longer
than a prefill chunk is a progress phase that counts its tokens layer by layer (rank 0 says it).

Decode (`ShardedKVCache`, the model's `cache=` seam, models/kv_cache.py): every rank runs the new
token's non-attention parts itself (one token: cheap, and no communication); per layer it takes
its heads' query, the owner of the new token's slot appends its key and value (the ctx rank
holding the fewest of the row's slots: every rank knows every share, since the prompt's follow from
the layout, so they agree without a word; the shares stay within one slot of each other, but for a
speculative tree's `keep`, which leaves them apart by up to its path's length until the next calls even
them out), each rank
attends to its own slots (a partial attention with its log-sum-exp), the ctx group merges the
partials in fp32 (the ring's merge), and the head group gathers the heads. Two small all-gathers
per layer, of one token's activations; nothing of the cache moves.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..job import comm
from ..job.checks import check_heads
from ..models.cached_attention import CacheStep, cached_attention, full_attention, masked_attention
from ..models.kv_cache import CacheRows, TreeCalls
from ..ops.attention import merge_partials
from ..parallel.context.attention import distributed_attention
from ..parallel.context.sequence import shard_indices
from ..parallel.context.ulysses import kv_replication
from .prefill_progress import sharded_prefill_phase

READ_ROWS = 1024  # queries per masked_attention call of read_attention


class ShardedKVCache(CacheRows, TreeCalls):
    """This rank's share of the KV cache of `batch` sequences of up to `max_len` tokens: its kv heads,
    its slots. The interface of models/kv_cache.KVCache for the model's decode calls (begin, layer,
    end, lengths); prefill writes it through ShardedGeneration."""

    def __init__(self, model, mesh, batch: int, max_len: int, *, dtype=None, device=None):
        cfg, w = model.cfg, model.tok_embeddings.weight
        self.head_mesh, self.ctx_mesh = comm.sub_mesh(mesh, "head"), comm.sub_mesh(mesh, "ctx")
        self.h, self.c = self.head_mesh.size(), self.ctx_mesh.size()
        self.head_rank, self.ctx_rank = comm.local_rank(self.head_mesh), comm.local_rank(self.ctx_mesh)
        check_heads(cfg.heads, cfg.kv_heads, self.h)
        self.replication = kv_replication(cfg.kv_heads, self.h)
        self.kv_local = cfg.kv_heads * self.replication // self.h
        self.heads_local = cfg.heads // self.h
        # a prompt's share after padding (< (S + 2 h c) / c) plus the new tokens' share (round-robin)
        self.capacity = math.ceil(max_len / self.c) + 2 * self.h + 1
        shape = (cfg.layers, batch, self.kv_local, self.capacity, cfg.resolved_head_dim)
        # zeros: a slot past a row's keys must never hold a NaN (0 x NaN is NaN in the kernel)
        self.k = torch.zeros(shape, dtype=dtype or w.dtype, device=device or w.device)
        self.v = torch.zeros_like(self.k)
        self.lengths = np.zeros(batch, dtype=np.int64)  # tokens of each row over every rank (positions)
        self.shares = np.zeros((batch, self.c), dtype=np.int64)  # slots of each row held by each ctx rank
        # the sequence position of each slot this rank holds (-1: none): what a reader that sees only some
        # positions (a GliDe draft's cross-attention, read_attention) masks by
        self.slot_positions = np.full((batch, self.capacity), -1, dtype=np.int64)
        self.max_len = max_len
        self.step: CacheStep | None = None
        self._owners = self._before = self._local_step = self._last = None

    @property
    def local(self) -> np.ndarray:
        """Slots of each row this rank holds."""
        return self.shares[:, self.ctx_rank]

    def rows(self, start: int, stop: int) -> ShardedKVCache:
        """Rows [start, stop) as a cache of their own, sharing storage and lengths (a prefill group)."""
        view = object.__new__(ShardedKVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths, view.shares = self.lengths[start:stop], self.shares[start:stop]
        view.slot_positions = self.slot_positions[start:stop]
        view.step = view._owners = view._before = view._local_step = view._last = None
        return view

    def layer(self, index: int) -> _ShardedLayer:
        return _ShardedLayer(self, index)

    def begin(self, new: int, device=None) -> CacheStep:
        """A call appending `new` tokens to every row (decode: 1; a speculative verification: K + 1).
        Each new slot goes to the ctx rank holding the fewest of its row's slots, in order."""
        self._check_room(new)
        start, positions = self._step_positions(new, device)
        self.step = CacheStep(start, new, positions, self._take_among(new))
        shares, rows = self.shares.copy(), np.arange(self.batch)
        self._owners = np.empty((self.batch, new), dtype=np.int64)
        for j in range(new):
            self._owners[:, j] = shares.argmin(axis=1)
            shares[rows, self._owners[:, j]] += 1
        self._before = self.local.copy()
        held = self._before + (self._owners == self.ctx_rank).sum(axis=1)
        # this rank's slots as a cache step of its own (one new token: slots 0..held-1 are visible)
        self._local_step = CacheStep(held - 1, 1, None)
        return self.step

    def end(self, ok: bool = True) -> None:
        if ok and self.step is not None:
            self.lengths += self.step.new
            for r in range(self.batch):
                js = np.nonzero(self._owners[r] == self.ctx_rank)[0]
                self.slot_positions[r, self._before[r]:self._before[r] + len(js)] = self.step.start[r] + js
            for j in range(self.step.new):
                self.shares[np.arange(self.batch), self._owners[:, j]] += 1
            self._last = (self.step.start, self._owners, self._before)
        self.step = self._owners = self._before = self._local_step = None

    def truncate(self, length: int) -> None:
        """Forget every row's tokens past `length`, within the last call's (speculative decoding's
        rejected proposals): their owners give the slots back, the latest each holds."""
        if self._last is None or not (self._last[0] <= length).all() or length > int(self.lengths.min()):
            raise ValueError(f"a sharded cache forgets only tokens of its last call (rows at "
                             f"{self.lengths.tolist()}, asked {length})")
        start, owners, _ = self._last
        for r in range(self.batch):
            for j in range(int(length - start[r]), owners.shape[1]):
                self.shares[r, owners[r, j]] -= 1
            self.slot_positions[r, self.local[r]:] = -1
        self.lengths[:] = length
        self._last = None

    def keep(self, nodes: list[int]) -> None:
        """Of the last call's tokens, keep `nodes` (indices in the call; a speculative tree's accepted
        path): each rank keeps those it holds, moved to its slots right after what it held before the
        call, and gives the others back. No keys cross ranks: a row's slots are one set to attend to,
        in any order, so only which rank holds how many matters."""
        if self._last is None or not np.all(self._last[0] == self._last[0][0]):
            raise ValueError("keep() follows a call on rows that held the same number of tokens")
        start, owners, before = self._last
        kept = np.zeros(owners.shape[1], dtype=bool)
        kept[list(nodes)] = True
        path = {int(j): i for i, j in enumerate(nodes)}  # a kept token's place on the path = its position - start
        for r in range(self.batch):
            mine = np.nonzero(owners[r] == self.ctx_rank)[0]  # slot before[r] + m holds call token mine[m]
            src = [(int(before[r]) + m, j) for m, j in enumerate(mine) if kept[j]]
            for dst, (slot, j) in enumerate(src, int(before[r])):
                if dst != slot:
                    self.k[:, r, :, dst] = self.k[:, r, :, slot]
                    self.v[:, r, :, dst] = self.v[:, r, :, slot]
                self.slot_positions[r, dst] = int(start[r]) + path[int(j)]
            self.slot_positions[r, int(before[r]) + len(src):] = -1
            for j in np.nonzero(~kept)[0]:
                self.shares[r, owners[r, j]] -= 1
        self.lengths[:] = int(start[0]) + len(nodes)
        self._last = None

    def reset(self) -> None:
        self.lengths[:] = 0
        self.shares[:] = 0
        self.slot_positions[:] = -1
        self.step = None
        self._among, self._last = None, None  # (a failed call's tree mask or keep() point is not the next prompt's)

    def read_attention(self, layer: int, q: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """Attention [b, n, heads, d] of queries q [b, n, heads, d] (every head, the same on every rank)
        over this cache's layer `layer`, query i of row r seeing the positions < limit[r, i] ([b, n]):
        the cache read by another model (a GliDe draft's cross-attention, models/glide.py). Each rank
        attends its heads over its slots, then the lse merge over ctx and a gather over heads, as in
        decode. A query that sees no position gets 0. Queries go READ_ROWS at a time (a GliDe draft's
        prompt pass reads with every prompt position at once): a mask and fp32 scores of [READ_ROWS,
        slots], never [n, slots], which grew with the square of the prompt."""
        hl, hr = self.heads_local, self.head_rank
        q = q[:, :, hr * hl:(hr + 1) * hl]
        held = int(self.local.max())
        positions = torch.as_tensor(self.slot_positions[:, :held], device=q.device)[:, None, :]
        keys, values = self.k[layer][:, :, :held], self.v[layer][:, :, :held]
        parts = [masked_attention(q[:, s:s + READ_ROWS], keys, values,
                                  (positions >= 0) & (positions < limit[:, s:s + READ_ROWS, None]))
                 for s in range(0, max(q.shape[1], 1), READ_ROWS)]
        out, lse = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts], 1),
                                                     torch.cat([p[1] for p in parts], 2))
        # in the query's dtype, as attend gives it: the partials and their merge are fp32, and a bf16 reader's
        # output projection refused fp32 (a GliDe draft under --nproc on a GPU, bf16 by default)
        return _gather_heads(merge_over_ctx(out, lse, self.ctx_mesh) if self.c > 1 else out, self).to(q.dtype)


class _ShardedLayer:
    def __init__(self, cache: ShardedKVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, 1, heads, d], k/v [b, 1, kv_heads, d] of the new tokens (every head, on every rank)
        -> the attention output [b, 1, heads, d] over the whole sharded cache, on every rank."""
        c = self.cache
        hl, kvl, hr = c.heads_local, c.kv_local, c.head_rank
        q = q[:, :, hr * hl:(hr + 1) * hl]
        if c.replication > 1:  # as the head all-to-all of training does (ulysses.py)
            k, v = k.repeat_interleave(c.replication, dim=2), v.repeat_interleave(c.replication, dim=2)
        k, v = k[:, :, hr * kvl:(hr + 1) * kvl], v[:, :, hr * kvl:(hr + 1) * kvl]
        keys, values = c.k[self.index], c.v[self.index]
        mine = c._owners == c.ctx_rank  # [b, new]: the new slots this rank keeps
        for r, js in ((r, np.nonzero(mine[r])[0]) for r in range(mine.shape[0])):
            if len(js):
                slots = torch.arange(int(c._before[r]), int(c._before[r]) + len(js), device=keys.device)
                keys[r][:, slots] = k[r, js].transpose(0, 1)
                values[r][:, slots] = v[r, js].transpose(0, 1)
        held = c._local_step.start + 1
        if q.shape[1] == 1:
            out, lse = _partial(q, keys, values, c._local_step, held)
        else:  # several new tokens: causal among them (or by the call's tree), wherever their slots went
            out, lse = _partial_masked(q, keys, values, c._before, mine, held, c.step)
        if c.c > 1:
            out = merge_over_ctx(out, lse, c.ctx_mesh)
        return _gather_heads(out, c).to(q.dtype)


def _partial(q, keys, values, step: CacheStep, held: np.ndarray):
    """(out, lse) of q against the slots each row holds here; a row holding none gives out 0, lse -inf."""
    b, n, hl, d = q.shape
    if held.max() == 0:
        return q.new_zeros(b, n, hl, d), torch.full((b, hl, n), -math.inf, device=q.device)
    out, lse = cached_attention(q, keys, values, step)
    if held.min() == 0:
        some = torch.as_tensor(held > 0, device=q.device)
        out = torch.where(some[:, None, None, None], out, torch.zeros_like(out))
        lse = torch.where(some[:, None, None], lse, torch.full_like(lse, -math.inf))
    return out, lse


def _partial_masked(q, keys, values, before: np.ndarray, mine: np.ndarray, held: np.ndarray, step: CacheStep):
    """(out [b, n, hl, d] fp32, lse [b, hl, n] fp32) of n new queries against this rank's slots: the slots
    held before the call (all earlier positions: every query sees them) and this call's slots kept here,
    each seen by the queries at or after its position (a chain), or by the step's tree mask.
    Two parts merged by the log-sum-exp in fp32, as the one-process cache does (cached_attention._chunk):
    the held slots in full, one kernel call per run of rows holding one count (GQA by grouped queries: no copy of the
    keys per query head, no [heads, n, slots] fp32 scores); the call's own few slots (<= n) by a masked
    fp32 softmax."""
    b, n, hl, _ = q.shape
    if int(held.max()) == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), torch.full((b, hl, n), -math.inf, device=q.device)
    out, lse = _new_slots(q, keys, values, before, mine, step)
    if int(before.max()) == 0:
        return out, lse
    pre_out, pre_lse = _held_slots(q, keys, values, before)
    return merge_partials(pre_out, pre_lse, out, lse)


def _held_slots(q, keys, values, before: np.ndarray):
    """(out, lse) of q over each row's slots [0, before[r]): every query sees all of them. Rows holding
    the same count go in one kernel call over contiguous rows; a row holding none gives 0, lse -inf."""
    b, n, hl, d = q.shape
    if np.all(before == before[0]):
        return full_attention(q, keys[:, :, :int(before[0])], values[:, :, :int(before[0])])
    out = q.new_zeros(b, n, hl, d)
    lse = torch.full((b, hl, n), -math.inf, device=q.device)
    r = 0
    while r < b:  # runs of consecutive rows of one count: views of the cache, never a copy of it
        e, count = r + 1, int(before[r])
        while e < b and before[e] == count:
            e += 1
        if count:
            out[r:e], lse[r:e] = full_attention(q[r:e], keys[r:e, :, :count], values[r:e, :, :count])
        r = e
    return out, lse


def _new_slots(q, keys, values, before: np.ndarray, mine: np.ndarray, step: CacheStep):
    """(out fp32, lse) of q over the call's slots this rank keeps (slot before[r] + m holds call token
    mine's m-th), seen causally or by the step's tree mask: gathered into [b, kv, M, d], M <= n. The
    indices and the mask are the same for every layer of the call: built once, kept on the step."""
    b, n, hl, d = q.shape
    if "sharded_new" not in step._masks:
        among = np.tril(np.ones((n, n), dtype=bool)) if step.among is None else step.among.cpu().numpy()
        width = max(int(mine.sum(axis=1).max()), 1)
        index = np.zeros((b, width), dtype=np.int64)
        visible = np.zeros((b, n, width), dtype=bool)
        for r in range(b):
            js = np.nonzero(mine[r])[0]
            index[r, :len(js)] = before[r] + np.arange(len(js))
            visible[r, :, :len(js)] = among[:, js]
        step._masks["sharded_new"] = (torch.as_tensor(index, device=q.device),
                                      torch.as_tensor(visible, device=q.device))
    index, visible = step._masks["sharded_new"]
    at = index[:, None, :, None].expand(b, keys.shape[1], index.shape[1], d)
    return masked_attention(q, keys.gather(2, at), values.gather(2, at), visible)


def _gather_heads(out: torch.Tensor, c: ShardedKVCache) -> torch.Tensor:
    """[b, n, heads of this rank, d] -> [b, n, heads, d] on every rank of the head group."""
    if c.h == 1:
        return out
    b, n, hl, d = out.shape
    out = comm.all_gather(out.contiguous(), c.head_mesh, label="decode_heads")  # [h, b, n, hl, d]
    return out.permute(1, 2, 0, 3, 4).reshape(b, n, c.h * hl, d)


def merge_over_ctx(out: torch.Tensor, lse: torch.Tensor, mesh) -> torch.Tensor:
    """The ctx group's partial attentions over disjoint slots, merged by their log-sum-exp (fp32):
    one all-gather of out and lse packed together."""
    packed = torch.cat([out.float(), lse.transpose(1, 2)[..., None]], dim=-1)  # [b, n, hl, d + 1]
    parts = comm.all_gather(packed.contiguous(), mesh, label="decode_merge")   # [c, b, n, hl, d + 1]
    outs, lses = parts[..., :-1], parts[..., -1]
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    return (outs * torch.exp(lses - safe)[..., None]).sum(0)


class ShardedGeneration:
    """Generation's backend under a head x ctx layout (contracts.Backend, generate/loop.py): a sharded cache,
    and a prefill through training's 2D attention. `mesh`: the 4-D mesh (dims head and ctx);
    `world_mesh`: every rank, flattened (the prompt's last logits reach all of them)."""

    def __init__(self, mesh, world_mesh):
        self.mesh, self.world_mesh = mesh, world_mesh

    def cache(self, model, batch: int, max_len: int, core=None) -> ShardedKVCache:
        if core is not None:
            raise ValueError("a sharded cache has its own attention core")
        return ShardedKVCache(model, self.mesh, batch, max_len)

    def repeat_rows(self, cache: ShardedKVCache, rows: int, times: int) -> None:
        """Rows [0, rows) copied to [s x rows, (s + 1) x rows) for s = 1..times-1 (a prompt's samples
        share its prefill): each rank its own slots, shares and slot positions; nothing moves between ranks."""
        for s in range(1, times):
            dst = slice(s * rows, (s + 1) * rows)
            cache.k[:, dst] = cache.k[:, :rows]
            cache.v[:, dst] = cache.v[:, :rows]
            cache.lengths[dst] = cache.lengths[:rows]
            cache.shares[dst] = cache.shares[:rows]
            cache.slot_positions[dst] = cache.slot_positions[:rows]

    def prefill(self, model, cache: ShardedKVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        """Prompts [rows, S] of one length into empty cache rows; the logits [rows, vocab] (fp32) of
        their last token, on every rank. The whole prompt is one call (`chunk` is the one-device
        backend's: here only a prompt longer than it is a progress phase, its tokens counted layer by layer):
        each rank's share is S / (head x ctx) tokens, and the ring never builds [S, S]."""
        if cache.lengths.max() != 0:
            raise ValueError("a sharded prefill fills empty rows (a prompt is prefilled whole)")
        rows, length = tokens.shape
        if length > cache.max_len:  # (every rank has the prompt: all refuse, before any collective)
            raise ValueError(f"a prompt of {length} tokens does not fit a cache of at most {cache.max_len} tokens "
                             f"per row (allocate it with a larger max_len)")
        h, c = cache.h, cache.c
        unit = 2 * h * c
        padded_len = -(-length // unit) * unit
        padded = F.pad(tokens, (0, padded_len - length))  # after every real token: never attended, never kept
        mine = shard_indices(padded_len, c, h, cache.ctx_rank, cache.head_rank).to(tokens.device)
        # a context rank's positions after the head all-to-all (its head group's shards, in order)
        held = [torch.cat([shard_indices(padded_len, c, h, i, j) for j in range(h)]) for i in range(c)]
        real = (held[cache.ctx_rank] < length).to(tokens.device)
        kept = int(real.sum())

        def keep(index, k, v):
            cache.k[index, :, :, :kept] = k[:, real].transpose(1, 2)
            cache.v[index, :, :, :kept] = v[:, real].transpose(1, 2)

        cores = [block.attention.core for block in model.layers]
        for i, block in enumerate(model.layers):
            block.attention.core = _prefill_core(self.mesh, i, keep)
        try:  # (a long prompt's one call counted layer by layer, rank 0 saying it: generate/prefill_progress.py)
            with sharded_prefill_phase(model, rows, length, chunk, h, c) as counts:
                counts.begin(rows * length)
                hidden = model.hidden_states(padded[:, mine], positions=mine[None].expand(rows, -1))
                counts.end()
        finally:
            for block, core in zip(model.layers, cores):
                block.attention.core = core
        cache.shares[:] = [int((positions < length).sum()) for positions in held]
        cache.slot_positions[:, :kept] = held[cache.ctx_rank][held[cache.ctx_rank] < length].numpy()
        cache.lengths[:] = length
        logits = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=tokens.device)
        last = (mine == length - 1).nonzero()
        if len(last):  # one rank holds the last real token
            logits += model.logits(hidden[:, int(last[0, 0])]).float()
        return comm.all_reduce(logits, self.world_mesh, label="prefill_logits")


def _prefill_core(mesh, index: int, keep):
    def core(q, k, v, doc_ids):
        return distributed_attention(q, k, v, mesh, causal=True, doc_ids=doc_ids,
                                     on_kv=lambda kk, vv: keep(index, kk, vv))
    return core
