"""Mixture-of-Experts feed-forward for one device: routers, grouped experts, router statistics.

`MoEFeedForward` replaces a block's SwiGLU: a router picks `top_k` experts per token, the tokens
are permuted so that each expert's are contiguous, every expert runs as one grouped GEMM per
projection (ops/grouped.py), and the results are un-permuted and weighted. Shared experts (one
SwiGLU every token goes through, optionally behind a sigmoid gate) are added on top.

How the routed rows reach their experts and come back is the layer's `dispatcher`, its one hook
for parallelism (models/moe_dispatch.py: dispatch -> run_experts -> combine): here the one-device
permutation, deterministic on CPU and CUDA; expert parallelism installs one object that exchanges
the rows between ranks (parallel/expert/install.py), so this module never imports parallel/.

Routing is a function of the token alone (for the dropless routers), so any slicing of the tokens
(ranks of a sequence-parallel layout, memory.block_chunk, recomputation) routes each token as the
whole batch on one device would. Two things see more than a token, and both are defined over every
token of the micro-batch, as one device holding it (all its data-parallel rows, whole sequences):
- the balancing losses: the layer records per-call sums (`RouterRecord`) and the model combines them
  after its forward (`router_terms`), through a `sum` hook that parallelize() points at the ranks
  holding the micro-batch;
- capacity (moe.capacity_factor > 0) and the Sinkhorn router's balanced assignment in training
  (models/moe_capacity.py): the call's routing input (the choices, T x k integers; Sinkhorn's logits)
  is gathered over those ranks in one-device token order through the layer's `call_tokens` hook,
  decided once, and each rank takes its part. A call that a memory policy runs in pieces
  (memory.block_chunk, the token-split offload) is routed as one all the same (`pieces`).

Router selection runs in fp32 (autocast off): bf16 logits flip top-k choices between layouts and
between a forward and its recomputation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..ops.grouped import grouped_mm
from .balanced_assignment import balanced_assignment, sinkhorn
from .moe_capacity import CallTokens, capacity_kept, decide
from .moe_dispatch import (  # noqa: F401  (Routing, TokenRows: imported from here too)
    Routing,
    TokenDispatcher,
    TokenRows,
    expert_counts,
)
from .swiglu import FeedForward


class Router(nn.Module):
    """Token -> (experts, weights). Subclasses say how scores become choices (`choose`). The selection
    bias (DeepSeek-V3's aux-loss-free balancing) shifts which experts are chosen, never the weights."""

    renorm_eps = 0.0  # added to the sum of the chosen scores before the renormalisation (moe.norm_topk)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.norm_topk, self.scale = cfg.moe_norm_topk, cfg.moe_route_scale
        self.gate = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=True)
        # the optimizer step being run, 0-based (set by the model; the DTS schedule reads it); None: no
        # run has set one (see DTSRouter.routing)
        self.step: int | None = None

    def forward(self, x: torch.Tensor, chosen: torch.Tensor | None = None) -> Routing:
        """`chosen` [T, k]: experts decided over a larger call (MoEFeedForward.decide), only weighed here."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.choose(self.logits(x), chosen)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight.float())

    def _weights(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts' scores, renormalised to sum to 1 when moe.norm_topk is set, at any k
        (at top-1 every weight is then 1, as in transformers' Mixtral and Qwen-MoE), times moe.route_scale."""
        w = probs.gather(1, chosen)
        if self.norm_topk:
            total = w.sum(-1, keepdim=True)
            w = w / (total + self.renorm_eps if self.renorm_eps else total)
        return w * self.scale if self.scale != 1.0 else w

    def choose(self, logits: torch.Tensor, chosen: torch.Tensor | None = None) -> Routing:
        raise NotImplementedError


class SoftmaxRouter(Router):
    """Top-k of a softmax (GShard, Mixtral, Qwen-MoE, OLMoE), renormalised or not (moe.norm_topk)."""

    def choose(self, logits, chosen=None):
        probs = logits.softmax(-1)
        if chosen is None:
            chosen = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices
        return Routing(chosen, self._weights(probs, chosen), probs, logits)


class SwitchRouter(SoftmaxRouter):
    """Top-1 of a softmax, its probability p as the weight (the Switch Transformer), whatever
    moe.norm_topk says: renormalised, a top-1 weight would be 1 and the router would get no gradient
    from the model's loss, only from the balancing losses. Capacity is the layer's (moe.capacity_factor)."""

    def _weights(self, probs, chosen):
        w = probs.gather(1, chosen)
        return w * self.scale if self.scale != 1.0 else w


class SigmoidRouter(Router):
    """DeepSeek-V3: sigmoid scores; the experts are in `groups`, a group scores the sum of its two
    best (biased) experts, a token picks among its best `topk_groups` groups only; the weights are
    the unbiased scores of the chosen experts, renormalised (moe.norm_topk) as DeepSeek-V3 does
    (divided by their sum + 1e-20, at any k) and scaled (moe.route_scale)."""

    renorm_eps = 1e-20

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups

    def choose(self, logits, chosen=None):
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)  # what the balancing loss reads
        if chosen is None:
            chosen = self._select(scores + self.expert_bias)
        return Routing(chosen, self._weights(scores, chosen), probs, logits)

    def _select(self, biased):
        if self.groups > 1:
            t = biased.shape[0]
            per_group = biased.view(t, self.groups, -1)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            best = group_score.topk(self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            biased = biased.masked_fill(~allowed.repeat_interleave(per_group.shape[-1], dim=1), -math.inf)
        return biased.topk(self.top_k, dim=-1).indices


class SinkhornRouter(Router):
    """S-BASE: in training, the token x expert affinities exp(logits) are normalised by Sinkhorn
    iterations toward every expert taking an even share, then each token is assigned k distinct
    experts, its best ones under a capacity of ceil(T k / E) choices per expert (`balanced_assignment`),
    so that every expert's load is within one choice of T k / E. In evaluation, plain top-k.
    The weights are the softmax probabilities of the assigned experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.iters = cfg.moe_sinkhorn_iters

    def choose(self, logits, chosen=None):
        probs = logits.softmax(-1)
        if chosen is None and not self.training:
            chosen = probs.topk(self.top_k, dim=-1).indices
        elif chosen is None:
            with torch.no_grad():
                chosen = balanced_assignment(sinkhorn(logits, self.iters), self.top_k)
        return Routing(chosen, self._weights(probs, chosen), probs, logits)


class DTSRouter(Router):
    """DTS-Gate (dense to sparse): a softmax gate whose temperature goes from moe.dts_temperature to
    1 and whose number of experts goes from all of them to top_k, linearly over moe.dts_steps
    optimizer steps. The paper's Gumbel noise is left out, so that routing stays a function of the
    token (the same under every layout and in recomputation).

    In evaluation (moe.dts_eval): `schedule` routes as training does at the router's step (what the
    weights were trained to, also during the warm-up), `top_k` as the schedule ends (top-k at
    temperature 1). With no step set (a model built outside a training run, e.g. for `longctx
    generate`), training starts at step 0 and evaluation routes as the schedule ends."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.steps, self.start_temperature = cfg.moe_dts_steps, cfg.moe_dts_temperature
        self.eval_routing = cfg.moe_dts_eval

    def schedule(self, step: int) -> tuple[float, int]:
        """(temperature, experts per token) at an optimizer step (0-based)."""
        done = 1.0 if self.steps == 0 else min(1.0, step / self.steps)
        temperature = self.start_temperature + (1.0 - self.start_temperature) * done
        k = round(self.experts + (self.top_k - self.experts) * done)
        return temperature, max(self.top_k, k)

    def routing(self) -> tuple[float, int]:
        """(temperature, experts per token) of the next call, in training or evaluation."""
        return self.schedule(self.step or 0) if self.training else self.eval_schedule()

    def eval_schedule(self) -> tuple[float, int]:
        if self.eval_routing == "schedule" and self.step is not None:
            return self.schedule(self.step)
        return 1.0, self.top_k

    def describe_eval(self) -> str:
        """How an evaluation routes (in either mode), for the line that reports it."""
        temperature, k = self.eval_schedule()
        ended = self.step is None or self.eval_routing == "top_k" or self.step >= self.steps
        where = "as its schedule ends" if ended else f"as training at step {self.step + 1}"
        return f"dts routing {where} ({k} experts per token, temperature {temperature:.2f})"

    def choose(self, logits, chosen=None):
        temperature, k = self.routing()
        probs = (logits / temperature).softmax(-1)
        if chosen is None:
            chosen = (probs + self.expert_bias).topk(k, dim=-1).indices
        return Routing(chosen, self._weights(probs, chosen), probs, logits)


ROUTERS: dict[str, type[Router]] = {"softmax": SoftmaxRouter, "switch": SwitchRouter, "sigmoid": SigmoidRouter,
                                    "sinkhorn": SinkhornRouter, "dts": DTSRouter}


@dataclass
class RouterRecord:
    """What one call of a layer contributes to the balancing losses and the load metrics."""
    counts: torch.Tensor      # [E] choices per expert (before any drop), no gradient
    prob_sum: torch.Tensor    # [E] sum over the call's tokens of the router probabilities (with gradient)
    lse_sq_sum: torch.Tensor  # sum over the tokens of logsumexp(logits)^2 (with gradient)
    tokens: int
    dropped: torch.Tensor     # choices dropped for capacity (no gradient)


class Experts(nn.Module):
    """E SwiGLU experts as 3D weights, each expert's matrix stored as nn.Linear stores it ([out, in]):
    w1 (gate) and w3 (up) [E, hidden, dim], w2 (down) [E, dim, hidden]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.chunk = 0  # memory.expert_chunk: rows run (and recomputed) at a time; 0 = all at once

    def forward(self, x: torch.Tensor, counts: torch.Tensor, dispatcher: TokenDispatcher | None = None
                ) -> torch.Tensor:
        """x [n, dim]: rows grouped by expert, counts[e] of them for expert e, in expert order. The
        layer passes its dispatcher, which runs them (`run_experts`: all here on one device, each on
        its owner under expert parallelism); inside this module's call, so that its hooks (FSDP's
        gather of these weights) see every run."""
        return self.run_here(x, counts) if dispatcher is None else dispatcher.run_experts(self, x, counts)

    def run_here(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert on this device (one device's dispatcher runs this)."""
        return swiglu_experts(x, counts, self.w1, self.w3, self.w2, self.chunk)


def _swiglu_grouped(x, counts, w1, w3, w2):
    t = lambda w: w.transpose(1, 2)  # noqa: E731  [E, in, out] views of the [E, out, in] weights
    h = F.silu(grouped_mm(x, t(w1), counts)) * grouped_mm(x, t(w3), counts)
    return grouped_mm(h, t(w2), counts)


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, chunk: int = 0) -> torch.Tensor:
    """The experts' SwiGLU on rows grouped by expert (counts[e] rows for expert e, in order).

    chunk > 0 (memory.expert_chunk): at most `chunk` rows at a time, each piece checkpointed, so the
    experts' intermediates (3 x hidden per row, the largest tensors of an MoE layer) never exist for
    more rows than that, however many rows arrive: under skewed routing a rank may receive every
    token of its expert group. The pieces are cut by row position (the row count is a shape), each
    piece's counts clipped from the cumulative counts on the device: no host read."""
    n = x.shape[0]
    if not chunk or n <= chunk:
        return _swiglu_grouped(x, counts, w1, w3, w2)
    ends = counts.cumsum(0)
    pieces = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        # rows of each expert inside [start, stop): clip every expert's [end - count, end) to it
        piece_counts = (ends.clamp(start, stop) - (ends - counts).clamp(start, stop))
        pieces.append(checkpoint(_swiglu_grouped, x[start:stop], piece_counts, w1, w3, w2, use_reentrant=False))
    return torch.cat(pieces)


class MoEFeedForward(nn.Module):
    """Router + grouped experts (+ shared experts): a drop-in for the block's FeedForward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_loss_scope = cfg.moe_aux_loss_scope  # how router_terms combines the layers' balancing losses
        self.router = ROUTERS[cfg.moe_router](cfg)
        self.experts = Experts(cfg.moe_experts, cfg.dim, cfg.resolved_expert_dim)
        shared = cfg.resolved_shared_dim
        self.shared = FeedForward(cfg.dim, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if cfg.moe_shared_gate else None
        # how the routed rows reach the experts: one device's permutation, or the object expert
        # parallelism installs (parallel/expert/install.py use_expert_parallel)
        self.dispatcher: TokenDispatcher = TokenDispatcher()
        self.recording = False  # the model turns it on for its training forwards
        self.records: list[RouterRecord] = []
        # memory/apply_policy.py's, while it runs a call in pieces: route(layer, flat) -> the piece's routing
        # as part of the whole call's (`decide`), or None in a first pass that gathers each `routing_input`
        self.pieces = None
        # every token of the micro-batch, for the decisions that look across tokens (models/moe_capacity.py):
        # None = this process holds the micro-batch; parallelize() installs one object for all the layers
        self.call_tokens: CallTokens | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.route(flat) if self.pieces is None else self.pieces.route(self, flat)
        if routing is None:
            return torch.zeros_like(x)
        if self.recording:
            self._record(routing, flat.shape[0])
        y = self._routed(flat, routing)
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(flat)) * s
            y = y + s
        return y.view(shape)

    def _routed(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum for every token of `flat` [T, dim], through the dispatcher."""
        rows, counts, state = self.dispatcher.dispatch(flat, routing)
        return self.dispatcher.combine(self.experts(rows, counts, self.dispatcher), state)

    def route(self, flat: torch.Tensor, chosen=None, kept=None) -> Routing:
        """The routing of the tokens `flat` [T, dim]: the router's, within the capacity; `chosen` and
        `kept` (the capacity's) decided over a larger call (`decide`) these tokens are a piece of. With
        `call_tokens`, a call is one rank's part of the micro-batch: decided over all of it here."""
        if chosen is None and kept is None and self.call_tokens is not None and self.across_tokens():
            chosen, kept = self.decide([self.routing_input(flat)])
        r = self.router(flat, chosen)
        kept = self._kept(r.experts) if kept is None and self.capacity_factor > 0 else kept
        return r if kept is None else Routing(r.experts, r.weights, r.probs, r.logits, kept)

    def across_tokens(self) -> bool:
        """Whether routing a token reads the call's other tokens: a capacity, Sinkhorn's assignment in training."""
        return self.capacity_factor > 0 or (self.router.training and isinstance(self.router, SinkhornRouter))

    @torch.no_grad()
    def routing_input(self, flat: torch.Tensor) -> torch.Tensor:
        """What `decide` needs of these tokens: the Sinkhorn router's logits in training, else their choices."""
        sinkhorn = self.router.training and isinstance(self.router, SinkhornRouter)
        return self.router.logits(flat) if sinkhorn else self.router(flat).experts

    def decide(self, gathered: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(chosen, kept) of this rank's call from its pieces' routing_input, in token order, decided over every
        token of the micro-batch (models/moe_capacity.py): Sinkhorn's assignment or the router's choices
        (reused by the pieces: `kept` refers to them), and the capacity's."""
        return decide(self, gathered)

    def _kept(self, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] the capacity's kept choices over the call `experts` (models/moe_capacity.py capacity_kept)."""
        return capacity_kept(experts, self.capacity_factor, self.num_experts)

    def _record(self, routing: Routing, tokens: int) -> None:
        counts = expert_counts(routing.experts.flatten(), self.num_experts).float()
        dropped = (torch.zeros((), device=counts.device) if routing.kept is None
                   else (~routing.kept).sum().float())
        self.records.append(RouterRecord(counts, routing.probs.sum(0), routing.logits.logsumexp(-1).square().sum(),
                                         tokens, dropped))


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def eval_routing_note(model: nn.Module) -> str | None:
    """How an evaluation of `model` routes where that depends on the step (DTS-Gate: moe.dts_eval),
    for the eval line; None for routers that route the same at every step."""
    routers = [layer.router for layer in moe_layers(model) if isinstance(layer.router, DTSRouter)]
    return routers[0].describe_eval() if routers else None


@dataclass
class RouterTerms:
    """A micro-batch's balancing losses and load figures, after the model's forward.
    `loss` is THIS rank's share (with gradient): summed over the ranks it is the loss of the whole
    micro-batch, as one device holding every token would compute it. `stats` [5] (no gradient, the
    same on every rank): aux loss, z-loss (unweighted, mean over MoE layers), mean over layers of
    max/mean tokens per expert, the worst layer's, and the fraction of choices dropped.
    `counts` [layers, E] are the micro-batch's choices per expert over every rank, `dropped` [layers]
    its choices dropped for capacity per layer over every rank."""
    loss: torch.Tensor
    stats: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor


def router_terms(layers: list[MoEFeedForward], aux_weight: float, z_weight: float, sum_over_ranks=None,
                 scope: str | None = None) -> RouterTerms:
    """Combine what the layers recorded in the last forward. `sum_over_ranks(t)` sums a tensor over
    every rank holding tokens of the micro-batch (identity on one device): one collective for all layers.

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
    counts = torch.stack([sum(r.counts for r in layer.records) for layer in layers])
    prob_sum = torch.stack([sum(r.prob_sum for r in layer.records) for layer in layers])
    lse_sq = torch.stack([sum(r.lse_sq_sum for r in layer.records) for layer in layers])
    tokens = float(sum(r.tokens for r in layers[0].records))
    dropped = torch.stack([sum(r.dropped for r in layer.records) for layer in layers])
    e, n_layers = counts.shape[1], len(layers)
    packed = torch.cat([counts.flatten(), prob_sum.detach().flatten(), lse_sq.detach(), dropped,
                        counts.new_tensor([tokens])])
    if sum_over_ranks is not None:
        packed = sum_over_ranks(packed)
    g_counts = packed[: n_layers * e].view(n_layers, e)
    g_prob = packed[n_layers * e: 2 * n_layers * e].view(n_layers, e)
    g_lse = packed[2 * n_layers * e: 2 * n_layers * e + n_layers]
    g_dropped, g_tokens = packed[2 * n_layers * e + n_layers: -1], packed[-1]
    fraction = g_counts / g_counts.sum(1, keepdim=True)  # f_e per layer
    local_aux = _aux_share(scope or layers[0].aux_loss_scope, g_counts, fraction, prob_sum, g_tokens)
    local_z = lse_sq.sum() / (g_tokens * n_layers)
    loss = aux_weight * local_aux + z_weight * local_z
    aux = e * (fraction * g_prob).sum() / (g_tokens * n_layers)
    z = g_lse.sum() / (g_tokens * n_layers)
    load = g_counts.max(1).values / g_counts.mean(1)
    stats = torch.stack([aux, z, load.mean(), load.max(), g_dropped.sum() / g_counts.sum()])
    for layer in layers:
        layer.records.clear()
    return RouterTerms(loss, stats.detach(), g_counts.detach(), g_dropped.detach())


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
def update_expert_bias(layers: list[MoEFeedForward], counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), once per optimizer step from the step's choices per
    expert [layers, E] over every rank: an expert above the mean load gets its selection bias lowered
    by `rate`, one below raised."""
    for layer, c in zip(layers, counts):
        layer.router.expert_bias += rate * torch.sign(c.mean() - c)
