"""The expert-parallel dispatcher: a MoE layer's rows exchanged with the ranks that own their experts.

`ExpertParallelDispatcher` is the `TokenDispatcher` (models/moe.py) of every MoE layer under
expert parallelism, one object for the whole model, installed by parallel/expert/install.py
`use_expert_parallel`. Its dispatch and combine are the one-device permutation (each token's k
rows sorted by expert, and back); its `run_experts` is where the ranks meet. Rows sorted by
expert are also sorted by owner, so a layer call runs:
  1. the counts per expert go to the ranks that own them (a small all-to-all), read on the host:
     they are the variable split sizes of the token all-to-all (the one host read EP needs);
  2. all-to-all of the rows to their experts' owners;
  3. the received rows (source-major) regrouped expert-major, run through the local experts as one
     grouped GEMM per projection, and put back in source-major order;
  4. the reverse all-to-all returns each row to the rank its token lives on.
Backward runs the same way in reverse (AllToAllV's backward swaps the splits).

Its options, chosen from config:
- `chunks` > 1 (parallel.expert_pipeline_chunks): FSMoE's schedule, steps 2-4 in pipelined chunks
  (parallel/expert/pipeline.py); `tuner` (parallel.expert_pipeline_chunks = 0): the chunk count a
  short online profile picks (ChunkTuner);
- `placer` (parallel.expert_replicas > 0): FlexMoE's copies of hot experts (parallel/
  expert/placement.py). A layer's placement is its experts' `placement` attribute (None: every
  expert on its owner only), which the placer sets at the end of each window; the rows then go by
  (rank, slot) instead of by expert.
HierarchicalDispatcher (parallel/expert/hierarchy.py) is this dispatcher over the ranks of one
node, behind a dispatch and combine that cross nodes once per token and node.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ...job import comm
from ...job.split_transfer import SplitTransfer, StartAllToAllV, WaitAllToAllV
from ...models.moe import TokenDispatcher
from ...models.moe_experts import swiglu_experts
from ...ops.eager import eager_under_compile
from .pipeline import PipelinedExperts, chunk_plan, tuning_step
from .placement import copy_slot_weights, own_and_copy_experts


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _expert_major(recv: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received source-major (from source s: recv[s][e] rows of local expert e, in expert
    order) -> the permutation that lists them expert-major (expert e: its rows from source 0, then
    1, ...), and the rows per local expert. A fixed number of operations on the host's counts,
    whatever the number of sources and local experts (no piece per (source, expert))."""
    r = torch.tensor(recv, dtype=torch.long)  # [sources, local]
    total = sum(map(sum, recv))
    src_start = (r.flatten().cumsum(0) - r.flatten()).view(r.shape)  # where (s, e)'s rows arrived
    length, start = r.t().flatten(), src_start.t().flatten()  # the pieces, expert-major
    out_end = length.cumsum(0)
    row = torch.arange(total)
    piece = torch.searchsorted(out_end, row, right=True)  # the piece each expert-major row is in
    order = row - (out_end - length)[piece] + start[piece]
    return order, r.sum(0)


def _run_local_experts(got, recv: list[list[int]], experts, weights: tuple, copies: tuple = ()) -> torch.Tensor:
    """The local experts (`weights`: w1, w3, w2) on rows received source-major (recv[s][e] rows of local expert,
    or slot, e from source s), answered in the same order. `copies`: a FlexMoE placement's copy slots' weights
    (placement.py copy_slot_weights), which slots past the local experts run on (own_and_copy_experts)."""
    order, per_expert = _expert_major(recv)
    order, per_expert = order.to(got.device), per_expert.to(got.device)
    w1 = weights[0]

    def run(rows):
        rows = rows[order]
        if copies:  # (slot-major: the own experts' rows come first)
            own_rows = sum(sum(r[:w1.shape[0]]) for r in recv)
            out = own_and_copy_experts(rows, per_expert, weights, copies, own_rows, experts.chunk)
        else:
            out = swiglu_experts(rows, per_expert, *weights, experts.chunk)
        return out[torch.argsort(order)] if order.numel() else out
    # (a benchmark's emulated devices: at least the time their GEMMs would take; otherwise just run)
    return comm.paced(run, got, 6.0 * got.shape[0] * w1.shape[1] * w1.shape[2])


class ExpertParallelDispatcher(TokenDispatcher):
    """Every MoE layer's rows exchanged over the expert group `mesh` (the module docstring).

    mesh: the 1-D group the rows are exchanged over; group_size: the whole expert group's ranks (the
    weights' gradient scale; more than mesh.size() when `mesh` is one node of the group: hierarchical
    dispatch); chunks / tuner: the pipelined schedule; placer: FlexMoE's placements (ExpertPlacer)."""

    def __init__(self, mesh, chunks: int = 1, tuner=None, placer=None, group_size: int = 0):
        self.mesh, self.chunks, self.tuner, self.placer = mesh, chunks, tuner, placer
        self.group_size = group_size or mesh.size()

    def __repr__(self) -> str:  # which dispatch is active, in words
        schedule = "chunks chosen online" if self.tuner is not None else f"{self.chunks} chunk(s)"
        copies = f", FlexMoE copies ({self.placer.replicas} slot(s) per rank)" if self.placer is not None else ""
        return f"expert parallel over {self.group_size} ranks: {self._route()}, {schedule}{copies}"

    def _route(self) -> str:
        return "flat all-to-all"

    def overlaps_beside(self) -> bool:
        """One chunk: a layer's shared experts run while its rows travel back (run_experts_beside); with
        pipelined chunks the next chunk keeps the links busy already, and the layer runs them after."""
        return self.tuner is None and self.chunks <= 1 and self.mesh.size() > 1  # (one rank: nothing travels)

    def run_experts_beside(self, experts, x: torch.Tensor, counts: torch.Tensor, beside
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """run_experts, with `beside()` (the layer's shared experts) computed while the rows' results travel
        back, and its backward while their gradients travel out (job/split_transfer.py)."""
        return self._run(experts, x, counts, beside)

    @eager_under_compile
    def run_experts(self, experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [n, dim] sorted by expert, counts [experts of the mesh's ranks]: each row through its
        expert on the rank that holds it (by (rank, slot) under a FlexMoE placement), back in x's order.

        Eager under train.compile (a compiled block `post` reaches it): the exchange is driven by the host
        (the counts read as split sizes, FlexMoE's slot order planned in Python, the all-to-alls), so a
        trace would only break at every host read and guard on the counts; Dynamo traced it before
        2026-12-03 and, with a capacity and FlexMoE copies, failed inside its own guards ("Guard failed on
        the same frame it was created") or sent splits that did not sum to the rows."""
        return self._run(experts, x, counts, None)[0]

    def _run(self, experts, x: torch.Tensor, counts: torch.Tensor, beside) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run_experts' exchange: (the rows' results in x's order, beside's result or None); `beside` one chunk."""
        ep = self.mesh.size()
        placement, order = getattr(experts, "placement", None), None
        if placement is not None and not placement.copies:
            placement = None  # (a placement without copies is the static one)
        if placement is not None:
            host = counts.tolist()  # (the host read EP needs anyway, a step early)
            order = placement.slot_order(host).to(x.device)
            x = x.index_select(0, order)
            counts = torch.tensor(placement.slot_counts(host), device=counts.device)
        per_owner = counts.view(ep, -1)  # [owner, its local experts (slots)]
        received = comm.all_to_all(per_owner.contiguous(), self.mesh, label="expert_counts")  # [source, local expert]

        def exchange(chunks: int):
            return self._exchange(x, counts, per_owner, received, experts, chunks, placement, beside)
        if beside is not None:
            y, s = exchange(1)
        else:  # parallel.expert_pipeline_chunks = 0: the count chosen by an online profile
            y, s = (self.tuner.timed(lambda c: exchange(c)[0]) if self.tuner is not None
                    else exchange(self.chunks)[0]), None
        return (y if order is None else y.index_select(0, torch.argsort(order))), s

    def _exchange(self, x, counts, per_owner, received, experts, chunks: int, placement=None, beside=None):
        """dispatch -> local experts -> combine, in `chunks` pipelined chunks when more than 1; with a
        placement, over its slots (the local experts, then the copies fetched from their owners: two grouped GEMMs).

        FSDP averages the expert weights' gradients over the expert-data group (world / expert
        ranks), while the loop scales every loss by the world size (parallel/fsdp/shard.py grad_scale) and an
        expert's rows already carry the gradient of every token of its expert group: the local
        weights pass through a gradient scale of 1 / group so that the average is the exact sum.
        Returns (the results, beside's: None without it); `beside` (one chunk) is computed while the results
        travel back."""
        mesh = self.mesh
        scale = 1.0 / self.group_size
        weights = tuple(_ScaleGrad.apply(_local(w), scale) for w in (experts.w1, experts.w3, experts.w2))
        copies = copy_slot_weights(weights, placement, mesh) if placement is not None else ()
        if chunks > 1:  # FSMoE's schedule: the transfers of one chunk under the experts of another
            plan = chunk_plan(mesh, counts.tolist(), received.tolist(), chunks, x.device)

            def run(got, c, *w):
                return _run_local_experts(got, plan.recv[c], experts, w[:3], w[3:])
            return PipelinedExperts.apply(x, plan, run, *weights, *copies), None
        send_rows, recv = per_owner.sum(1).tolist(), received.tolist()  # the host read EP needs (split sizes)
        recv_rows = [sum(r) for r in recv]
        got = comm.all_to_all_v_grad(x, mesh, send_rows, recv_rows, "expert")
        back = _run_local_experts(got, recv, experts, weights, copies)
        if beside is None:
            return comm.all_to_all_v_grad(back, mesh, recv_rows, send_rows, "expert"), None
        transfer = SplitTransfer(mesh, recv_rows, send_rows, "expert")
        token = StartAllToAllV.apply(back, transfer)
        s = beside()  # (and, in backward, its gradient while the results' gradients travel out)
        return WaitAllToAllV.apply(token, transfer), s

    def step_notes(self, step: int, last_counts) -> list[str]:
        """Before optimizer step `step` (1-based): the schedule's decisions that take effect at this
        boundary, as log lines: the online chunk profile moves on, and FlexMoE's placer sees the last
        step's router counts [layers, E] (None before the first step) and re-places at the end of
        its window."""
        notes = [tuning_step(self.tuner, step) if self.tuner is not None else None,
                 self.placer.observe(last_counts) if self.placer is not None and last_counts is not None else None]
        return [n for n in notes if n is not None]
