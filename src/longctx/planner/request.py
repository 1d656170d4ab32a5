"""A planning request and the candidates it spans: mesh shapes (dp_replicate, dp_shard, head, ctx,
window, placement, expert degree, ZeRO++ and co2 variants) and memory policies (recompute, offload
fraction, loss / block / attention chunks, attention offload, expert chunks). planner/search.py
prices and ranks them.

Never generated: head degrees that do not divide the query heads (or split kv heads unevenly),
sequence degrees for which the sequence is not divisible by 2 x head x ctx, Double-Ring windows
other than the largest whose inner ring fits in one node (outer hops cross nodes, inner hops stay
on NVLink); slow links: ZeRO++ where the FSDP group spans nodes, hpZ on a node's group on
three-level hardware, co2 where replicas span nodes (ranked only under Request.allow;
planner/slow_links.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..config.divisors import LISTED_UP_TO, divisors
from ..costs.hardware import Hardware
from ..costs.host_bytes import TIERS
from ..costs.shape import MeshShape
from ..errors import ConfigError
from ..job.checks import expert_shards_split
from ..memory.policy import MemoryPolicy
from .cost import RunSettings
from .expert_copies import check_expert_replicas, replica_counts
from .expert_nodes import check_expert_nodes, node_sizes
from .slow_links import CO2_LOCAL_STEPS, check_levels, slow_link_variants

OFFLOAD_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
_POLICY_ORDER = {"none": 0, "selective": 1, "full": 2}


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
        if not math.isfinite(value):  # (inf, nan, 1e400: int() of it was an OverflowError / ValueError traceback)
            raise ConfigError(f"'{text}' is not a token count; write e.g. 4096, 128K or 1M (K = 1024, M = 1048576).")
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
    # parallel.expert_replicas (FlexMoE's copy slots per rank) to try where expert > 1 (planner/expert_copies.py);
    # (0,): none, as before they were costed
    expert_replicas: tuple[int, ...] = (0,)
    # parallel.expert_ranks_per_node (hierarchical dispatch) tried beside the flat exchange where it splits an expert
    # degree into whole nodes (planner/expert_nodes.py); 0: never, as before it was costed
    expert_ranks_per_node: int = 0
    # memory.model_states tiers to try, in the order tried: a candidate takes the first that fits
    model_states: tuple[str, ...] = TIERS
    # lossy choices the user allows the plan to make ("co2": CO2's local rounds change convergence; without
    # it co2 plans are estimated and reported beside the plan, never chosen), and co2's local steps to try
    allow: tuple[str, ...] = ()
    co2_local_steps: tuple[int, ...] = CO2_LOCAL_STEPS
    # the config's settings the plan keeps and costs (checkpoint.async, co2's outer momentum and overlap,
    # FSDP's blocks per unit, ZeRO++'s quantization block)
    settings: RunSettings = RunSettings()

    def __post_init__(self):
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {self.gpus}.")
        if self.gpus > LISTED_UP_TO:  # (the mesh shapes are the GPU count's divisors, listed up to 10**12)
            raise ConfigError(f"--gpus must be at most 10**12, got {self.gpus}: check it for a typo.")
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
        if self.offload_skip_last < 0:  # (-1 was taken: layers + 1 blocks counted as offloaded, one past the model)
            raise ConfigError(f"--offload-skip-last must be >= 0 (0 = every block may be offloaded), got "
                              f"{self.offload_skip_last}.")
        if not 0 < self.doc_work <= 1:
            raise ConfigError(f"doc_work (the documents' share of causal attention work) must be in (0, 1], "
                              f"got {self.doc_work}.")
        bad = [t for t in self.model_states if t not in TIERS] or ([] if self.model_states else ["(none)"])
        if bad:
            raise ConfigError(f"--model-states: unknown model-state tier(s) {bad}; choose among {', '.join(TIERS)}.")
        self.model_states = tuple(t for t in TIERS if t in self.model_states)  # tried cheapest first
        check_hardware(self.hardware)
        check_levels(self.hardware, self.gpus_per_node)
        if set(self.allow) - {"co2"} or not self.co2_local_steps or min(self.co2_local_steps) < 1:
            raise ConfigError(f"--allow takes co2 (or nothing), got {','.join(self.allow)}; --co2-local-steps "
                              f"takes integers >= 1, got {self.co2_local_steps}.")
        if self.settings.co2_overlap_steps > max(self.co2_local_steps):
            raise ConfigError(f"train.co2_overlap_steps = {self.settings.co2_overlap_steps} needs co2 rounds of at "
                              f"least that many local steps, but --co2-local-steps tries at most "
                              f"{max(self.co2_local_steps)}; pass --co2-local-steps with values >= "
                              f"{self.settings.co2_overlap_steps}, or a smaller train.co2_overlap_steps.")
        bad = [c for c in self.recomputes if c not in _POLICY_ORDER]
        if bad or not self.recomputes:  # (none: "no plan fits" blamed the micro-batches)
            said = f"--recompute: unknown recompute policy {bad}" if bad else "--recompute names no policy"
            raise ConfigError(f"{said}; choose among none, full, selective.")
        if not self.expert_skew >= 1:  # (NaN too: it reached the search as a row count)
            raise ConfigError(f"the expert skew is the most loaded expert rank's routed rows over an even share, "
                              f"at least 1; got {self.expert_skew}.")
        if self.expert_degrees and not self.model.is_moe:
            raise ConfigError("expert-parallel degrees were given for a model without Mixture-of-Experts layers; "
                              "drop them or choose a MoE model (model.moe.experts > 0).")
        bad = [x for x in (self.expert_degrees or ()) if x < 1 or self.gpus % x or self.model.moe_experts % x]
        if bad:
            raise ConfigError(f"expert-parallel degree(s) {bad} must divide both the GPUs ({self.gpus}) and the "
                              f"experts ({self.model.moe_experts}).")
        check_expert_replicas(self.model, self.expert_replicas, expert_degrees(self))
        check_expert_nodes(self.expert_ranks_per_node, expert_degrees(self), self.gpus_per_node, self.model.is_moe)
        m = self.model
        unsplit = [x for x in (self.expert_degrees or ()) if not expert_shards_split(m, self.gpus, x)]
        if unsplit:
            raise ConfigError(f"expert-parallel degree(s) {unsplit} on {self.gpus} GPUs leave expert-data groups "
                              f"({', '.join(str(self.gpus // x) for x in unsplit)} GPUs) that divide neither "
                              f"model.dim ({m.dim}) nor model.moe.expert_dim ({m.resolved_expert_dim}), one of which "
                              f"FSDP shards each expert's weights on (job/checks.py); choose others.")


# hardware fields the cost model divides by (> 0), and fractions of a peak or a capacity (<= 1; a percentage
# such as gemm_efficiency = 70 would plan 70x the peak). attention_efficiency is a fraction of the GEMM peak
# that a CPU calibration may measure above 1, and host_memory_gib may be 0 (no host tier; then its fraction is
# unread)
POSITIVE_FIELDS = ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "host_link_gbps", "gemm_efficiency",
                   "attention_efficiency", "all_to_all_efficiency", "usable_memory_fraction",
                   "host_adam_gparams_per_s")
FRACTION_FIELDS = ("gemm_efficiency", "all_to_all_efficiency", "usable_memory_fraction", "usable_host_fraction",
                   "comm_overlap")


def check_hardware(hw: Hardware) -> None:
    """Every hardware figure the plan is computed from within its meaning, before any planning: one
    error naming each field out of range (--hw KEY=VALUE or the hardware file)."""
    import math

    problems = [f"{k} = {getattr(hw, k)} must be > 0" for k in POSITIVE_FIELDS
                if not (getattr(hw, k) > 0 and math.isfinite(getattr(hw, k)))]
    problems += [f"{k} = {getattr(hw, k)} must be a fraction in [0, 1]" for k in FRACTION_FIELDS
                 if not 0 <= getattr(hw, k) <= 1]
    if hw.host_memory_gib > 0 and not hw.usable_host_fraction > 0:
        problems.append(f"usable_host_fraction = {hw.usable_host_fraction} must be > 0 with host memory "
                        f"({hw.host_memory_gib} GiB per node; host_memory_gib = 0 for none)")
    if hw.dtype_bytes not in (2, 4):
        problems.append(f"dtype_bytes = {hw.dtype_bytes} must be 2 (bf16) or 4 (fp32)")
    if problems:
        raise ConfigError(f"hardware {hw.name}: {'; '.join(dict.fromkeys(problems))}. Fix the --hw override or the "
                          f"hardware file.")


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
            placements = ("head-first", "ctx-first") if h > 1 and c > 1 else ("head-first",)
            for r in divisors(dp):
                for placement in placements:
                    for w in double_ring_windows(h, c, G, placement):
                        for x in degrees:
                            for copies in replica_counts(req, x):
                                for nodes in node_sizes(req.expert_ranks_per_node, x, copies):
                                    base = MeshShape(r, dp // r, h, c, w, placement, x, expert_replicas=copies,
                                                     expert_ranks_per_node=nodes)
                                    for s in with_zero_pp(base, G, req.settings.zero_pp_block):
                                        out += [s, *slow_link_variants(s, req.hardware, G, co2=True)]
    return out


def double_ring_windows(h: int, c: int, gpus_per_node: int, placement: str) -> tuple[int, ...]:
    """0 (one plain ring), and where the context group leaves the node (a Double-Ring only helps then) the largest
    window whose inner ring fits in one node under `placement`: head-first puts a ring's ranks h apart, so w of
    them span h x w ranks; ctx-first, w. Each placement its own: head-first with ctx-first's window was tried too,
    its inner ring across nodes (llama3-70b on 64 x H100 at 1M listed `head2xctx32/w8 hf` 4th), against the
    design above (tests/unit/test_plansearch_fuzz118.py)."""
    if c < 2 or h * c <= gpus_per_node:
        return (0,)
    span = h if placement == "head-first" else 1
    fit = [w for w in divisors(c) if 1 < w < c and span * w <= gpus_per_node]
    return (0, max(fit)) if fit else (0,)


# parallel.zero_pp tried for an FSDP group that spans nodes: ZeRO++ whole (hpz alone, exact, saves only
# backward's gather: tried too, it tripled the search for plans it seldom wins; `--zero-pp` is to come)
ZERO_PP_TRIED = ("hpz,qwz,qgz",)
ZERO_PP_ORDER = ("", *ZERO_PP_TRIED)  # a tie goes to plain FSDP: quantising is lossy


def with_zero_pp(shape: MeshShape, gpus_per_node: int, quant_block: int = 512) -> list[MeshShape]:
    """`shape`, and when its FSDP group spans nodes the same layout under each ZERO_PP_TRIED (the
    node: the group's ranks in one node; quant_block: parallel.zero_pp_block, as the config has it)."""
    if shape.fsdp <= gpus_per_node or shape.fsdp % gpus_per_node:
        return [shape]
    return [shape, *(dataclasses.replace(shape, zero_pp=z, node=gpus_per_node, quant_block=quant_block)
                     for z in ZERO_PP_TRIED)]


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
    fit = [x for x in divisors(req.gpus) if m.moe_experts % x == 0 and x <= req.gpus_per_node
           and expert_shards_split(m, req.gpus, x)]  # (else FSDP cannot shard the experts: job/checks.py)
    return tuple(sorted({1, max(fit)}))
