"""InfLLM context memory (Xiao et al. 2024): a KV cache core that attends to a bounded set of keys.

Training-free. A query at slot i of a row holding e tokens (e - 1 = the chunk's last slot) attends to
- the first `init` tokens (attention sinks),
- the local span: every slot from the end of the last memory unit to the query itself (between
  `window` and `window + block - 1` tokens: a unit leaves the span only when it is whole),
- the `topk` memory units that score highest for the call's queries. The slots between the initial
  tokens and the local span are cut into units of `block` tokens; unit u holds slots
  [init + u * block, init + (u + 1) * block) and exists once e - window - init >= (u + 1) * block.
A call's units are chosen once for all its queries (a prefill chunk, or a decode token): score(u) =
the mean over the call's queries of the sum over every head of q . rep(u), where rep(u) per kv head is
the sum of `repr` of its keys. Which keys represent a unit (the paper's rule, made deterministic and
cheap): the unit forms during a call whose queries are the local window's newest; per kv head, its
`repr` keys that those queries score highest (attention logits at the real distances, summed over the
call's queries and the kv head's query heads), chosen once. (A first choice, the keys nearest the
unit's mean key, picked its most typical tokens: every unit of a repetitive text then looks alike,
and a passkey at 8K tokens of SmolLM2-135M was not retrieved; with this rule it is.)

Positions. The cache holds keys rotated (RoPE) at their real slot; the local span keeps those real
relative distances (< window + block). Once any unit exists, the initial tokens and the retrieved
units are seen where `shape.positions` puts them (place_far):
- shared (the paper's): all at the ONE distance `far` = init + window + block - 1: their keys are
  rotated back to position 0 (the inverse rotation of their slot) and the queries rotated on to
  position `far`, so q . k sees exactly the distance `far` (RoPE depends on the difference only);
- ordered: laid end to end in slot order right before the local span: the initial tokens at their
  slots, the j-th chosen unit's tokens at init + j x block + their offset in it, and a query at slot p
  of the local span [lo, ...) at init + k x block + p - lo. Order and spacing inside the retrieved text
  are kept, the gaps between its pieces closed. (SmolLM2-135M: one shared distance loses the pass key even
  with every unit retrieved, docs/benchmarks.md.) With every unit retrieved it is plain attention.
Every distance a query sees is below shape.positions_needed (shared: init + window + block; ordered: init + topk x
block + window + block - 1): within the trained window whatever the prompt's length
(generate/context_memory.py checks it against the model's reach).
Before any unit exists (e < init + window + block) the call is the plain cached attention, the same
kernels and numbers as without the memory. The two parts (local, and init + units) are merged by
their log-sum-exp in fp32.

Cost per call and layer: keys read <= init + topk x block (gathered) + window + block - 1 (local),
plus the scan of the representatives: (e / block) units x kv_heads x head_dim multiply-adds; building
a unit's representatives reads its block keys once. Nothing grows with the prompt but that scan.

Limits (said by the caller as errors; a library call meets them in InfLLMCache and the core): rows that
hold the same number of tokens (one prompt, or its samples), no speculative tree or chain, calls of at
most `window` tokens, one plain RoPE table (not Ms-PoE's per-head tables), one
device (generate/sharded_infllm.py shards the memory over ctx ranks with `representatives` and
`unit_scores` below).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.attention import attention_forward, merge_partials
from .cached_attention import CacheStep, cached_attention, group_queries, ungroup_heads
from .kv_cache import KVCache
from .llama import apply_rope, rope_cos_sin

# where a call sees the initial tokens and its retrieved units (the local span is always at real distances):
# shared: all at the one distance `far` (the paper's); ordered: laid end to end in slot order right before
# the local span, each unit's tokens at their own spacing (the module docstring's "Positions")
POSITIONS = ("shared", "ordered")


@dataclass(frozen=True)
class InfLLMShape:
    """InfLLM's sizes, in tokens (block, init, window) or counts (repr per unit, topk units); the
    defaults are generate/context_memory.py's flags'."""

    block: int
    repr: int
    topk: int
    window: int
    init: int
    # where the initial tokens and retrieved units are seen (POSITIONS): a library shape left unsaid keeps the
    # paper's; the command's default is ordered (generate/context_memory.py DEFAULTS, chosen by measurement)
    positions: str = "shared"

    @property
    def far(self) -> int:
        """The one distance at which `shared` shows the initial tokens and retrieved units once memory exists
        (the queries are also turned on to it to score the units, under either placement)."""
        return self.init + self.window + self.block - 1

    @property
    def positions_needed(self) -> int:
        """The largest distance a query sees + 1: the positions the model must have been trained on.
        shared: far + 1; ordered: the initial tokens, topk units and the local span (at most window + block - 1
        tokens, the query last) laid end to end, every key one query reads (max_keys) at its own position."""
        if self.positions == "ordered":
            return self.max_keys
        return self.far + 1

    @property
    def max_keys(self) -> int:
        """The most keys one query reads: init + topk units + the local span."""
        return self.init + self.topk * self.block + self.window + self.block - 1

    def problems(self) -> list[str]:
        out = []
        for name in ("block", "repr", "topk", "window"):
            if getattr(self, name) < 1:
                out.append(f"--infllm-{name} must be >= 1, got {getattr(self, name)}")
        if self.init < 0:
            out.append(f"--infllm-init must be >= 0, got {self.init}")
        if self.block >= 1 and self.repr > self.block:
            out.append(f"--infllm-repr {self.repr} is more than the {self.block} tokens of a unit (--infllm-block)")
        if self.positions not in POSITIONS:
            out.append(f"--infllm-positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.block >= 1 and self.window >= 1 and self.window % self.block:
            out.append(f"--infllm-block {self.block} does not divide --infllm-window {self.window}: the window "
                       f"moves into memory one whole unit at a time (e.g. --infllm-window "
                       f"{max(1, self.window // self.block) * self.block})")
        return out

    def checked(self) -> InfLLMShape:
        """This shape if the command would take it, else a ValueError naming every problem: the backends' own
        check, for library callers (a `repr` of 0 made every unit score 0, so top-k took units by index
        whatever the query; a `topk` of 0 retrieved nothing; both ran without a word)."""
        problems = self.problems()
        if problems:
            raise ValueError("InfLLM context memory: " + "; ".join(problems))
        return self


def refuse_ms_poe(model) -> None:
    """A ValueError for a model with Ms-PoE (models/ms_poe.py): its kv heads' keys are cached at p / r, and
    turning them back (and the queries on to `far`) with the one plain table left a far key of distance D at
    far - D (1 - 1 / r), keys thousands of positions in the query's future, silently (the memory of one
    process and the sharded one call this; the command refuses the pair before loading, memory_shape)."""
    if getattr(model, "ms_poe_ratios", None) is not None:
        raise ValueError("InfLLM context memory re-rotates keys with one RoPE table, not Ms-PoE's per-head ones: "
                         "build the model without model.rope_ms_poe to use the memory")


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, d] turned by RoPE's angle at `positions` [b or 1, s] (negative: turned back),
    unscaled (YaRN's factor is already in the cached keys and the queries)."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope(x, cos, sin)


def grouped_attention(q, k, v):
    """(out [b, n, h, d], lse [b, h, n] fp32): every query over every key k/v [b, kv, G, d] (GQA grouped)."""
    b, n, h, d = q.shape
    kv = k.shape[1]
    out, lse = attention_forward(group_queries(q, kv).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 causal=False)
    lse = lse.view(b, kv, n, h // kv).transpose(2, 3).reshape(b, h, n)
    return ungroup_heads(out.transpose(1, 2), n, h), lse


class InfLLMMemory:
    """The memory units' representatives of every layer, and `core`, the KVCache core that uses them.

    `reps` [layers, batch, units, kv_heads, head_dim] fp32: each unit's representative keys (turned back
    to position 0) summed; `built[layer]`: the units built so far (rows hold the same length).
    `keys_read`: the most keys one call's attention read (local + gathered), for the caller's checks.
    `keys`: its InfLLMCache's keys (InfLLMCache.for_memory): the memory's rows are that cache's rows 0.., so
    a view of later rows (a second group of prompts, generate/loop.py) is refused, not scored against the
    first's units."""

    def __init__(self, shape: InfLLMShape, model, batch: int, max_len: int):
        refuse_ms_poe(model)
        cfg, w = model.cfg, model.tok_embeddings.weight
        self.shape, self.inv_freq = shape, model.inv_freq
        units = max_len // shape.block + 1
        self.reps = torch.zeros(cfg.layers, batch, units, cfg.kv_heads, cfg.resolved_head_dim, device=w.device)
        self.built = np.zeros(cfg.layers, dtype=np.int64)
        self.keys_read = 0
        self.keys: torch.Tensor | None = None

    def copy_rows(self, rows: int, times: int) -> None:
        """Rows [0, rows) copied to the next (times - 1) groups (a prompt's samples share its prefill)."""
        for s in range(1, times):
            self.reps[:, s * rows:(s + 1) * rows] = self.reps[:, :rows]

    def core(self, q, k, v, layer, step: CacheStep) -> torch.Tensor:
        """The cache core (models/kv_cache.py): append, then attend as the module docstring says."""
        if step.among is not None or not step.uniform:
            raise ValueError("InfLLM context memory attends for rows that hold the same number of tokens, "
                             "without a speculative tree")
        if self.keys is not None and layer.cache.k.data_ptr() != self.keys.data_ptr():
            raise ValueError("InfLLM context memory holds one prompt length at a time (its cache's rows from 0): "
                             "generate prompts of different lengths in separate calls")
        layer.append(k, v, step)
        shape, s, n = self.shape, int(step.start[0]), step.new
        end = s + n
        init = min(shape.init, end)
        units = max(0, (end - shape.window - init) // shape.block)
        if units == 0:  # nothing in memory yet: plain attention, real positions
            self.keys_read = max(self.keys_read, end)
            return cached_attention(q, layer.k, layer.v, step)[0]
        check_after_units(s, n, init + units * shape.block, shape)
        b = q.shape[0]
        self._build(layer.index, layer.k, q, units)
        q_far = rotate(q, shape.far - step.positions, self.inv_freq)  # each query turned on to distance `far`
        chosen = self._select(layer.index, q_far, units)
        slots = self._slots(chosen, b, init)  # [b, G]
        lo = init + units * shape.block  # the local span: [lo, end), real positions
        far_k, far_v = _gather(layer.k, slots), _gather(layer.v, slots)
        q_far, far_k = place_far(q, q_far, far_k, slots, chosen, step.positions, lo, shape, self.inv_freq)
        far_out, far_lse = grouped_attention(q_far, far_k, far_v)
        local = CacheStep(step.start - lo, n, step.positions - lo)
        out, lse = cached_attention(q, layer.k[:, :, lo:], layer.v[:, :, lo:], local)
        self.keys_read = max(self.keys_read, slots.shape[1] + end - lo)
        return merge_partials(out, lse, far_out, far_lse)[0].to(q.dtype)

    def _build(self, index: int, keys: torch.Tensor, q: torch.Tensor, units: int) -> None:
        """Representatives of units [built, units) of layer `index` from its cached keys [b, kv, L, d],
        scored by the running call's queries q [b, n, h, d] (both rotated at their real slots)."""
        first = int(self.built[index])
        if units <= first:
            return
        block, init = self.shape.block, self.shape.init
        lo, hi = init + first * block, init + units * block
        slots = torch.arange(lo, hi, device=keys.device)
        self.reps[index, :q.shape[0], first:units] = representatives(keys[:, :, lo:hi], slots, q, self.shape,
                                                                    self.inv_freq)
        self.built[index] = units

    def _select(self, index: int, q_far: torch.Tensor, units: int) -> torch.Tensor:
        """[b, k] the chosen units (ascending) of each row: the highest sum over heads of q . rep,
        averaged over the call's queries (q at distance `far`, as the units' keys will be seen)."""
        return top_units(unit_scores(q_far, self.reps[index, :q_far.shape[0], :units]), self.shape.topk)

    def _slots(self, chosen: torch.Tensor, b: int, init: int) -> torch.Tensor:
        """[b, init + k x block] the slots of the initial tokens and of the chosen units."""
        block, device = self.shape.block, chosen.device
        unit_slots = (init + chosen[..., None] * block + torch.arange(block, device=device)).flatten(1)
        return torch.cat([torch.arange(init, device=device).expand(b, init), unit_slots], dim=1)


class GrowsOnly:
    """What a cache attending through InfLLM's memory refuses: truncating (speculation's rejected proposals)
    or verifying a tree would leave units built by, or chosen for, tokens it no longer holds, and one
    selection for several proposals is not decoding's one per token (InfLLMCache, and the sharded one of
    generate/sharded_infllm.py)."""

    def truncate(self, length: int) -> None:
        raise ValueError("InfLLM context memory does not verify speculative proposals (nothing to truncate)")

    def among(self, visible: torch.Tensor) -> None:
        raise ValueError("InfLLM context memory does not verify a speculative tree")

    def keep(self, nodes: list[int]) -> None:
        raise ValueError("InfLLM context memory does not verify a speculative tree")


class InfLLMCache(GrowsOnly, KVCache):
    """A KVCache attending through `memory` (InfLLMMemory.core); it only grows (GrowsOnly). reset() empties
    the memory too."""

    memory: InfLLMMemory

    @classmethod
    def for_memory(cls, memory: InfLLMMemory, model, batch: int, max_len: int) -> InfLLMCache:
        cache = cls.for_model(model, batch, max_len, core=memory.core)
        cache.memory, memory.keys = memory, cache.k
        return cache

    def reset(self) -> None:
        super().reset()
        self.memory.built[:] = 0


def representatives(keys: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, shape: InfLLMShape,
                    inv_freq: torch.Tensor) -> torch.Tensor:
    """[b, m, kv, d] fp32: the summed representative keys of m whole units whose keys [b, kv, m x block,
    d] (rotated at `positions` [m x block], their real slots) lie unit after unit, scored by the
    running call's queries q [b, n, h, d] (the module docstring's rule). A unit's figure reads only its
    own keys: a memory sharded by units (generate/sharded_infllm.py) builds each on its rank."""
    b, n, h, d = q.shape
    kv, m = keys.shape[1], keys.shape[2] // shape.block
    # the logits each key receives, summed over the call's queries and the kv head's query heads (linear:
    # one dot product with the summed query); real distances, as the queries see them now
    summed = q.float().view(b, n, kv, h // kv, d).sum((1, 3))  # [b, kv, d]
    received = torch.einsum("bkld,bkd->blk", keys.float(), summed)  # [b, m * block, kv]
    raw = rotate(keys.transpose(1, 2).float(), -positions[None], inv_freq)  # [b, m * block, kv, d]
    per_unit = raw.view(b, m, shape.block, kv, d)
    top = received.view(b, m, shape.block, kv).topk(shape.repr, dim=2).indices  # [b, m, repr, kv]
    return per_unit.gather(2, top[..., None].expand(-1, -1, -1, -1, d)).sum(2)


def place_far(q: torch.Tensor, q_far: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor,
              query_positions: torch.Tensor, lo: int, shape: InfLLMShape,
              inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, keys) of the far part, turned so that q . k sees the placement's distance. keys [b, kv, G, d]
    cached at their real `slots` [b, G] (initial tokens' and retrieved units', all or one rank's share);
    `chosen` [b, k]: the call's units, ascending (every rank's); q at its real `query_positions` [b, n], q_far
    the same queries turned on to `far`; `lo`: the local span's first slot (memory exists: init is whole).
    shared: keys back to position 0, queries at `far`. ordered: the initial tokens keep their slots, the
    j-th chosen unit's tokens sit at init + j x block + their offset in the unit, and the local span goes
    on from there: a query at slot p sits at init + k x block + p - lo."""
    if shape.positions == "shared":
        return q_far, rotate(keys.transpose(1, 2), -slots, inv_freq).transpose(1, 2)
    init, block = shape.init, shape.block
    unit = torch.div(slots - init, block, rounding_mode="floor")
    place = torch.searchsorted(chosen.contiguous(), unit.contiguous())  # the unit's index among the chosen
    ordered = torch.where(slots < init, slots, init + place * block + (slots - init) % block)
    keys = rotate(keys.transpose(1, 2), ordered - slots, inv_freq).transpose(1, 2)
    seen = init + chosen.shape[1] * block
    return rotate(q, torch.full_like(query_positions, seen - lo), inv_freq), keys


def unit_scores(q_far: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """[b, u]: each unit's score for the call, the sum over heads of q . rep averaged over the call's
    queries q_far [b, n, h, d] (turned to distance `far`); reps [b, u, kv, d]."""
    b, n, h, d = q_far.shape
    kv = reps.shape[2]
    query = q_far.float().view(b, n, kv, h // kv, d).sum(3).mean(1)  # [b, kv, d]
    return torch.einsum("bkd,bukd->bu", query, reps)


SCORE_GRID = 2.0 ** -12  # (x a row's largest |score|: ~1,000 x fp32 rounding; a tie straddles a step ~0.1% of times)


def top_units(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[b, k] the `topk` highest-scoring units of each row (ascending), scores [b, u] (-inf: not a candidate).
    Scores within a rounding of each other are ties, and a tie goes to the earlier unit: a repeating text
    gives units whose representatives are alike, so their scores tie in exact arithmetic and fp32 orders
    them by noise, which differs with the batch's shape (a prompt's --num-samples rows) and over ctx ranks
    (each scores its own units); a flipped choice changed the tokens. Snapped to a grid of SCORE_GRID x
    the row's largest |score|, they order alike wherever they are computed."""
    finite = scores.isfinite()
    scale = scores.abs().where(finite, 0).amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    step = scale * SCORE_GRID
    snapped = torch.where(finite, torch.round(scores / step) * step, scores)
    order = torch.sort(snapped, dim=-1, descending=True, stable=True).indices
    return order[:, :min(topk, scores.shape[-1])].sort(dim=-1).values


def check_after_units(start: int, new: int, lo: int, shape: InfLLMShape) -> None:
    """A call's queries (slots start..start + new - 1) all at or after `lo`, the end of the units in memory:
    an earlier query would see units after it (at distance `far`) and no local span. A call of at most
    `window` tokens always is (lo <= end - window); the backends prefill in chunks of window / 2."""
    if start < lo:
        raise ValueError(f"InfLLM context memory: a call of {new} new tokens after {start} held has queries before "
                         f"the end of its memory units (slot {lo}); feed at most --infllm-window {shape.window} "
                         f"tokens per call (the InfLLM backends' prefill() chunks the prompt so)")


def _gather(cached: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cached [b, kv, L, d] at each row's slots [b, G] -> [b, kv, G, d]."""
    b, kv, _, d = cached.shape
    return cached.gather(2, slots[:, None, :, None].expand(b, kv, slots.shape[1], d))
