"""Gradient buckets: how many transformer blocks share one FSDP unit, so that one reduce-scatter
carries all of their gradients (FSMoE's adaptive gradient partitioning, on FSDP2's units).

FSDP2 reduce-scatters a unit's gradients once the backward has produced all of them, on a stream of
its own (one lane: its reduce-scatters run one after another), while the backward goes on through
the blocks below. So the transfers hide behind the rest of the backward, except what is left when
the backward ends. The number of blocks per unit trades:
- a fixed cost per collective (latency and launch): more units, more of it;
- the tail: a unit's transfer starts only when its last block's backward is done, and the last
  unit reduced (the one holding block 0) has nothing left to hide behind.
`exposed_seconds` simulates that lane for given bucket sizes from per-block backward time,
per-block reduce-scatter time and a latency; `plan_buckets` picks the size with the least exposed
time (ties: the smaller, since FSDP gathers a unit's parameters whole, and a larger unit holds more
of the model unsharded at once; for the same reason at most a quarter of the blocks per bucket).
The buckets are uniform from the top of the model and the remainder is placed at the bottom: the
bucket reduced last, block 0's, is the smallest, so the tail is as short as it can be.

The per-block figures come from the planner's cost model (costs/timing.py, model_states.py) for
the hardware the run is on (the CUDA device's name: h100, h200, a800; otherwise h100). On a CPU,
gloo's reduce-scatter blocks the backward (no overlap), so every transfer is exposed and the fewest
collectives win: the largest bucket allowed. The expert weights' units (their own mesh under expert
parallelism) are grouped by the same buckets.

`parallel.grad_bucket_blocks`: 0 = this plan; N = N blocks per bucket. The plan is logged at the
start of a run, and the reduce-scatter time each step leaves exposed is measured (ReduceScatterTimer,
below) and logged as `grad_reduce_exposed_s`. Not counted: HSDP's all-reduce across replicas. The
planner's memory model counts a given N (two units of N blocks gathered, one unit's fp32 gradient:
costs/model_states.py gathered_param_bytes); 0, chosen here at the start, is refused by `longctx plan`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from ...config import ModelConfig

# a reduce-scatter's fixed cost: NCCL's small-message latency inside a node and across (an assumption,
# ~2-3x the links' own latency in bench/emulated_link.py; FSDP's copy-in and copy-out come on top)
LATENCY_S = {"intra": 20e-6, "inter": 40e-6}
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class BucketPlan:
    sizes: tuple[int, ...]   # blocks per bucket, in forward order (the first holds block 0)
    chosen_by: str           # "cost model" or "parallel.grad_bucket_blocks"
    exposed_s: float | None  # predicted reduce-scatter time the backward does not hide (None: no model)
    comm_s: float | None     # predicted reduce-scatter time in all
    hardware: str = ""

    def groups(self) -> list[range]:
        """The blocks of each bucket, in forward order."""
        starts = [0, *itertools.accumulate(self.sizes)]
        return [range(a, b) for a, b in zip(starts, starts[1:])]

    def describe(self) -> str:
        per = self.sizes[-1]
        shape = f"{len(self.sizes)} x {per}" if len(set(self.sizes)) == 1 else \
            f"{self.sizes[0]} (block 0's) + {len(self.sizes) - 1} x {per}"
        text = f"gradient buckets: {len(self.sizes)} reduce-scatters, blocks per bucket {shape}, by {self.chosen_by}"
        if self.exposed_s is not None:
            text += (f"; predicted on {self.hardware}: {self.exposed_s * 1e3:.3g} ms of {self.comm_s * 1e3:.3g} ms "
                     f"exposed per backward")
        return text


def bucket_sizes(blocks: int, per_bucket: int) -> tuple[int, ...]:
    """Buckets of `per_bucket` blocks from the top, the remainder (if any) first: block 0's bucket."""
    full, rest = divmod(blocks, per_bucket)
    return ((rest,) if rest else ()) + (per_bucket,) * full


def exposed_seconds(sizes, block_bwd_s: float, block_reduce_s: float, latency_s: float,
                    overlap: bool = True) -> float:
    """Reduce-scatter time left when the backward ends. The backward runs the buckets last-first;
    a bucket's transfer (latency + its blocks' bytes) starts when its blocks' backward is done and
    the lane is free. Without overlap (gloo on a CPU) every transfer blocks the backward."""
    if not overlap:
        return sum(latency_s + n * block_reduce_s for n in sizes)
    compute = lane = 0.0
    for n in reversed(sizes):
        compute += n * block_bwd_s
        lane = max(lane, compute) + latency_s + n * block_reduce_s
    return max(0.0, lane - compute)


def plan_buckets(blocks: int, block_bwd_s: float, block_reduce_s: float, latency_s: float,
                 overlap: bool = True, max_per_bucket: int = 0, hardware: str = "") -> BucketPlan:
    """The bucket size (1 .. max_per_bucket, default a quarter of the blocks) with the least
    predicted exposed time; ties go to the smaller."""
    cap = max(1, min(blocks, max_per_bucket or blocks // 4))
    best = None
    for per in range(1, cap + 1):
        sizes = bucket_sizes(blocks, per)
        exposed = exposed_seconds(sizes, block_bwd_s, block_reduce_s, latency_s, overlap)
        if best is None or exposed < best[0] - 1e-12:
            best = (exposed, sizes)
    exposed, sizes = best
    comm = sum(latency_s + n * block_reduce_s for n in sizes)
    return BucketPlan(sizes, "cost model", exposed, comm, hardware)


def _hardware_for():
    from ...costs.hardware import get_hardware  # the planner imports parallel/: imported when used

    name = torch.cuda.get_device_name().lower()
    for preset in ("h200", "h100", "a800"):
        if preset in name or (preset == "a800" and "a100" in name):
            return get_hardware(preset)
    return get_hardware("h100")


def plan_for(m: ModelConfig, per_bucket: int, tokens: int, seq_len: int, fsdp_ranks: int, expert: int,
             device_type: str) -> BucketPlan:
    """The plan a run uses: `per_bucket` blocks (parallel.grad_bucket_blocks) or, for 0, the cost
    model's choice for this model, `tokens` per rank and micro-batch, and an FSDP group of
    `fsdp_ranks` ranks."""
    from ...costs.model_states import param_counts  # (as above)
    from ...costs.timing import causal_attention_flops, forward_gemm_flops

    blocks = m.layers
    if per_bucket:
        return BucketPlan(bucket_sizes(blocks, min(per_bucket, blocks)), "parallel.grad_bucket_blocks", None, None)
    if device_type != "cuda":  # every transfer blocks the backward: the fewest collectives allowed
        return BucketPlan(bucket_sizes(blocks, max(1, blocks // 4)), "cost model (CPU: gloo blocks the backward)",
                          None, None)
    hw = _hardware_for()
    rate = hw.peak_flops * hw.gemm_efficiency
    attn_rate = hw.peak_flops * hw.attention_efficiency
    block_fwd = (forward_gemm_flops(m, tokens) / rate + causal_attention_flops(m, tokens, seq_len) / attn_rate) / blocks
    intra = fsdp_ranks <= GPUS_PER_NODE
    bandwidth = (hw.intra_gbps if intra else hw.inter_gbps) * 1e9
    # fp32 gradients, (n - 1) / n of them leave each rank (costs/timing.py fsdp_transfer_seconds)
    reduce = (fsdp_ranks - 1) / fsdp_ranks * param_counts(m, expert)["block"] * 4 / bandwidth
    return plan_buckets(blocks, 2 * block_fwd, reduce, LATENCY_S["intra" if intra else "inter"],
                        overlap=hw.comm_overlap > 0, hardware=hw.name)


# ----------------------------------------------------------------------------------------------
# measured: the reduce-scatter time a step leaves exposed

try:  # FSDP2's default reduce-scatter, which the timer runs (private in torch; absent before ~2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - older torch: the run goes on unmeasured
    DefaultReduceScatter = None


class ReduceScatterTimer(DefaultReduceScatter or object):
    """FSDP2's own reduce-scatter (the same call, so the same bits), timed; installed on the FSDP
    units by `set_custom_reduce_scatter`. What a step leaves exposed:
    - on a CPU, gloo's reduce-scatter blocks the backward: the wall time of every call;
    - on CUDA the calls run on FSDP's reduce-scatter stream beside the backward. The root unit's
      call (`tail=True`) is issued when the backward is done (the root's gradients come last) and
      the stream runs it after every earlier one, so from its issue on the compute stream to its
      end on the reduce-scatter stream is the time the step waits: CUDA events, read at `take`."""

    def __init__(self, tail: bool = False, inner=None):
        super().__init__()
        self.tail = tail
        self._reduce = inner if inner is not None else super().__call__  # qgz's, or FSDP's own
        self.calls, self.bytes, self.blocked_s = 0, 0, 0.0
        self._marks: list = []  # CUDA, tail: (issued on the compute stream, done on the reduce-scatter stream)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.calls += 1
        self.bytes += input_tensor.numel() * input_tensor.element_size()
        if input_tensor.is_cuda:
            if not self.tail:
                return self._reduce(output_tensor, input_tensor, group, op, async_op)
            issued = torch.cuda.Event(enable_timing=True)
            issued.record(torch.cuda.default_stream(input_tensor.device))
            work = self._reduce(output_tensor, input_tensor, group, op, async_op)
            done = torch.cuda.Event(enable_timing=True)
            done.record()  # on the current stream: FSDP's reduce-scatter stream
            self._marks.append((issued, done))
            return work
        start = time.perf_counter()
        work = self._reduce(output_tensor, input_tensor, group, op, async_op)
        self.blocked_s += time.perf_counter() - start
        return work

    def take(self) -> tuple[int, int, float]:
        """(calls, bytes, exposed seconds) since the last take (waits for the CUDA events)."""
        exposed = self.blocked_s
        for issued, done in self._marks:
            done.synchronize()
            exposed += max(0.0, issued.elapsed_time(done) / 1e3)
        out = (self.calls, self.bytes, exposed)
        self.calls, self.bytes, self.blocked_s, self._marks = 0, 0, 0.0, []
        return out


def time_reduce_scatters(units, root, inner=None) -> list[ReduceScatterTimer]:
    """Install the timers on the FSDP units (one shared by the blocks' units, one on the root), each
    timing `inner` (parallel.zero_pp's qgz) or FSDP's own reduce-scatter; none where this torch has
    no custom reduce-scatter."""
    if DefaultReduceScatter is None or not hasattr(root, "set_custom_reduce_scatter"):
        return []
    blocks, tail = ReduceScatterTimer(inner=inner), ReduceScatterTimer(tail=True, inner=inner)
    for unit in units:
        (unit[0] if isinstance(unit, list) else unit).set_custom_reduce_scatter(blocks)
    root.set_custom_reduce_scatter(tail)
    return [blocks, tail]


def grad_reduce_figures(timers, steps: int) -> dict:
    """A metrics line's gradient-reduction figures, per optimizer step over the last `steps`: the
    reduce-scatter calls, the bytes this rank put in, and the time they left exposed."""
    if not timers or steps < 1:
        return {}
    calls = sent = exposed = 0
    for timer in timers:
        c, b, e = timer.take()
        calls, sent, exposed = calls + c, sent + b, exposed + e
    return {"grad_reduce_calls": calls / steps, "grad_reduce_bytes": sent / steps,
            "grad_reduce_exposed_s": exposed / steps}
