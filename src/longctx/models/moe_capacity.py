"""MoE routing decisions that look across tokens, made over every token of the micro-batch.

Two routing rules read more than the token they route (MoEFeedForward.across_tokens):
- a capacity (moe.capacity_factor > 0): each expert keeps at most ceil(capacity_factor x T x k / E)
  of the T x k choices, slot 0's first, then in token order (GShard); the others are dropped
  (`capacity_kept`);
- the Sinkhorn router in training (S-BASE): a balanced assignment over the T x E affinities.
T is the micro-batch's token count as one device would hold it: every data-parallel row and the whole
of each sequence, in that device's order (row-major over [rows, seq_len]), the same tokens the
balancing losses are summed over (models/moe.py router_terms). So no layout moves a drop or an
assignment: not the head x ctx split, not expert parallelism (folded on the same ranks), not data
parallelism, not a memory policy that runs a call in pieces.

The layer reaches the other ranks' tokens through one hook, its `call_tokens` (a `CallTokens`):
None on one device (the call is the micro-batch); parallelize() installs one object for every MoE
layer (parallel/expert/call_tokens.py) that gathers the routing input of every rank holding the
micro-batch in one-device order (`gather`) and hands back this rank's part of a decision (`mine`).
What travels is small: for a capacity, the router's choices (T x k integers) over the ranks of one
data-parallel share's sequences (head x ctx) and a [k, E] count matrix over the shares, so the cost
does not grow with the data-parallel degree; for the Sinkhorn router's assignment, its logits (T x E
fp32) over every rank (its iterations need all of them).

Padding (the layer's `real` mask False: data/loader.py's tokens past a sample's documents) is no token of
the micro-batch: its choices travel as expert E inside the choices gathered (`padded_choices`, no extra
collective), queue for no expert, are never kept and N counts real tokens only; the Sinkhorn router
assigns over the real rows (its mask gathered beside the logits) and marks padding rows not kept.

The one-device order is the loader's: data.dp_balance (data/balance.py) permutes a batch's rows over
the data-parallel ranks, so a run with these rules reads its rows unbalanced (`routes_across_tokens`,
train/stages.py): balanced, the shares' rows came in another order and moved drops (a first step's
loss off by 6e-5 at dp 2 in a test run).

`decide` takes the routing input of a call, all of it or the pieces a memory policy runs it in
(memory/apply_policy.py _PieceRouting), gathers it over the ranks and returns this rank's choices and
kept flags.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..ops.eager import eager_under_compile
from .balanced_assignment import balanced_assignment, sinkhorn


class CallTokens(Protocol):
    """How a MoE layer sees every token of its micro-batch (`MoEFeedForward.call_tokens`).

    `gather(local)`: local [T, ...] holds a value per token of this rank's call (in the layer's flat
    order); returns [N, ...] with every token of the micro-batch, in the order one device holding it
    would flatten it (N = T x ranks). `mine(full)`: [N, ...] in that order -> this rank's [T, ...], in
    its flat order. `gather_share` / `mine_share`: the same over this rank's data-parallel share (its
    rows, whole sequences: the head x ctx ranks) only. `share_counts(counts)`: every share's [k, E]
    counts [S, k, E] in share order, and this share's index. All collective (every rank holding the
    micro-batch calls them, in the same order), no gradient. `routes_alone()`: True where this call's
    tokens are routed by themselves (a decode step with a KV cache: every rank runs the same new
    tokens), so nothing is gathered."""

    def gather(self, local: torch.Tensor) -> torch.Tensor: ...

    def mine(self, full: torch.Tensor) -> torch.Tensor: ...

    def gather_share(self, local: torch.Tensor) -> torch.Tensor: ...

    def mine_share(self, share: torch.Tensor) -> torch.Tensor: ...

    def share_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]: ...

    def routes_alone(self) -> bool: ...


def routes_across_tokens(m) -> bool:
    """MoEFeedForward.across_tokens in training, from a ModelConfig `m`: whether routing a token reads the
    micro-batch's other tokens, in order (a capacity, or the Sinkhorn router)."""
    return m.is_moe and (m.moe_capacity_factor > 0 or m.moe_router == "sinkhorn")


def capacity_kept(experts: torch.Tensor, capacity_factor: float, num_experts: int,
                  shares: tuple[torch.Tensor, int] | None = None, padded: bool = False) -> torch.Tensor:
    """[T, k] each expert keeps at most ceil(capacity_factor x N x k / E) of the choices `experts`
    [T, k], slot 0's first, then in token order (GShard); the others are dropped (their token passes
    through the residual). N = T, or with `shares` (counts [S, k, E]: every data-parallel share's
    choices per slot and expert, in share order; and this share's index) the T tokens are share `me`
    of a micro-batch of N tokens (the shares' slot-0 choices): a choice's place in its expert's queue
    then counts the earlier slots' choices of every share and this slot's of the earlier shares, so
    the kept flags equal the one-device decision over all N tokens without gathering them.

    `padded`: a padding token's choices are the expert id E (`padded_choices`; shares' counts [S, k, E + 1]):
    they queue for no expert, are never kept and N counts the real tokens only, so the real tokens keep
    exactly the choices they keep without the padding (tests/unit/test_moe_padding.py)."""
    t, k = experts.shape
    buckets = num_experts + 1 if padded else num_experts
    key = _slot_keys(experts, buckets)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, torch.arange(k * buckets, device=key.device))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device) - first[sorted_key]  # within (slot, expert)
    if shares is None and not padded:
        counts, me = choice_counts(experts, num_experts)[None], 0
        capacity = math.ceil(capacity_factor * t * k / num_experts)
    else:
        counts, me = (choice_counts(experts, buckets)[None], 0) if shares is None else shares
        n = counts[:, 0, :num_experts].sum().double()  # every real token has one slot-0 choice
        capacity = torch.ceil(capacity_factor * n * k / num_experts)  # (a tensor: no host read)
    totals = counts.sum(0)  # [k, E]
    before = totals.cumsum(0) - totals + counts[:me].sum(0)  # earlier slots of all shares, this slot's earlier shares
    kept = (rank + before.flatten()[key] < capacity).view(k, t).t()
    return kept & (experts < num_experts) if padded else kept


def _assignment(logits: torch.Tensor, iters: int, k: int, real: torch.Tensor | None) -> torch.Tensor:
    """[N, k] the Sinkhorn router's balanced assignment over the N x E `logits`, over the real rows only
    (`real` [N] bool; None: all): a padding row keeps its own top k, which the caller marks not kept.
    (The assignment reads the device anyway: picking the real rows adds no host read of note.)"""
    if real is None:
        return balanced_assignment(sinkhorn(logits, iters), k)
    chosen = logits.topk(k, dim=-1).indices
    rows = real.nonzero().squeeze(1)
    if rows.numel():
        chosen[rows] = balanced_assignment(sinkhorn(logits[rows], iters), k)
    return chosen


def padded_choices(experts: torch.Tensor, real: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] the choices `experts` with every padding token's (`real` [T] False) set to E, which no queue holds."""
    return torch.where(real[:, None], experts, num_experts)


def choice_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[k, E] int64: how many of the choices `experts` [T, k] each slot gives each expert."""
    k = experts.shape[1]
    return torch.bincount(_slot_keys(experts, num_experts), minlength=k * num_experts).view(k, num_experts)


def _slot_keys(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[k x T] slot x E + expert of each choice, slot-major (every token's first choice first)."""
    k = experts.shape[1]
    return (torch.arange(k, device=experts.device)[:, None] * num_experts + experts.t()).flatten()


@torch.no_grad()
@eager_under_compile  # (a compiled `post`: the decision and its collectives run eagerly)
def decide(layer, gathered: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(chosen, kept) of this rank's call from its routing input (MoEFeedForward.routing_input), all of
    it or its pieces in token order: Sinkhorn's assignment or the router's choices, and the capacity's
    kept flags (None without one), both decided over every token of the micro-batch (`layer.call_tokens`).

    The router's choices are gathered over the ranks of this data-parallel share's sequences only
    (`gather_share`); the other shares enter through their [k, E] counts (`share_counts`), which is
    all a capacity needs of them. Sinkhorn's assignment needs every token's logits: gathered over all."""
    x = torch.cat(gathered)  # Sinkhorn's logits [T, E], or the router's choices [T, k]
    real = layer.real_of(x.shape[0])  # padding: out of the capacity's queues and N (None: no padding mask)
    group = layer.call_tokens
    if group is not None and group.routes_alone():
        group = None
    cf, e = layer.capacity_factor, layer.num_experts
    if x.is_floating_point():
        full = x if group is None else group.gather(x)
        real_full = real if real is None or group is None else group.gather(real[:, None].long())[:, 0].bool()
        chosen = _assignment(full, layer.router.iters, layer.top_k, real_full)
        kept = None
        if cf > 0:
            queued = chosen if real_full is None else padded_choices(chosen, real_full, e)
            kept = capacity_kept(queued, cf, e, padded=real_full is not None)
        elif real_full is not None:  # padding is no part of the assignment: not kept, through the residual
            kept = real_full[:, None].expand_as(chosen).contiguous()
        return (chosen, kept) if group is None else (group.mine(chosen), None if kept is None else group.mine(kept))
    if cf <= 0:
        return x, None
    padded = real is not None
    queued = padded_choices(x, real, e) if padded else x  # (the padding mask travels inside the choices)
    if group is None:
        return x, capacity_kept(queued, cf, e, padded=padded)
    share = group.gather_share(queued)
    kept = capacity_kept(share, cf, e, group.share_counts(choice_counts(share, e + padded)), padded=padded)
    return x, group.mine_share(kept)
