"""Expert parallelism (parallel.expert), folded over the ranks that data x head x ctx already use.

The MoE layers see a mesh of their own (ParallelDims.build_expert_mesh): dims (expert_data,
expert). An expert group of `expert` adjacent ranks splits the E experts between its ranks, E /
expert each; the ranks at the same place in every group hold the same experts, and FSDP shards
their weights over that expert-data group. Attention, the router, the shared experts and the dense
layers are untouched: each rank still routes the tokens it holds (its data rows, its part of each
sequence), and only the routed tokens travel.

A layer's `Experts.forward(x, counts)` receives its tokens sorted by expert (models/moe.py); under
expert parallelism it becomes `dispatch -> local experts -> combine`:
  1. the counts per expert go to the ranks that own them (a small all-to-all), read on the host:
     they are the variable split sizes of the token all-to-all (the one host read EP needs);
  2. all-to-all of the tokens (sorted by expert, so by owner);
  3. the received rows (source-major) regrouped expert-major, run through the local experts as one
     grouped GEMM per projection, and put back in source-major order;
  4. the reverse all-to-all returns each row to the rank its token lives on.
Backward runs the same way in reverse (AllToAllV's backward swaps the splits).

Gradients: FSDP averages the expert weights' gradients over the expert-data group (world /
expert ranks), while the loop scales every loss by the world size (parallelize.grad_scale) and an
expert's rows already carry the gradient of every token of its expert group. The local weights
therefore pass through `_scale_grad(1 / expert)` so that the average is the exact global sum.

Expert weights are DTensors sharded on the expert dim over `expert` and (by FSDP) on their
second dim over `expert_data`: global shapes, so Distributed Checkpoint reshards them to another
expert degree like any other weight, and the names stay those of one device.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..models.moe import moe_layers, swiglu_experts
from . import comm, emulated_link
from .expert_hierarchy import hierarchical_routed
from .expert_pipeline import ChunkTuner, PipelinedExperts, chunk_plan, tuning_step
from .expert_placement import ExpertPlacer, placement_step, with_copies


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
    1, ...), and the rows per local expert."""
    sources, local = len(recv), len(recv[0])
    start, offsets = 0, [[0] * local for _ in range(sources)]
    for s in range(sources):
        for e in range(local):
            offsets[s][e] = start
            start += recv[s][e]
    pieces = [torch.arange(offsets[s][e], offsets[s][e] + recv[s][e]) for e in range(local) for s in range(sources)]
    order = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    per_expert = torch.tensor([sum(recv[s][e] for s in range(sources)) for e in range(local)])
    return order, per_expert


def _run_local_experts(got, recv: list[list[int]], experts, w1, w3, w2) -> torch.Tensor:
    """The local experts on rows received source-major (recv[s][e] rows of local expert e from
    source s), answered in the same order."""
    order, per_expert = _expert_major(recv)
    order, per_expert = order.to(got.device), per_expert.to(got.device)

    def run(rows):
        out = swiglu_experts(rows[order], per_expert, w1, w3, w2, experts.chunk)
        return out[torch.argsort(order)] if order.numel() else out
    # (a benchmark's emulated devices: at least the time their GEMMs would take; otherwise just run)
    return emulated_link.paced(run, got, 6.0 * got.shape[0] * w1.shape[1] * w1.shape[2])


def expert_parallel_forward(x: torch.Tensor, counts: torch.Tensor, *, experts, mesh, group_size: int = 0
                            ) -> torch.Tensor:
    """`Experts.forward` under expert parallelism: x [n, dim] sorted by expert, counts [experts of
    the mesh's ranks]. With a FlexMoE placement (parallel/expert_placement.py) the rows go by
    (rank, slot) instead. `group_size`: the whole expert group's (when `mesh` is one node of it)."""
    ep = mesh.size()
    group_size = group_size or ep
    placement, order = getattr(experts, "placement", None), None
    if placement is not None and not placement.copies:
        placement = None  # (a placement without copies is the static one)
    if placement is not None:
        host = counts.tolist()  # (the host read EP needs anyway, a step early)
        order = placement.slot_order(host).to(x.device)
        x = x.index_select(0, order)
        counts = torch.tensor(placement.slot_counts(host), device=counts.device)
    per_owner = counts.view(ep, -1)  # [owner, its local experts (slots)]
    received = comm.all_to_all(per_owner.contiguous(), mesh, label="expert_counts")  # [source, local expert]
    tuner = getattr(experts, "chunk_tuner", None)
    if tuner is not None:  # parallel.expert_pipeline_chunks = 0: chosen by an online profile
        y = tuner.timed(lambda chunks: _exchange(x, counts, per_owner, received, experts, mesh, chunks, placement,
                                                 group_size))
    else:
        y = _exchange(x, counts, per_owner, received, experts, mesh, getattr(experts, "pipeline_chunks", 1), placement,
                      group_size)
    return y if order is None else y.index_select(0, torch.argsort(order))


def _exchange(x, counts, per_owner, received, experts, mesh, chunks: int, placement=None, group_size: int = 0
              ) -> torch.Tensor:
    """dispatch -> local experts -> combine, in `chunks` pipelined chunks when more than 1; with a
    placement, over its slots (the local experts, then the copies fetched from their owners)."""
    ep = group_size or mesh.size()
    w1, w3, w2 = (_ScaleGrad.apply(_local(w), 1.0 / ep) for w in (experts.w1, experts.w3, experts.w2))
    if placement is not None:
        w1, w3, w2 = with_copies((w1, w3, w2), placement, mesh)
    if chunks > 1:  # FSMoE's schedule: the transfers of one chunk under the experts of another
        plan = chunk_plan(mesh, counts.tolist(), received.tolist(), chunks, x.device)

        def run(got, c, *w):
            return _run_local_experts(got, plan.recv[c], experts, *w)
        return PipelinedExperts.apply(x, w1, w3, w2, plan, run)
    send_rows, recv = per_owner.sum(1).tolist(), received.tolist()  # the host read EP needs (split sizes)
    recv_rows = [sum(r) for r in recv]
    got = comm.AllToAllV.apply(x, mesh, send_rows, recv_rows, "expert")
    back = _run_local_experts(got, recv, experts, w1, w3, w2)
    return comm.AllToAllV.apply(back, mesh, recv_rows, send_rows, "expert")


def shard_over_experts(p: torch.Tensor, mesh) -> DTensor:
    """A (meta) expert weight [E, ...] as a DTensor sharded on the expert dim over the expert group."""
    ep = mesh.size()
    rank = comm.local_rank(mesh)
    local = p.detach().chunk(ep, dim=0)[rank]
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())


def use_expert_parallel(model, expert_mesh, pipeline_chunks: int = 1, replicas: int = 0,
                        placement_window: int = 0, ranks_per_node: int = 0) -> None:
    """Every MoE layer's experts split over the `expert` dim of `expert_mesh`: weights as DTensors
    (before FSDP wraps them) and the forward as dispatch -> local experts -> combine, in
    `pipeline_chunks` overlapped chunks when more than 1 (parallel/expert_pipeline.py); 0 = the
    count an online profile of the first layer calls picks (ChunkTuner, `model.expert_chunk_tuner`).
    replicas > 0: FlexMoE's copies of hot experts, `replicas` slots per rank, re-placed every
    `placement_window` optimizer steps from the router's counts (ExpertPlacer, `model.expert_placer`).
    ranks_per_node > 0 (and fewer than the group): hierarchical dispatch over nodes of that many
    ranks (parallel/expert_hierarchy.py)."""
    mesh = comm.sub_mesh(expert_mesh, "expert")
    tuner = ChunkTuner(mesh) if pipeline_chunks == 0 else None  # one profile for all the layers
    model.expert_chunk_tuner = tuner
    layers = moe_layers(model)
    model.expert_placer = ExpertPlacer(layers, mesh.size(), replicas, placement_window) if replicas else None
    nodes = node_meshes(expert_mesh, ranks_per_node) if 0 < ranks_per_node < mesh.size() else None
    for layer in layers:
        experts = layer.experts
        experts.pipeline_chunks, experts.chunk_tuner, experts.placement = pipeline_chunks, tuner, None
        for name in ("w1", "w3", "w2"):
            setattr(experts, name, torch.nn.Parameter(shard_over_experts(getattr(experts, name), mesh)))
        experts.forward = functools.partial(expert_parallel_forward, experts=experts, mesh=mesh)
        if nodes is not None:
            run_flat = functools.partial(_node_exchange, experts=experts, group_size=mesh.size())
            experts.route_tokens = functools.partial(hierarchical_routed, experts=experts, meshes=nodes,
                                                     local=layer.num_experts // mesh.size(), run_flat=run_flat)


def _node_exchange(x, counts, mesh, *, experts, group_size):
    return expert_parallel_forward(x, counts, experts=experts, mesh=mesh, group_size=group_size)


def node_meshes(expert_mesh, ranks_per_node: int):
    """The (across nodes, inside a node) groups of every expert group, as one 3-D mesh (expert_data,
    expert_node, expert_local) over the same ranks in the same order (every rank builds it)."""
    grid = expert_mesh.mesh
    ed, ep = grid.shape
    if ep % ranks_per_node:
        raise ValueError(f"parallel.expert = {ep} is not a whole number of nodes of {ranks_per_node} ranks "
                         f"(parallel.expert_ranks_per_node): set it to a divisor of {ep}")
    mesh3 = DeviceMesh(expert_mesh.device_type, grid.reshape(ed, ep // ranks_per_node, ranks_per_node),
                       mesh_dim_names=("expert_data", "expert_node", "expert_local"))
    return comm.sub_mesh(mesh3, "expert_node"), comm.sub_mesh(mesh3, "expert_local")


def expert_step_notes(model, step: int, last_counts) -> list[str]:
    """Before optimizer step `step` (1-based): the expert schedule's decisions that take effect at
    this boundary, as log lines: the online chunk profile (parallel.expert_pipeline_chunks = 0)
    moves on, and FlexMoE's placer sees the last step's router counts [layers, E] (None before the
    first step) and re-places at the end of its window."""
    notes = [tuning_step(model, step), placement_step(model, last_counts)]
    return [n for n in notes if n is not None]
