"""The router statistics of the MoE layers (models/moe.py): what each call records, and the balancing
losses and load figures the model combines from them after its forward.

Padding (a packed sample's tokens past its documents, data/loader.py) is no token of the micro-batch:
a layer's `real` mask (MoEFeedForward.real, from the batch) keeps it out of every sum here, the
choices per expert, the probability sums, the z-loss and the token count (`record`), so a padded
batch trains its routers as the same batch without the padding would. Without a mask every token counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..ops.eager import eager_under_compile
from .moe_dispatch import Routing, expert_counts


@dataclass
class RouterRecord:
    """What one call of a layer contributes to the balancing losses and the load metrics."""
    counts: torch.Tensor      # [E] choices per expert (before any drop), no gradient
    prob_sum: torch.Tensor    # [E] sum over the call's tokens of the router probabilities (with gradient)
    lse_sq_sum: torch.Tensor  # sum over the tokens of logsumexp(logits)^2 (with gradient when moe.z_loss > 0)
    tokens: int | torch.Tensor  # the call's (real) tokens: an int, a 0-d tensor with a padding mask (no host read)
    dropped: torch.Tensor     # real tokens' choices dropped for capacity (no gradient)
    rows: torch.Tensor        # [E] choices each expert runs: kept by the capacity (= counts without one), no gradient


# (eager under a compiled `post`: traced, it guarded on len(layer.records) and the piece's bounds, so each piece
# of a memory policy's call (memory.block_chunk) compiled again until the recompile limit ran some pieces
# eagerly, and a checkpointed piece's forward and its recomputation saved different tensors: CheckpointError)
@eager_under_compile
def record_call(layer, routing: Routing, tokens: int) -> Routing:
    """A MoE layer's (models/moe.py MoEFeedForward) record of one call of `tokens` tokens, appended to its records;
    returns the routing the call goes on with (its weights passed through the record's node: `record`)."""
    rec, routing = record(routing, tokens, layer.num_experts, layer.real_of(tokens, True), layer.z_grad)
    layer.records.append(rec)
    return routing


def record(routing: Routing, tokens: int, num_experts: int, real: torch.Tensor | None = None,
           z_grad: bool = True) -> tuple[RouterRecord, Routing]:
    """What a call of T = `tokens` tokens with `routing` adds to the statistics, and the routing to go on with;
    `real` [T] bool (None: all): padding adds nothing (its choices, probabilities, z-loss term and count are left
    out; its choices, never kept under a capacity, are no drops). Without padding the same bits as without a mask.

    `z_grad` False (moe.z_loss = 0): the z figure is recorded without a gradient, the same value: with one, its
    log-sum-exp kept the logits [T, E] fp32 for a backward through a term weighted 0 (router_terms refuses a
    z weight over such records). The sums with a gradient come from `_RouterSums`, whose node the returned
    routing's weights pass through."""
    weight = None if real is None else real.to(routing.probs.dtype)
    weights, prob_sum, lse_sq_sum = _RouterSums.apply(routing.weights, routing.probs, routing.logits, weight, z_grad)
    routing = dataclasses.replace(routing, weights=weights)
    if real is None:
        counts = expert_counts(routing.experts.flatten(), num_experts).float()
        dropped = (torch.zeros((), device=counts.device) if routing.kept is None
                   else (~routing.kept).sum().float())
    else:
        choice = torch.where(real[:, None], routing.experts, num_experts).flatten()  # padding: a bucket past E
        counts = expert_counts(choice, num_experts + 1)[:num_experts].float()
        dropped = (torch.zeros((), device=counts.device) if routing.kept is None
                   else (~routing.kept & real[:, None]).sum().float())
        tokens = real.sum().float()
    rows = _rows(routing, counts, num_experts)
    return RouterRecord(counts, prob_sum, lse_sq_sum, tokens, dropped, rows), routing


class _RouterSums(torch.autograd.Function):
    """(weights, prob_sum [E], lse_sq_sum) of a call: the routing weights [T, k] passed through, the probabilities
    [T, E] summed over the (real) tokens, and sum_t logsumexp(logits_t)^2 over them, each token times `weight` [T]
    (None: 1); the z figure without a gradient unless `z_grad`. The same values, and the same gradients bit for bit,
    as the ops themselves (sum; square, logsumexp; a product with the weight); why one node:

    The sums feed the balancing losses, which only a caller that adds the model's router_terms to its loss
    backwards (train/moe_hooks.py); a backward of the LM loss alone (an evaluation of memory or of a layout, a
    library caller's own loss) never runs their own nodes. Autograd then kept what those saved (the logits and
    their log-sum-exp, the padding weight) until the records were dropped at the next forward, and in a recomputed
    block more: the recomputation remade those tensors for the forward's checkpoint holders (they were never
    unpacked), and the holders kept the block's checkpoint, its saved input with it, past the block's backward:
    under full recomputation 4 dim + 4 E + 4 bytes per token and MoE layer, summed over the layers (tests/unit/
    test_zloss_recompute_memory119.py). Here the weights, which the layer's output reads in every backward, pass
    through the node that saved them, so it runs in the block's backward whatever the caller backwards, and frees
    them there, as the router's own ops free theirs; a missing sum's gradient is none (not a zero tensor)."""

    @staticmethod
    def forward(ctx, weights, probs, logits, weight, z_grad: bool):
        ctx.set_materialize_grads(False)
        prob_sum = probs.sum(0) if weight is None else (probs * weight[:, None]).sum(0)
        lse = logits.logsumexp(-1)
        lse_sq = lse.square()
        lse_sq_sum = (lse_sq if weight is None else lse_sq * weight).sum()
        ctx.z_grad, ctx.probs_shape = z_grad, probs.shape
        ctx.save_for_backward(logits if z_grad else None, lse if z_grad else None, weight)
        if not z_grad:
            ctx.mark_non_differentiable(lse_sq_sum)
        return weights.view_as(weights), prob_sum, lse_sq_sum

    @staticmethod
    def backward(ctx, g_weights, g_prob_sum, g_lse_sq_sum):
        logits, lse, weight = ctx.saved_tensors  # (unpacked in every backward: what frees them)
        g_probs = g_logits = None
        if g_prob_sum is not None:  # (as sum's and the product's own backward: expanded, times the weight)
            g_probs = g_prob_sum.expand(ctx.probs_shape)
            g_probs = g_probs if weight is None else g_probs * weight[:, None]
        if g_lse_sq_sum is not None and ctx.z_grad:  # (as sum's, the product's, square's and logsumexp's)
            g = g_lse_sq_sum.expand(lse.shape)
            g = (g if weight is None else g * weight) * (2 * lse)
            g_logits = g.unsqueeze(-1) * (logits - lse.unsqueeze(-1)).exp()
        return g_weights, g_probs, g_logits, None, None


def _rows(routing: Routing, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] the choices each expert runs: `counts` without a capacity, else its kept choices (padding's never are)."""
    if routing.kept is None:
        return counts
    kept = torch.where(routing.kept, routing.experts, num_experts).flatten()
    return expert_counts(kept, num_experts + 1)[:num_experts].float()



@dataclass
class RouterTerms:
    """A micro-batch's balancing losses and load figures, after the model's forward.
    `loss` is THIS rank's share (with gradient): summed over the ranks it is the loss of the whole
    micro-batch, as one device holding every token would compute it. `stats` [5] (no gradient, the
    same on every rank): aux loss, z-loss (unweighted, mean over MoE layers), mean over layers of
    max/mean choices per expert (before drops), the worst layer's, and the fraction of choices dropped.
    `counts` [layers, E] are the micro-batch's choices per expert over every rank, `dropped` [layers]
    its choices dropped for capacity per layer over every rank, `layer_load` [layers] each layer's
    max/mean choices per expert (layer_loads), `rows` [layers, E] the choices each expert ran over every rank
    (kept by the capacity; the counts without one): what FlexMoE's placement plans from (train/moe_hooks.py)."""
    loss: torch.Tensor
    stats: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor
    layer_load: torch.Tensor
    rows: torch.Tensor


def router_terms(layers: list, aux_weight: float, z_weight: float, sum_over_ranks=None,
                 scope: str | None = None) -> RouterTerms:
    """Combine what the MoE layers (models/moe.py MoEFeedForward) recorded in the last forward.
    `sum_over_ranks(t)` sums a tensor over every rank holding tokens of the micro-batch (identity on one
    device): one collective for all layers.

    aux (Switch/GShard) of a layer = E x sum_e f_e P_e, f_e = fraction of the choices that went to e
    and P_e = mean probability of e, both over every token. The loss combines the L layers as `scope`
    (moe.aux_loss_scope, the layers' own by default) says:
    - per_layer_mean: the mean of the layers' aux; per_layer_sum: their sum (Megatron-LM);
    - pooled (transformers' load_balancing_loss_func): E x sum_e F_e Q_e with F_e = every layer's
      choices of e over L T and Q_e = every layer's probabilities of e summed over L T; F counts each
      of a token's k choices (sums to k), so an even load gives k, not 1.
    Each is linear in the probability sums, so a rank's share (the same product with its own sums of
    probabilities and the global counts) is exact however the tokens are split. z = mean over tokens
    of logsumexp(logits)^2, averaged over the layers, a rank's share its sum / T. `stats` keep the
    per-layer mean of aux whatever the scope (1 = even), so runs under any scope log comparable loads."""
    if z_weight and any(r.prob_sum.requires_grad and not r.lse_sq_sum.requires_grad
                        for layer in layers for r in layer.records):
        raise ValueError(f"a z-loss weight of {z_weight} over MoE layers built with moe.z_loss = 0, whose records "
                         "keep no z-loss gradient (models/moe_stats.py record): build the model with its moe.z_loss")
    counts = torch.stack([sum(r.counts for r in layer.records) for layer in layers])
    prob_sum = torch.stack([sum(r.prob_sum for r in layer.records) for layer in layers])
    lse_sq = torch.stack([sum(r.lse_sq_sum for r in layer.records) for layer in layers])
    tokens = sum(r.tokens for r in layers[0].records)
    dropped = torch.stack([sum(r.dropped for r in layer.records) for layer in layers])
    rows = torch.stack([sum(r.rows for r in layer.records) for layer in layers])
    e, n_layers = counts.shape[1], len(layers)
    packed = torch.cat([counts.flatten(), prob_sum.detach().flatten(), lse_sq.detach(), dropped,
                        torch.as_tensor(tokens, dtype=counts.dtype, device=counts.device).reshape(1), rows.flatten()])
    if sum_over_ranks is not None:
        packed = sum_over_ranks(packed)
    g_counts = packed[: n_layers * e].view(n_layers, e)
    g_prob = packed[n_layers * e: 2 * n_layers * e].view(n_layers, e)
    g_lse = packed[2 * n_layers * e: 2 * n_layers * e + n_layers]
    g_dropped = packed[2 * n_layers * e + n_layers: 2 * n_layers * e + 2 * n_layers]
    g_tokens, g_rows = packed[2 * n_layers * e + 2 * n_layers], packed[-n_layers * e:].view(n_layers, e)
    # a micro-batch entirely of padding has no token and no choice: its terms are 0, not 0/0 (a NaN loss made
    # the guard skip the whole step); the counts are whole numbers, so clamping at 1 changes nothing else
    g_tokens = g_tokens.clamp_min(1)
    fraction = g_counts / g_counts.sum(1, keepdim=True).clamp_min(1)  # f_e per layer
    local_aux = _aux_share(scope or layers[0].aux_loss_scope, g_counts, fraction, prob_sum, g_tokens)
    local_z = lse_sq.sum() / (g_tokens * n_layers)
    loss = aux_weight * local_aux + z_weight * local_z
    aux = e * (fraction * g_prob).sum() / (g_tokens * n_layers)
    z = g_lse.sum() / (g_tokens * n_layers)
    load = layer_loads(g_counts)
    stats = torch.stack([aux, z, load.mean(), load.max(), g_dropped.sum() / g_counts.sum().clamp_min(1)])
    for layer in layers:
        layer.records.clear()
    return RouterTerms(loss, stats.detach(), g_counts.detach(), g_dropped.detach(), load.detach(), g_rows.detach())


def layer_loads(counts: torch.Tensor) -> torch.Tensor:
    """Max / mean choices per expert of each layer: counts [layers, E] -> [layers] (1 = even; 0 for a layer
    without a choice, a micro-batch of padding)."""
    return counts.max(1).values * counts.shape[1] / counts.sum(1).clamp_min(1)


def _aux_share(scope: str, counts: torch.Tensor, fraction: torch.Tensor, prob_sum: torch.Tensor,
               tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the balancing loss (router_terms): counts and fractions [L, E] over every
    rank, prob_sum [L, E] this rank's (with gradient), tokens the micro-batch's over every rank."""
    e, n_layers = counts.shape[1], counts.shape[0]
    if scope == "pooled":  # transformers: choices per token (summing to k) and probabilities, pooled over layers
        pooled = tokens * n_layers
        return e * (counts.sum(0) / pooled * prob_sum.sum(0)).sum() / pooled
    per_layer = e * (fraction * prob_sum).sum() / tokens  # the sum over layers of each layer's share
    if scope == "per_layer_sum":
        return per_layer
    if scope == "per_layer_mean":
        return per_layer / n_layers
    raise ValueError(f"moe.aux_loss_scope {scope!r} is not one of per_layer_mean, per_layer_sum, pooled")


@torch.no_grad()
def update_expert_bias(layers: list, counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), once per optimizer step from the step's choices per
    expert [layers, E] over every rank: an expert above the mean load gets its selection bias lowered
    by `rate`, one below raised."""
    for layer, c in zip(layers, counts):
        layer.router.expert_bias += rate * torch.sign(c.mean() - c)
