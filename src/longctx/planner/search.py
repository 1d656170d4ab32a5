"""Search: enumerate mesh shapes x memory policies x micro-batches, prune, rank by predicted step time.

The space is (dp_replicate, dp_shard, head, ctx, window, placement: a MeshShape; recompute,
offload fraction, loss / block / attention chunks, attention offload, grad_sync: a MemoryPolicy;
micro-batch). Branches are cut as early as their cause is known:

- head degrees that do not divide the query heads (or split kv heads unevenly) and sequence
  degrees for which the sequence is not divisible by 2 x head x ctx are never generated;
- a (head, ctx, dp_replicate) whose model states alone exceed GPU memory skips every policy;
- activation and transient estimates (cost.rank_activations) are computed once per (head, ctx,
  micro-batch, policy) and reused for every dp split, window and placement;
- windows: 0 (plain ring) and the largest window whose inner ring fits in one node (the only
  Double-Ring worth having: outer hops cross nodes, inner hops stay on NVLink);
- slow links: ZeRO++ where the FSDP group spans nodes, hpZ on a node's group on three-level hardware,
  co2 where replicas span nodes (ranked only under Request.allow; planner/slow_links.py).

`plan(...)` returns a `PlanResult` with every evaluated candidate ranked (feasible first, by step
time), and, when nothing fits, what would: more GPUs, offload, a shorter sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..costs.hardware import Hardware
from ..costs.host_bytes import TIERS, device_state_bytes
from ..costs.shape import MeshShape
from ..errors import ConfigError
from ..memory.policy import MemoryPolicy
from .cost import Estimate, estimate, memory_bytes, rank_activations
from .slow_links import CO2_LOCAL_STEPS, check_levels, slow_link_variants

OFFLOAD_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
_POLICY_ORDER = {"none": 0, "selective": 1, "full": 2}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_tokens(text: str | int) -> int:
    """'1M' -> 1048576, '208K' -> 212992, '4096' -> 4096 (K and M are powers of 1024)."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().upper().replace("_", "")
        mult = 1
        if s.endswith(("K", "M", "G")):
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}[s[-1]]
            s = s[:-1]
        try:
            num = float(s)
        except ValueError:
            raise ConfigError(f"'{text}' is not a token count; write e.g. 4096, 128K or 1M "
                              f"(K = 1024, M = 1048576).") from None
        value = num * mult
        if value != int(value):
            raise ConfigError(f"'{text}' is not a whole number of tokens.")
        value = int(value)
    if value < 2:
        raise ConfigError(f"the sequence length must be at least 2 tokens, got {text}.")
    return value


def head_degree_ok(m: ModelConfig, h: int) -> bool:
    return m.heads % h == 0 and (m.kv_heads % h == 0 or h % m.kv_heads == 0)


@dataclass
class Request:
    model: ModelConfig
    hardware: Hardware
    gpus: int
    seq_len: int                         # tokens per sequence
    gpus_per_node: int = 8
    global_batch: int = 0                # sequences per optimizer step over the whole job; 0 = gpus
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)   # sequences per data-parallel rank per micro-batch
    recomputes: tuple[str, ...] = ("none", "full", "selective")
    offload_fractions: tuple[float, ...] = OFFLOAD_FRACTIONS
    offload_skip_last: int = 1
    loss_chunks: tuple[int, ...] = (0, 4096)
    block_chunks: tuple[int, ...] = (0, 16384)   # > 0 only with full / selective
    # > 0 only with block chunks (the regime where a rank's tokens no longer fit whole), each with the
    # core's state on the device or in host memory
    attention_chunks: tuple[int, ...] = (0, 65536)
    attention_offloads: tuple[bool, ...] = (False, True)
    doc_mask: bool = True
    # attention work of the documents / plain causal (planner/documents.py); 1.0 = one document
    # per sequence (the conservative default), `longctx plan --store` measures it
    doc_work: float = 1.0
    doc_work_source: str = "no --store: one document per sequence assumed"
    # MoE models: expert-parallel degrees to try (None: 1 and the largest in one node, expert_degrees()),
    # the planned receive skew of the most loaded expert rank (its routed rows over an even
    # share; "max" in the CLI: the most routing allows), and memory.expert_chunk values
    expert_degrees: tuple[int, ...] | None = None
    expert_skew: float = 2.0
    expert_chunks: tuple[int, ...] = (0, 16384)
    # memory.model_states tiers to try, in the order tried: a candidate takes the first that fits
    model_states: tuple[str, ...] = TIERS
    # lossy choices the user allows the plan to make ("co2": CO2's local rounds change convergence; without
    # it co2 plans are estimated and reported beside the plan, never chosen), and co2's local steps to try
    allow: tuple[str, ...] = ()
    co2_local_steps: tuple[int, ...] = CO2_LOCAL_STEPS

    def __post_init__(self):
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {self.gpus}.")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(
                f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; use a multiple of "
                f"{self.gpus_per_node} or set --gpus-per-node.")
        if not self.global_batch:
            self.global_batch = self.gpus
        if self.global_batch < 1:
            raise ConfigError(f"--global-batch must be at least 1 sequence, got {self.global_batch}.")
        if not 0 < self.doc_work <= 1:
            raise ConfigError(f"doc_work (the documents' share of causal attention work) must be in (0, 1], "
                              f"got {self.doc_work}.")
        bad = [t for t in self.model_states if t not in TIERS] or ([] if self.model_states else ["(none)"])
        if bad:
            raise ConfigError(f"unknown model-state tier(s) {bad}; choose among {', '.join(TIERS)}.")
        self.model_states = tuple(t for t in TIERS if t in self.model_states)  # tried cheapest first
        check_levels(self.hardware, self.gpus_per_node)
        if set(self.allow) - {"co2"} or not self.co2_local_steps or min(self.co2_local_steps) < 1:
            raise ConfigError(f"--allow takes co2 (or nothing), got {','.join(self.allow)}; --co2-local-steps "
                              f"takes integers >= 1, got {self.co2_local_steps}.")
        bad = [c for c in self.recomputes if c not in _POLICY_ORDER]
        if bad:
            raise ConfigError(f"unknown recompute policy {bad}; choose among none, full, selective.")
        if self.expert_skew < 1:
            raise ConfigError(f"the expert skew is the most loaded expert rank's routed rows over an even share, "
                              f"at least 1; got {self.expert_skew}.")
        if self.expert_degrees and not self.model.is_moe:
            raise ConfigError("expert-parallel degrees were given for a model without Mixture-of-Experts layers; "
                              "drop them or choose a MoE model (model.moe.experts > 0).")
        bad = [x for x in (self.expert_degrees or ()) if x < 1 or self.gpus % x or self.model.moe_experts % x]
        if bad:
            raise ConfigError(f"expert-parallel degree(s) {bad} must divide both the GPUs ({self.gpus}) and the "
                              f"experts ({self.model.moe_experts}).")


@dataclass
class PlanResult:
    request: Request
    ranked: list[Estimate]               # feasible first, by predicted step time
    evaluated: int
    seconds: float
    suggestions: list[str] = field(default_factory=list)
    co2_plans: list[Estimate] = field(default_factory=list)  # feasible co2 plans held out: co2 not allowed

    @property
    def feasible(self) -> list[Estimate]:
        return [e for e in self.ranked if e.feasible]

    @property
    def best(self) -> Estimate | None:
        f = self.feasible
        return f[0] if f else None


# full + offload moves only block inputs: halves and whole are the useful points
FULL_OFFLOAD_FRACTIONS = (0.5, 1.0)


def policies(req: Request) -> list[MemoryPolicy]:
    out = _policies(req)
    if req.model.is_moe:  # the experts' rows in checkpointed pieces: with and without
        out = [dataclasses.replace(p, expert_chunk=c) for p in out for c in req.expert_chunks]
    return out


def _policies(req: Request) -> list[MemoryPolicy]:
    out = []
    for rc in req.recomputes:
        fractions = {"none": (), "selective": req.offload_fractions,
                     "full": tuple(a for a in req.offload_fractions if a in FULL_OFFLOAD_FRACTIONS)}[rc]
        for lc in req.loss_chunks:
            for bc in req.block_chunks if rc != "none" else (0,):
                for ac, ah in [(0, False)] + [(ac, ah) for ac in req.attention_chunks if ac and bc
                                              for ah in req.attention_offloads]:
                    out += [MemoryPolicy(rc, a, req.offload_skip_last, lc, bc, ac, ah) for a in (0.0, *fractions)]
                    if rc == "full" and req.offload_skip_last:
                        # full keeps a block's input only: offloading the last one too costs one transfer
                        out += [MemoryPolicy(rc, a, 0, lc, bc, ac, ah) for a in fractions]
    return out


def candidate_shapes(req: Request) -> list[MeshShape]:
    """Every mesh shape of req.gpus ranks that the model's heads and the sequence allow."""
    m, G, n = req.model, req.gpus_per_node, req.gpus
    degrees = expert_degrees(req)
    out = []
    for h in divisors(n):
        if not head_degree_ok(m, h):
            continue
        for c in divisors(n // h):
            if req.seq_len % (2 * h * c):
                continue
            dp = n // (h * c)
            if req.global_batch % dp:
                continue
            windows = [0]
            if c > 1 and h * c > G:  # a Double-Ring only helps when the context group leaves the node
                for placement in ("head-first", "ctx-first"):
                    span = h if placement == "head-first" else 1
                    fit = [w for w in divisors(c) if 1 < w < c and span * w <= G]
                    if fit and max(fit) not in windows:
                        windows.append(max(fit))
            placements = ("head-first", "ctx-first") if h > 1 and c > 1 else ("head-first",)
            for r in divisors(dp):
                for placement in placements:
                    for w in windows:
                        for x in degrees:
                            for s in with_zero_pp(MeshShape(r, dp // r, h, c, w, placement, x), G):
                                out += [s, *slow_link_variants(s, req.hardware, G, co2=True)]
    return out


# parallel.zero_pp tried for an FSDP group that spans nodes: ZeRO++ whole (hpz alone, exact, saves only
# backward's gather: tried too, it tripled the search for plans it seldom wins; `--zero-pp` is to come)
ZERO_PP_TRIED = ("hpz,qwz,qgz",)
ZERO_PP_ORDER = ("", *ZERO_PP_TRIED)  # a tie goes to plain FSDP: quantising is lossy


def with_zero_pp(shape: MeshShape, gpus_per_node: int) -> list[MeshShape]:
    """`shape`, and when its FSDP group spans nodes the same layout under each ZERO_PP_TRIED (the
    node: the group's ranks in one node)."""
    if shape.fsdp <= gpus_per_node or shape.fsdp % gpus_per_node:
        return [shape]
    return [shape, *(dataclasses.replace(shape, zero_pp=z, node=gpus_per_node) for z in ZERO_PP_TRIED)]


def expert_degrees(req: Request) -> tuple[int, ...]:
    """The expert-parallel degrees to try: 1 for a dense model; for a MoE model those given, or 1 and
    the largest degree that divides the experts and the GPUs (parallel.expert folds over every
    rank) and keeps an expert group in one node. Across nodes every MoE layer's all-to-alls would
    ride the slow links four times per micro-batch; a smaller group moves fewer rows but gathers
    more experts, between the two. Each degree multiplies the search, so the others are tried when
    named (--expert 2,4,8)."""
    m = req.model
    if not m.is_moe:
        return (1,)
    if req.expert_degrees:
        return tuple(req.expert_degrees)
    fit = [x for x in divisors(req.gpus) if m.moe_experts % x == 0 and x <= req.gpus_per_node]
    return tuple(sorted({1, max(fit)}))


def step_text(step_s: float) -> str:
    """A predicted step time as the table shows it (4 significant digits); the ranking sorts by it."""
    return f"{step_s:.4g}"


def _sort_key(e: Estimate):
    """Feasible plans by step time as shown (ties: device states, plain FSDP transfers, simpler policy,
    less memory); infeasible ones by memory.

    The key is the step time the table prints, not the unrounded one nor a tolerance band: a band
    (say "within 0.5% is a tie, prefer the simpler policy") ranks 0.08921 s above 0.08918 s, which
    reads as a wrong order; times equal to the shown digits are the only ties."""
    p = e.policy
    if not e.feasible:
        return (1, e.memory["total"] + e.host_per_node, e.step_s)
    s = e.mesh_shape  # ties: sync before co2 (convergence), hpZ on the node before a group (less memory)
    return (0, float(step_text(e.step_s)), TIERS.index(e.model_states), ZERO_PP_ORDER.index(s.zero_pp),
            s.data_parallel == "co2", s.hpz_ranks, _POLICY_ORDER[p.recompute], p.offload_fraction,
            round(e.memory["total"] / 2**30),
            p.loss_chunk, p.block_chunk != 0, -p.block_chunk, p.attention_chunk != 0, p.attention_offload,
            e.mesh_shape.dp_replicate, e.mesh_shape.window, p.expert_chunk, e.mesh_shape.expert)


def plan(req: Request, keep_infeasible: bool = True, explain: bool = True) -> PlanResult:
    """Every candidate, feasible ones ranked by predicted step time. keep_infeasible: when nothing
    fits, rank the infeasible candidates too (by memory), for the table and the suggestions; when
    something fits they are never estimated (the table lists feasible plans only)."""
    t0 = time.perf_counter()
    acts_cache: dict = {}
    results, evaluated = _evaluate(req, False, acts_cache)
    if keep_infeasible and not results:
        results, more = _evaluate(req, True, acts_cache)
        evaluated += more
    results.sort(key=_sort_key)
    held = [] if "co2" in req.allow else [e for e in results if e.mesh_shape.data_parallel == "co2"]
    results = [e for e in results if e.mesh_shape.data_parallel != "co2"] if held else results
    res = PlanResult(req, results, evaluated, time.perf_counter() - t0, co2_plans=[e for e in held if e.feasible])
    if explain and not res.feasible:
        res.suggestions = suggest(req, res)
    return res


def _evaluate(req: Request, keep_infeasible: bool, acts_cache: dict) -> tuple[list[Estimate], int]:
    hw, m = req.hardware, req.model
    pols = policies(req)
    # every policy in both gradient-sync variants, in policy order, and what the checks below compare
    # each with, made once (not per shape and micro-batch: tens of thousands of dataclass copies)
    by_sync = {g: [dataclasses.replace(p, grad_sync=g) for p in pols] for g in ("step", "micro_batch")}
    in_order = {syncs: [by_sync[g][i] for i in range(len(pols)) for g in syncs]
                for syncs in (("step",), ("step", "micro_batch"))}
    as_step = {v: s for g in by_sync for v, s in zip(by_sync[g], by_sync["step"])}
    unchunked = {v: dataclasses.replace(v, expert_chunk=0) for g in by_sync for v in by_sync[g] if v.expert_chunk}
    results: list[Estimate] = []
    evaluated = 0
    for shape in candidate_shapes(req):
        # model states alone, in each tier: prune every policy of this shape if none of them fits
        static = {t: sum(device_state_bytes(m, shape, t, hw.dtype_bytes).values()) for t in req.model_states}
        if min(static.values()) > hw.usable_memory_bytes and not keep_infeasible:
            continue
        dp_share = req.global_batch // shape.dp if req.global_batch % shape.dp == 0 else 0
        for mb in req.micro_batches:
            if not dp_share or dp_share % mb:
                continue
            tokens = mb * req.seq_len // shape.sequence_degree
            # with accumulation, reducing per micro-batch trades traffic for the unsharded gradients
            syncs = ("step", "micro_batch") if dp_share // mb > 1 and shape.world > 1 else ("step",)
            fit_whole = set()  # policies that fit with the experts' rows whole (expert_chunk 0)
            for pol in in_order[syncs]:
                if pol.block_chunk and pol.block_chunk >= tokens:
                    continue  # one chunk: the same as whole blocks
                if pol.expert_chunk and unchunked[pol] in fit_whole:
                    continue  # expert pieces only add recomputation where whole rows fit
                if pol.attention_chunk and pol.attention_chunk >= tokens * shape.head:
                    continue  # the core's tokens (after the head all-to-all) fit one chunk
                # activations and the backward transient (which the Double-Ring window changes): the same
                key = (shape.head, shape.ctx, shape.window, shape.expert, mb, as_step[pol])
                if key not in acts_cache:
                    acts_cache[key] = rank_activations(m, req.seq_len, mb, shape, pol, hw.dtype_bytes, req.doc_mask,
                                                       req.expert_skew)
                kept, n = _tiers(req, shape, mb, pol, *acts_cache[key], static, keep_infeasible)
                evaluated += n
                if kept and kept[-1].feasible and not pol.expert_chunk:
                    fit_whole.add(pol)
                results += kept
    return results, evaluated


def _tiers(req: Request, shape: MeshShape, mb: int, pol: MemoryPolicy, acts, transient: float,
           static: dict[str, float], keep_infeasible: bool) -> tuple[list[Estimate], int]:
    """One candidate in the first model-state tier that fits, tried in req.model_states' order
    (device, host_optimizer, host): for the same layout, policy and micro-batch a host tier adds
    host-link and host AdamW time to the same compute, so it is never faster than a tier before it
    that fits, and holds no less in host memory. Returns (the estimates kept, the number made):
    with keep_infeasible every tier tried when none fits, else only a feasible one."""
    hw, made = req.hardware, []
    grad_accum = max(1, req.global_batch // (shape.dp * mb))
    # co2 keeps its outer state beside the weights on the device (config/data_parallel.py)
    for tier in req.model_states if shape.data_parallel != "co2" else ("device",)[:"device" in req.model_states]:
        if not keep_infeasible and (static[tier] + acts.total_device + transient > hw.usable_memory_bytes or
                                    memory_bytes(req.model, shape, pol, grad_accum, hw.dtype_bytes, acts, transient,
                                                 tier)["total"] > hw.usable_memory_bytes):
            continue  # the GPU's memory alone rules it out (estimate's own sum, before its time)
        est = estimate(req.model, hw, shape, pol, seq_len=req.seq_len, global_batch=req.global_batch,
                       micro_batch=mb, gpus_per_node=req.gpus_per_node, doc_mask=req.doc_mask,
                       doc_work=req.doc_work, acts=acts, transient=transient, expert_skew=req.expert_skew,
                       model_states=tier, co2_steps=req.co2_local_steps)
        made.append(est)
        if est.feasible:
            return [est], len(made)
        if est.host_per_node > hw.usable_host_bytes and not keep_infeasible:
            break  # the tiers after it keep more in host memory, not less
    return (made if keep_infeasible else []), len(made)


def _first_feasible(req: Request, **changes) -> Estimate | None:
    r = dataclasses.replace(req, **changes)
    return plan(r, keep_infeasible=False, explain=False).best


def _host_memory_suggestion(req: Request, res: PlanResult) -> list[str]:
    """When plans fit the GPU but not the host: the least host memory one of them needs, by part,
    against the hardware's, and the host memory per node that makes the request feasible."""
    hw = req.hardware
    fit_gpu = [e for e in res.ranked if e.memory["total"] <= hw.usable_memory_bytes]
    if not fit_gpu or not hw.usable_host_fraction:
        return []
    e = min(fit_gpu, key=lambda e: e.host_per_node)
    ranks = e.host_per_node / e.host["total"] if e.host.get("total") else 1
    parts = ", ".join(f"{k.replace('_', ' ')} {v * ranks / 2**30:.1f}" for k, v in e.host.items()
                      if k != "total" and v * ranks >= 2**30 / 10)
    need = e.host_per_node / hw.usable_host_fraction / 2**30
    text = (f"plans that fit the GPU need host memory the hardware does not have: at least "
            f"{e.host_per_node / 2**30:.1f} GiB per node ({e.mesh_shape.describe()}, {e.policy.describe()}, "
            f"model states {e.model_states}: {parts}) against {hw.usable_host_bytes / 2**30:.1f} GiB usable of "
            f"{hw.host_memory_gib:g}")
    for gib in sorted({math.ceil(need / 16) * 16, math.ceil(need / 64) * 64, 2 ** math.ceil(math.log2(need))}):
        if _first_feasible(req, hardware=hw.replace(host_memory_gib=gib)):
            return [f"{text}; nodes with {gib:,} GiB of host memory (--hw host_memory_gib={gib}) make it feasible"]
    return [text]


def suggest(req: Request, res: PlanResult) -> list[str]:
    """What would make an infeasible request feasible."""
    out = []
    if not res.ranked:
        units = sorted({2 * h * c for h in divisors(req.gpus) if head_degree_ok(req.model, h)
                        for c in divisors(req.gpus // h)})
        out.append(f"no layout of {req.gpus} GPUs divides the sequence: {req.seq_len} tokens must be divisible by "
                   f"2 x head x ctx (one of {units[:8]}); choose a sequence length that is a multiple of "
                   f"{units[-1]}, or a multiple of {units[0]} with fewer sequence-parallel ranks")
        return out
    least = min(res.ranked, key=lambda e: e.memory["total"])
    out.append(f"the least GPU memory any plan needs is {least.memory['total'] / 2**30:.1f} GiB per GPU "
               f"({least.mesh_shape.describe()}, {least.policy.describe()}; "
               f"{req.hardware.usable_memory_bytes / 2**30:.1f} GiB usable)"
               + (f", and then: {'; '.join(least.problems)}" if least.problems else ""))
    if req.hardware.host_memory_gib and req.hardware.usable_host_fraction and not any(
            a > 0 for a in req.offload_fractions):
        with_offload = {"offload_fractions": OFFLOAD_FRACTIONS,
                        "recomputes": tuple(sorted(set(req.recomputes) | {"selective"}))}
        if _first_feasible(req, **with_offload):
            out.append("activation offload (memory.offload_fraction with full or selective recomputation) makes "
                       "it feasible")
        else:
            for factor in (2, 4, 8):
                host = req.hardware.host_memory_gib * factor
                if _first_feasible(req, hardware=req.hardware.replace(host_memory_gib=host), **with_offload):
                    out.append(f"activation offload makes it feasible with {host:,.0f} GiB of host memory per node "
                               f"(--hw host_memory_gib={host:.0f})")
                    break
    host_text = _host_memory_suggestion(req, res)
    out += host_text
    if not host_text and least.host_per_node > req.hardware.usable_host_bytes and req.hardware.host_memory_gib:
        need = least.host_per_node / req.hardware.usable_host_fraction / 2**30
        out.append(f"nodes with >= {need:,.0f} GiB of host memory (--hw host_memory_gib=...) would hold the "
                   f"offloaded activations")
    if (0 not in req.loss_chunks or len(req.loss_chunks) == 1) and _first_feasible(req, loss_chunks=(0, 4096)):
        out.append("a chunked LM head + loss (memory.loss_chunk) makes it feasible")
    g = req.gpus
    for _ in range(6):
        g *= 2
        if g > req.gpus_per_node and g % req.gpus_per_node:
            continue  # not whole nodes: Request would refuse it
        if _first_feasible(req, gpus=g, global_batch=req.global_batch * g // req.gpus):
            out.append(f"{g} GPUs make it feasible")
            break
    seq = req.seq_len
    for _ in range(8):
        seq //= 2
        if seq < 2 * req.gpus and seq < 1024:
            break
        if _first_feasible(req, seq_len=seq):
            out.append(f"a sequence of {seq:,} tokens fits on {req.gpus} GPUs")
            break
    return out
