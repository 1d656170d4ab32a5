"""FSMoE's pipelined expert-parallel layer: the all-to-alls of one chunk under the experts of another.

The expert-parallel dispatcher (parallel/expert/dispatch.py) with one chunk runs a layer's
dispatch -> experts -> combine one after another, so the links idle while the experts compute and
the experts idle while tokens travel. With `chunks` > 1 (its option) every expert's rows
are cut into `chunks` near-equal pieces (piece c of n rows: rows n c / C to n (c + 1) / C, the
same cut on the sending and the receiving rank, so no extra count exchange is needed), and chunk c
is one small dispatch -> experts -> combine. The order of issue is what overlaps them:

  forward:  dispatch(0); for c: dispatch(c + 1) issued, wait dispatch(c), experts(c), combine(c) issued
  backward: the same, reversed in direction: combine's gradient of chunk c + 1 travels while the
            experts' backward of chunk c runs, and each chunk's input gradient is sent as soon as
            it is made.

A transfer is waited for only when its rows are needed, so with C chunks all but about 1 / C of
the shorter of communication and computation hides under the longer. Every row goes through the
same expert with the same weights as without chunks: outputs equal the unchunked layer's up to
the summation order of the weight gradients (summed over chunks), checked to 1e-5 in
tests/distributed/test_expert_pipeline.py.

The layer is one autograd Function: its forward keeps each chunk's expert graph (detached at the
received rows and at the weights), and its backward walks the chunks with torch.autograd.grad, so
that the backward's transfers are issued by us, in the pipelined order, and not by the autograd
engine one blocking step at a time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...job import comm


def chunk_counts(counts: list[int], chunks: int) -> list[list[int]]:
    """Rows of each group in each chunk: [chunk][group], chunk c of a group of n rows holding rows
    n c // C to n (c + 1) // C (every row in exactly one chunk; chunks differ by at most one row)."""
    return [[n * (c + 1) // chunks - n * c // chunks for n in counts] for c in range(chunks)]


def chunk_rows(counts: list[int], chunks: int) -> list[torch.Tensor]:
    """For rows grouped by `counts` (group g's rows contiguous, in group order): the row indices of
    each chunk, group by group in order."""
    n = torch.tensor(counts, dtype=torch.long)
    starts = torch.cumsum(n, 0) - n
    out = []
    for c in range(chunks):
        lo, hi = starts + n * c // chunks, starts + n * (c + 1) // chunks
        lengths = hi - lo
        # every group's [lo, hi) in one go: positions within the chunk shifted to each group's lo
        first = torch.cumsum(lengths, 0) - lengths
        out.append(torch.arange(int(lengths.sum())) + torch.repeat_interleave(lo - first, lengths))
    return out


@dataclass
class ChunkPlan:
    """The cut of one layer call into pipelined chunks, per chunk c: the rows this rank sends (their
    indices in x, owner-major), rows sent to / received from each rank, and recv[c][source][local
    expert]."""
    mesh: object
    chunks: int
    send_index: list[torch.Tensor]
    send_rows: list[list[int]]
    recv_rows: list[list[int]]
    recv: list[list[list[int]]]


def chunk_plan(mesh, counts: list[int], recv: list[list[int]], chunks: int, device) -> ChunkPlan:
    """counts[E]: the rows this rank sends per (global) expert; recv[source][local expert]: the rows
    it receives. Both sides cut each expert's rows with chunk_counts, so they agree without talking."""
    ep = mesh.size()
    local = len(counts) // ep
    send = chunk_counts(counts, chunks)  # [chunk][global expert]
    per_source = [chunk_counts(row, chunks) for row in recv]  # [source][chunk][local expert]
    recv_c = [[per_source[s][c] for s in range(len(recv))] for c in range(chunks)]
    return ChunkPlan(mesh, chunks, [i.to(device) for i in chunk_rows(counts, chunks)],
                     [[sum(row[o * local:(o + 1) * local]) for o in range(ep)] for row in send],
                     [[sum(r) for r in rc] for rc in recv_c], recv_c)


def _issue(rows: torch.Tensor, plan: ChunkPlan, c: int, back: bool = False) -> comm.PendingTransfer:
    """Start chunk c's transfer: to the experts' owners, or `back` from them to the rows' ranks."""
    send, recv = (plan.recv_rows[c], plan.send_rows[c]) if back else (plan.send_rows[c], plan.recv_rows[c])
    return comm.all_to_all_v_async(rows, plan.mesh, send, recv, "expert")


class PipelinedExperts(torch.autograd.Function):
    """dispatch -> experts -> combine in `plan.chunks` overlapped pieces (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, plan, run_experts, *weights):
        """weights: w1, w3, w2 (and a FlexMoE placement's copy slots' w1, w3, w2): run_experts(got, c, *weights)."""
        weights = [w.detach().requires_grad_() for w in weights]
        # each chunk's rows are gathered when its transfer is issued: two chunks' copies at most
        pending = _issue(x.index_select(0, plan.send_index[0]), plan, 0)
        graphs, combines = [], []
        for c in range(plan.chunks):
            following = (_issue(x.index_select(0, plan.send_index[c + 1]), plan, c + 1)
                         if c + 1 < plan.chunks else None)
            got = pending.wait().detach().requires_grad_(ctx.needs_input_grad[0])
            with torch.enable_grad():
                out = run_experts(got, c, *weights)
            combines.append(_issue(out.detach(), plan, c, back=True))
            graphs.append((got, out))
            pending = following
        # the experts' dtype, as the unchunked layer's combine returns it (bf16 under autocast, x fp32)
        y = x.new_empty(x.shape[0], weights[2].shape[1], dtype=graphs[0][1].dtype)
        for idx, done in zip(plan.send_index, combines):
            y.index_copy_(0, idx, done.wait())
        ctx.plan, ctx.graphs, ctx.weights, ctx.x_dtype = plan, graphs, weights, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        grad = grad.contiguous()
        pending = _issue(grad.index_select(0, plan.send_index[0]), plan, 0)
        grad_w = [torch.zeros_like(w) for w in ctx.weights]
        want_x, returns = ctx.needs_input_grad[0], []
        for c, (got, out) in enumerate(ctx.graphs):
            following = (_issue(grad.index_select(0, plan.send_index[c + 1]), plan, c + 1)
                         if c + 1 < plan.chunks else None)
            g_out = pending.wait()
            grads = torch.autograd.grad(out, [got, *ctx.weights] if want_x else ctx.weights, g_out, allow_unused=True)
            g_in, g_w = (grads[0], grads[1:]) if want_x else (None, grads)
            for acc, g in zip(grad_w, g_w):
                if g is not None:
                    acc += g
            if want_x:  # (the rows' gradient travels back only when x needs one, as in the unchunked layer)
                returns.append(_issue(torch.zeros_like(got) if g_in is None else g_in.contiguous(), plan, c,
                                      back=True))
            pending = following
        ctx.graphs = None
        grad_x = None
        if want_x:
            grad_x = grad.new_zeros(grad.shape[0], grad.shape[1], dtype=ctx.x_dtype)  # (the rows' gradients: x's)
            for idx, done in zip(plan.send_index, returns):
                grad_x.index_copy_(0, idx, done.wait())
        return grad_x, None, None, *grad_w


class ChunkTuner:
    """parallel.expert_pipeline_chunks = 0: the chunk count chosen by a short online profile (FSMoE's).

    The dispatcher's step_notes call `begin_step()` before each optimizer step. After WARMUP steps
    at 1 chunk, the steps cycle through CANDIDATES, ROUNDS steps each, every MoE layer call of a step
    (its recomputation included, so that it routes through the same graph) using the step's count
    and timing its forward (on CUDA with a synchronisation, during the profile only). Then the
    median time per call of each candidate is taken over the expert group (the slowest rank's) and
    the fastest candidate serves every later step, on every rank alike. The forward stands for the
    backward, which runs the same transfers and GEMMs in the same pipelined order. `decision` holds
    the times and the choice for the run's log. (A choice made by timing can differ between two
    runs, and the chunk count moves the weight gradients' summation order: give a fixed count
    where runs must be bit-identical.)
    """

    CANDIDATES = (1, 2, 4, 8)
    WARMUP = 1
    ROUNDS = 2

    def __init__(self, mesh):
        self.mesh = mesh
        self.steps = 0
        self.current = 1
        self.times: dict[int, list[float]] = {c: [] for c in self.CANDIDATES}
        self.chosen = 0
        self.decision: dict | None = None

    @property
    def profiling(self) -> bool:
        return not self.chosen and self.steps > self.WARMUP

    def begin_step(self) -> dict | None:
        """Move to the next step's chunk count; returns the decision on the step it is made."""
        if self.chosen:
            return None
        self.steps += 1
        i = self.steps - self.WARMUP - 1
        if i >= self.ROUNDS * len(self.CANDIDATES):
            self._decide()
            return self.decision
        self.current = 1 if i < 0 else self.CANDIDATES[i // self.ROUNDS]
        return None

    def timed(self, run):
        """Run one layer call (`run(chunks)`), timed while profiling."""
        if not self.profiling:
            return run(self.current)
        _sync()
        t0 = time.perf_counter()
        out = run(self.current)
        _sync()
        self.times[self.current].append(time.perf_counter() - t0)
        return out

    def _decide(self) -> None:
        medians = torch.tensor([statistics.median(self.times[c]) for c in self.CANDIDATES], dtype=torch.float64)
        medians = comm.all_reduce(medians, self.mesh, op=dist.ReduceOp.MAX, label="expert_tuning")
        self.chosen = self.current = self.CANDIDATES[int(torch.argmin(medians))]
        self.decision = {"chunks": self.chosen, "forward_s": dict(zip(self.CANDIDATES, medians.tolist()))}


def tuning_step(tuner: ChunkTuner, step: int) -> str | None:
    """Start the online profile's next step (the dispatcher's step_notes, before each optimizer
    step); on the step the choice is made, the line that says so."""
    decision = tuner.begin_step()
    if decision is None:
        return None
    times = ", ".join(f"{c}: {s * 1e3:.1f} ms" for c, s in decision["forward_s"].items())
    return f"step {step}: expert pipeline chunks {decision['chunks']} (MoE layer forward by chunks: {times})"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
