"""How a MoE layer's routed rows reach their experts and come back: the dispatcher contract.

`MoEFeedForward.dispatcher` (models/moe.py) is a `TokenDispatcher`: `dispatch` (token rows ->
rows grouped by expert), `run_experts` (the experts on them, called from inside the Experts
module's call) and `combine` (results -> each token's weighted sum). The class here is the one
device's; expert parallelism installs another object with the same three methods
(parallel/expert/install.py), so models never import parallel/ and no module method is ever replaced.

Determinism: no step of the one-device dispatch adds into memory in an order the hardware picks,
so two runs give the same bits on CPU and on CUDA. The dispatch copies each token's row to its k
slots (`TokenRows`), whose backward gathers the k gradient rows back into slot order by the
inverse permutation and sums them in slot order (index_select's own backward, index_add_, uses
atomics on CUDA, in no fixed order when k >= 3); the combine gathers each token's k results back
by the inverse permutation and sums them in slot order (its backward copies each gradient row back to
its expert-sorted place: a permutation). Not so under expert parallelism with parallel.expert_ranks_per_node
(parallel/expert/hierarchy.py adds rows with index_add: repeated indices, atomics on CUDA) or
parallel.expert_replicas (parallel/expert/placement.py: a copied expert's weights gathered by
index_select, whose backward adds the copies' gradients with index_add_); the flat exchange
(parallel/expert/dispatch.py) only permutes rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    """A router's choice for T tokens (models/moe.py's routers make it; the dispatcher reads it)."""
    experts: torch.Tensor       # [T, k] long: the chosen experts, slot 0 first
    weights: torch.Tensor       # [T, k] fp32: each choice's weight on the output (0 where dropped)
    probs: torch.Tensor         # [T, E] fp32: the distribution the balancing loss reads
    logits: torch.Tensor        # [T, E] fp32: what the z-loss reads
    kept: torch.Tensor | None = None  # [T, k] bool with a capacity: False where the choice was dropped


def expert_counts(choice: torch.Tensor, experts: int) -> torch.Tensor:
    """[experts] how many of `choice` (expert ids < experts) name each: bincount with a shape known
    before the data (so torch.compile traces it in one graph; integer adds, exact in any order)."""
    return choice.new_zeros(experts).index_add_(0, choice, torch.ones_like(choice))


class TokenRows(torch.autograd.Function):
    """flat[order // k]: each kept slot's token row, in expert order (`order` [n]: the slots token x k + j
    sorted by expert, the dropped ones cut off the end; `inverse` [T k]: the inverse of the uncut
    permutation). Its backward sums each token's k row gradients without a scatter-add: index_select's
    own backward (index_add_) adds them with atomics on CUDA, in no fixed order when k >= 3. Here the
    gradient rows go back to slot order by the inverse permutation (a gather; dropped slots read a
    zero row) and each token's k slots are summed in slot order: the same bits on every run and device."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return flat.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        dropped = inverse.numel() - grad.shape[0]  # the sorted rows past n are the dropped slots'
        if dropped:
            grad = torch.cat([grad, grad.new_zeros(dropped, grad.shape[1])])
        slots = grad.index_select(0, inverse)
        return slots.view(-1, ctx.k, grad.shape[1]).sum(1), None, None, None


class SlotRows(torch.autograd.Function):
    """out[inverse]: the expert-sorted result rows back in slot order (token x k + j), `inverse` a permutation.
    Its backward is the inverse permutation of the gradient rows, one write of each row: index_select's own
    backward would zero-fill a [T k, dim] gradient and index_add_ the rows into it (a fill, a read of the
    zeros and atomics on CUDA, for the same values)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)  # (TokenRows keeps the same tensor: no more bytes for backward)
        return out.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        # every row of the empty tensor is written once (inverse is a permutation): no fill, no add
        return grad.new_empty(grad.shape).index_copy_(0, inverse, grad), None


def sort_keys(choice: torch.Tensor, experts: int) -> torch.Tensor:
    """The expert ids `choice` (0..experts) in the narrowest integer type that holds them, to sort by: a GPU's
    radix sort makes a pass per 8 bits of the key type whatever the values (8 for int64, 2 for int16); the
    stable order of equal values is the same in any type."""
    return choice.to(torch.int16 if experts < 2**15 else torch.int32)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i: one scatter of the positions, where a second argsort would sort again."""
    return torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))


@dataclass
class SlotOrder:
    """What the one-device dispatch hands its combine: the T x k slots (token x k + j) sorted by
    expert, the first `rows` of them kept (`order`), the inverse of the uncut sort, and the weights."""
    order: torch.Tensor
    inverse: torch.Tensor
    rows: int
    weights: torch.Tensor  # [T, k] fp32, zero where a choice was dropped


class TokenDispatcher:
    """How a MoE layer's routed rows reach their experts and come back (`MoEFeedForward.dispatcher`).

    The layer runs, for the T tokens of a call and their routing:
        rows, counts, state = dispatcher.dispatch(flat, routing)  # rows grouped by expert, counts[e]
        out = layer.experts(rows, counts, dispatcher)             # -> dispatcher.run_experts(experts, ...)
        y = dispatcher.combine(out, state)                        # [T, dim]: each token's results, weighted
    This class is the one-device dispatcher: dispatch copies each token's row to its k slots sorted by
    expert (TokenRows), every expert runs here, combine gathers the results back by the inverse
    permutation and sums each token's k of them with their weights. Expert parallelism replaces it
    with one object for all the MoE layers (parallel/expert/install.py use_expert_parallel), whose
    run_experts exchanges the rows with the ranks that own the experts (and whose dispatch may first
    send them across nodes). A dispatcher keeps no state of a call: what combine needs travels in
    `state`, so one object serves every layer, block chunk and recomputation."""

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, SlotOrder]:
        t, k = routing.experts.shape
        experts = routing.probs.shape[-1]
        choice = routing.experts.flatten()
        if routing.kept is not None:  # dropped choices go to no expert (sorted last, then cut)
            choice = torch.where(routing.kept.flatten(), choice, experts)
        order = torch.argsort(sort_keys(choice, experts), stable=True)  # expert-sorted row -> its slot (token x k + j)
        inverse = inverse_permutation(order)  # slot -> its expert-sorted row
        counts = expert_counts(choice, experts + 1)[:experts]
        n = order.numel() if routing.kept is None else int(counts.sum())  # host read only with a capacity
        order = order[:n]
        weights = routing.weights if routing.kept is None else routing.weights * routing.kept
        return TokenRows.apply(flat, order, inverse, k), counts, SlotOrder(order, inverse, n, weights)

    def run_experts(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # (experts: models/moe_experts.py's Experts, which imports this module: typed by what it is here)
        return experts.run_here(rows, counts)

    def overlaps_beside(self) -> bool:
        """Whether run_experts_beside overlaps a layer's shared experts with the rows' transfer (the
        expert-parallel dispatcher's, parallel/expert/dispatch.py); here nothing travels, and the layer runs
        them after the combine."""
        return False

    def run_experts_beside(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor, beside
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """run_experts, and `beside()` (a layer's shared experts, which read no routed row): (the rows'
        results, beside's), one after the other."""
        return self.run_experts(experts, rows, counts), beside()

    def combine(self, out: torch.Tensor, state: SlotOrder) -> torch.Tensor:
        t, k = state.weights.shape
        # back to [T, k] slots (no scatter-add), weighted, summed: without drops by the inverse permutation,
        # a gather (index_copy would keep `out`, k x dim values per token, for its backward), whose backward
        # puts each gradient row back in expert order (SlotRows: a copy, no zero fill and no add)
        if state.rows < t * k:
            slots = out.new_zeros(t * k, out.shape[-1]).index_copy(0, state.order, out)
        else:
            slots = SlotRows.apply(out, state.inverse)
        w = state.weights.flatten()
        return (slots.view(t, k, out.shape[-1]) * w.view(t, k, 1).to(slots.dtype)).sum(1)  # (t may be 0)
