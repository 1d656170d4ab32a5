"""Mixture-of-Experts feed-forward for one device: routers, the layer, router statistics.

`MoEFeedForward` replaces a block's SwiGLU: a router picks `top_k` experts per token, the tokens
are permuted so that each expert's are contiguous, every expert runs as one grouped GEMM per
projection (models/moe_experts.py), and the results are un-permuted and weighted. Shared experts (one
SwiGLU every token goes through, optionally behind a sigmoid gate) are added on top.

How the routed rows reach their experts and come back is the layer's `dispatcher`, its one hook
for parallelism (models/moe_dispatch.py: dispatch -> run_experts -> combine): here the one-device
permutation, deterministic on CPU and CUDA; expert parallelism installs one object that exchanges
the rows between ranks (parallel/expert/install.py), so this module never imports parallel/.

Routing is a function of the token alone (for the dropless routers), so any slicing of the tokens
(ranks of a sequence-parallel layout, memory.block_chunk, recomputation) routes each token as the
whole batch on one device would. Two things see more than a token, and both are defined over every
token of the micro-batch, as one device holding it (all its data-parallel rows, whole sequences):
- the balancing losses: the layer records per-call sums (`RouterRecord`), the model combines them after its forward
  (`router_terms`, models/moe_stats.py) through a `sum` hook parallelize() points at the ranks holding the micro-batch;
- capacity (moe.capacity_factor > 0) and the Sinkhorn router's balanced assignment in training
  (models/moe_capacity.py): the call's routing input (the choices, T x k integers; Sinkhorn's logits)
  is gathered over those ranks in one-device token order through the layer's `call_tokens` hook,
  decided once, and each rank takes its part. A call that a memory policy runs in pieces
  (memory.block_chunk, the token-split offload) is routed as one all the same (`pieces`).

Padding (data/loader.py's tokens past a sample's documents) is no token of the micro-batch: the model sets
each layer's `real` mask from the batch, and the statistics (models/moe_stats.py) and the decisions
(models/moe_capacity.py) leave it out.

Router selection runs in fp32 (autocast off): bf16 logits flip top-k choices between layouts and
between a forward and its recomputation. How the layers route outside training (dropless generation and
evaluation, DTS-Gate's evaluation routing) is models/moe_eval_routing.py's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.eager import eager_under_compile
from .balanced_assignment import balanced_assignment, sinkhorn
from .moe_capacity import CallTokens, capacity_kept, decide, padded_choices
from .moe_dispatch import Routing, TokenDispatcher, TokenRows, expert_counts  # noqa: F401  (re-exported too)
from .moe_experts import Experts
from .moe_stats import RouterRecord, RouterTerms, record_call, router_terms, update_expert_bias  # noqa: F401
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

    def _apply(self, fn, recurse=True):
        """A cast of the model to bf16 / fp16 (model.to(torch.bfloat16) for generation, an HF load in bf16)
        leaves the gate weights and the selection bias fp32, as transformers keeps DeepSeek-V3's
        (_keep_in_fp32_modules_strict): routing selects in fp32, and a rounded gate or bias (3 digits in
        bf16) picks other experts than the run trained with."""
        # (detached: the cast swaps a parameter's .data, the detached tensor keeps the fp32 storage)
        held = {name: t.detach() for name, t in [*self.named_parameters(), *self.named_buffers()]}
        out = super()._apply(fn, recurse)
        for name, now in [*self.named_parameters(), *self.named_buffers()]:
            if now.dtype in (torch.bfloat16, torch.float16) and held[name].dtype == torch.float32:
                kept = held[name].to(now.device)
                if isinstance(now, nn.Parameter):
                    now.data = kept  # (the same parameter object, as the cast itself keeps it)
                    if now.grad is not None:  # (its gradient was cast too: an optimizer step would mix dtypes)
                        now.grad = now.grad.float()
                else:
                    owner, _, attr = name.rpartition(".")
                    self.get_submodule(owner)._buffers[attr] = kept
        return out

    def forward(self, x: torch.Tensor, chosen: torch.Tensor | None = None) -> Routing:
        """`chosen` [T, k]: experts decided over a larger call (MoEFeedForward.decide), only weighed here."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.choose(self._logits(x), chosen)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's fp32 logits [T, E] alone, for a caller outside forward (the Sinkhorn assignment's input).
        forward reads `_logits`, never this: a wrapper installed on `logits` (FSDP2's forward method around the
        router's own unit, parallel/fsdp/shard.py) must not run inside forward, where nested it left the unit
        resharded fully after forward (no node-sharded copy under hpz: its backward gathered over every rank)."""
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight.float())

    def _weights(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts' scores, renormalised to sum to 1 when moe.norm_topk is set, at any k
        (at top-1 every weight is then 1, as in transformers' Mixtral and Qwen-MoE), times moe.route_scale."""
        w = probs.gather(1, chosen)
        if self.norm_topk and chosen.shape[1] == 1:
            # exactly 1 with an exactly zero gradient (0 x w keeps the graph): autograd's gradient of p / p is
            # rounding noise (~1e-10), which Adam scales up to router updates of a sizeable fraction of the
            # learning rate, in a direction each layout's summation order picks (a tiny top-1 Mixtral with a
            # capacity trained 3e-2 to 5e-2 off one process by step 6: tests/distributed/test_moe_journey_audit.py)
            w = 1.0 + 0.0 * w
            return w * self.scale if self.scale != 1.0 else w
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
            per_group = biased.view(t, self.groups, self.experts // self.groups)  # (not -1: t may be 0)
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


def scheduled_experts(experts: int, top_k: int, step: int, steps: int) -> int:
    """DTS-Gate's experts per token at optimizer `step` (0-based) of `steps`: E - (E - top_k) x step / steps,
    rounded half up (floor(x + 1/2)) in integers, top_k from `steps` on. Python's round() took ties to the
    even count, so 8 experts to 2 over 12 steps kept 8 for 2 steps, 7 for 1, 6 for 3, 5 for 1: an even / odd
    wobble in a schedule documented as linear; half up drops one expert every 2 steps there."""
    if steps == 0 or step >= steps:
        return top_k
    return (2 * (experts * steps - (experts - top_k) * step) + steps) // (2 * steps)


class DTSRouter(Router):
    """DTS-Gate (dense to sparse): a softmax gate whose temperature goes from moe.dts_temperature to
    1 and whose number of experts goes from all of them to top_k, linearly over moe.dts_steps
    optimizer steps (the count rounded half up: scheduled_experts). The paper's Gumbel noise is left out, so
    that routing stays a function of the token (the same under every layout and in recomputation).

    In evaluation (moe.dts_eval): `schedule` routes as training does at the router's step (what the weights were
    trained to, also during the warm-up), `top_k` as the schedule ends (top-k at temperature 1). With no step set
    (a model built outside a training run, e.g. for `longctx generate`), training starts at step 0 and evaluation
    routes as the schedule ends."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.steps, self.start_temperature = cfg.moe_dts_steps, cfg.moe_dts_temperature
        self.eval_routing = cfg.moe_dts_eval

    def schedule(self, step: int) -> tuple[float, int]:
        """(temperature, experts per token) at an optimizer step (0-based)."""
        done = 1.0 if self.steps == 0 else min(1.0, step / self.steps)
        temperature = self.start_temperature + (1.0 - self.start_temperature) * done
        return temperature, scheduled_experts(self.experts, self.top_k, step, self.steps)

    def routing(self) -> tuple[float, int]:
        """(temperature, experts per token) of the next call, in training or evaluation."""
        return self.schedule(self.step or 0) if self.training else self.eval_schedule()

    def eval_schedule(self) -> tuple[float, int]:  # (temperature, experts per token) in evaluation
        if self.eval_routing == "schedule" and self.step is not None:
            return self.schedule(self.step)
        return 1.0, self.top_k

    def describe_eval(self) -> str:
        """How an evaluation routes (in either mode), for the line that reports it."""
        temperature, k = self.eval_schedule()
        ended = self.step is None or self.eval_routing == "top_k" or self.step >= self.steps
        where = "as its schedule ends" if ended else f"as training at step {self.step + 1}"
        return f"dts routing {where} ({k} experts per token, temperature {temperature:.2f})"

    # eager under train.compile: the schedule reads `step`, an int that changes every step, which a compiled `post`
    # guards on (it compiled again each step, until dynamo's recompile limit ran the blocks eagerly, silently)
    @eager_under_compile
    def choose(self, logits, chosen=None):
        temperature, k = self.routing()
        probs = (logits / temperature).softmax(-1)
        if chosen is None:
            chosen = (probs + self.expert_bias).topk(k, dim=-1).indices
        return Routing(chosen, self._weights(probs, chosen), probs, logits)


ROUTERS: dict[str, type[Router]] = {"softmax": SoftmaxRouter, "switch": SwitchRouter, "sigmoid": SigmoidRouter,
                                    "sinkhorn": SinkhornRouter, "dts": DTSRouter}


class MoEFeedForward(nn.Module):
    """Router + grouped experts (+ shared experts): a drop-in for the block's FeedForward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_loss_scope = cfg.moe_aux_loss_scope  # how router_terms combines the layers' balancing losses
        # the z figure keeps its gradient (and the router logits [T, E] for backward) only when weighted
        self.z_grad = cfg.moe_z_loss > 0
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
        # [T] bool over the tokens of the block's calls, False at padding (None: every token is real): set by the
        # model for each forward (kept for backward's recomputation); `piece` the slice of them a memory policy's
        # piece of the call holds (memory/apply_policy.py)
        self.real: torch.Tensor | None = None
        self.piece: slice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.route(flat) if self.pieces is None else self.pieces.route(self, flat)
        if routing is None:
            return torch.zeros_like(x)
        if self.recording:
            routing = record_call(self, routing, flat.shape[0])
        shared = None if self.shared is None else (lambda: self._shared(flat))
        y, s = self._routed(flat, routing, shared)
        return (y if s is None else y + s).view(shape)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        s = self.shared(flat)
        return s if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * s

    def _routed(self, flat: torch.Tensor, routing: Routing, shared=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' weighted sum for every token of `flat` [T, dim], and `shared()` (None without
        shared experts), which an expert-parallel dispatcher overlaps with the rows' way back (not in a graph)."""
        if shared is None or not self.dispatcher.overlaps_beside() or torch.compiler.is_compiling():
            # (after the combine: their backward then runs first, before the routed rows' gradients exist)
            run = self._experts_of if routing.kept is None else self._kept_experts_of
            return run(flat, routing), None if shared is None else shared()
        rows, counts, state = self.dispatcher.dispatch(flat, routing)
        out, s = self.experts(rows, counts, self.dispatcher, beside=shared)
        return self.dispatcher.combine(out, state), s

    def _experts_of(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum for every token of `flat` [T, dim]: dispatch, experts, combine."""
        rows, counts, state = self.dispatcher.dispatch(flat, routing)
        return self.dispatcher.combine(self.experts(rows, counts, self.dispatcher), state)

    # Eager under train.compile with a capacity: the dispatch keeps a data-dependent number of rows (read on the
    # host), and the compiled functions the rows reached guarded on it: static at the first count seen, a count of
    # 0 or 1 (a dynamic size is assumed >= 2, with mark_dynamic or dynamic=True too), whether any row was dropped
    # (the combine's and TokenRows' branches); so steps after the first compiled again
    # (tests/unit/test_moe_recompile118.py). Without a capacity the rows are T x k, a shape of the call: compiled.
    _kept_experts_of = eager_under_compile(_experts_of)

    def route(self, flat: torch.Tensor, chosen=None, kept=None) -> Routing:
        """The routing of the tokens `flat` [T, dim]: the router's, within the capacity; `chosen` and
        `kept` (the capacity's) decided over a larger call (`decide`) these tokens are a piece of. With
        `call_tokens`, a call is one rank's part of the micro-batch: decided over all of it here."""
        if chosen is None and kept is None and self._assigns() and (self.call_tokens is not None or
                                                                      self.real is not None):
            chosen, kept = self.decide([self.routing_input(flat)])  # the assignment replaces the router's choices
        r = self.router(flat, chosen)
        if kept is None and self.capacity_factor > 0:  # over the router's own choices (it runs once)
            across = chosen is None and self.call_tokens is not None
            kept = self.decide([r.experts])[1] if across else self._kept(r.experts)
        return r if kept is None else Routing(r.experts, r.weights, r.probs, r.logits, kept)

    def across_tokens(self) -> bool:
        """Whether routing a token reads the call's other tokens: a capacity, Sinkhorn's assignment in training."""
        return self.capacity_factor > 0 or self._assigns()

    def _assigns(self) -> bool:
        """Whether the Sinkhorn router's balanced assignment chooses (in training), not each token's top k."""
        return self.router.training and isinstance(self.router, SinkhornRouter)

    @torch.no_grad()
    def routing_input(self, flat: torch.Tensor) -> torch.Tensor:
        """What `decide` needs of these tokens: the Sinkhorn router's logits in training, else their choices."""
        return self.router.logits(flat) if self._assigns() else self.router(flat).experts

    def decide(self, gathered: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(chosen, kept) of this rank's call from its pieces' routing_input, in token order, decided over every
        token of the micro-batch (models/moe_capacity.py): Sinkhorn's assignment or the router's choices
        (reused by the pieces: `kept` refers to them), and the capacity's."""
        return decide(self, gathered)

    def _kept(self, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] the capacity's kept choices over the call `experts` (models/moe_capacity.py capacity_kept);
        padding's choices are never kept and take no place in the queues."""
        real = self.real_of(experts.shape[0])
        if real is None:
            return capacity_kept(experts, self.capacity_factor, self.num_experts)
        return capacity_kept(padded_choices(experts, real, self.num_experts), self.capacity_factor,
                             self.num_experts, padded=True)

    def real_of(self, tokens: int, piece: bool = False) -> torch.Tensor | None:
        """[tokens] bool: which of the call's tokens are real (None: all), of the piece being run if `piece`."""
        if self.real is None:
            return None
        real = self.real[self.piece] if piece and self.piece is not None else self.real
        if real.numel() != tokens:
            raise ValueError(f"a MoE layer's call holds {tokens} tokens but its padding mask {real.numel()}: the "
                             "mask must cover the block's call (Llama.hidden_states(real=...))")
        return real


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]
