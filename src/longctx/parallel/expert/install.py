"""Expert parallelism (parallel.expert), folded over the ranks that data x head x ctx already use.

The MoE layers see a mesh of their own (ParallelDims.build_expert_mesh): dims (expert_data,
expert). An expert group of `expert` adjacent ranks splits the E experts between its ranks, E /
expert each; the ranks at the same place in every group hold the same experts, and FSDP shards
their weights over that expert-data group. Attention, the router, the shared experts and the dense
layers are untouched: each rank still routes the tokens it holds (its data rows, its part of each
sequence; a capacity's drops and the Sinkhorn assignment decided over every rank's: call_tokens.py),
and only the routed tokens travel.

`use_expert_parallel` is the one place that installs it, in two moves and nothing else:
  1. every MoE layer's expert weights become DTensors sharded on the expert dim over `expert`
     (before FSDP shards their second dim over `expert_data`): global shapes, so Distributed
     Checkpoint reshards them to another expert degree like any other weight, and the names stay
     those of one device;
  2. every MoE layer's `dispatcher` (the documented hook of models/moe.py: dispatch -> run_experts
     -> combine) becomes ONE dispatcher object for the whole model, chosen from config by
     `expert_dispatcher`:
       - flat all-to-all over the expert group (ExpertParallelDispatcher, parallel/expert/dispatch.py),
       - or hierarchical over nodes of parallel.expert_ranks_per_node ranks (HierarchicalDispatcher,
         parallel/expert/hierarchy.py),
     either in parallel.expert_pipeline_chunks pipelined chunks (FSMoE: parallel/expert/pipeline.py;
     0 = chosen online), the flat one with parallel.expert_replicas copy slots for hot experts
     (FlexMoE: parallel/expert/placement.py).
No module method is replaced: the layers call what they always call, and `repr(layer.dispatcher)`
says which dispatch is active. The dispatcher's decisions between optimizer steps (chunk
profile, placements) reach the training loop through `expert_step_notes`.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...job import comm
from ...models.moe import moe_layers
from .dispatch import ExpertParallelDispatcher
from .hierarchy import HierarchicalDispatcher
from .pipeline import ChunkTuner
from .placement import ExpertPlacer


def shard_over_experts(p: torch.Tensor, mesh) -> DTensor:
    """A (meta) expert weight [E, ...] as a DTensor sharded on the expert dim over the expert group."""
    ep = mesh.size()
    rank = comm.local_rank(mesh)
    local = p.detach().chunk(ep, dim=0)[rank]
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())


def expert_dispatcher(layers, expert_mesh, pipeline_chunks: int = 1, replicas: int = 0, placement_window: int = 0,
                      ranks_per_node: int = 0) -> ExpertParallelDispatcher:
    """The one dispatcher of the MoE `layers` over the `expert` dim of `expert_mesh`, as the
    parallel.expert_* options say: rows exchanged in `pipeline_chunks` overlapped chunks when more
    than 1 (0 = the count an online profile of the first layer calls picks: ChunkTuner); replicas > 0:
    FlexMoE's copies of hot experts, `replicas` slots per rank, re-placed every `placement_window`
    optimizer steps from the router's counts (ExpertPlacer); ranks_per_node > 0 (and fewer than the
    group): hierarchical dispatch over nodes of that many ranks."""
    mesh = comm.sub_mesh(expert_mesh, "expert")
    tuner = ChunkTuner(mesh) if pipeline_chunks == 0 else None  # one profile for all the layers
    if 0 < ranks_per_node < mesh.size():
        if replicas:
            raise ValueError("parallel.expert_replicas (FlexMoE copies) does not combine with "
                             "parallel.expert_ranks_per_node (hierarchical dispatch) yet: set one of them to 0")
        return HierarchicalDispatcher(mesh.size(), node_meshes(expert_mesh, ranks_per_node), pipeline_chunks, tuner)
    placer = ExpertPlacer(layers, mesh.size(), replicas, placement_window) if replicas else None
    return ExpertParallelDispatcher(mesh, pipeline_chunks, tuner, placer)


def use_expert_parallel(model, expert_mesh, pipeline_chunks: int = 1, replicas: int = 0,
                        placement_window: int = 0, ranks_per_node: int = 0) -> ExpertParallelDispatcher:
    """Install expert parallelism on every MoE layer of `model` (the module docstring's two moves):
    expert weights as DTensors over the `expert` dim of `expert_mesh`, and the dispatcher
    `expert_dispatcher` chooses from the options (see there) as every layer's `dispatcher`; each
    layer's experts start on the static placement (`experts.placement = None`). Returns it."""
    layers = moe_layers(model)
    dispatcher = expert_dispatcher(layers, expert_mesh, pipeline_chunks, replicas, placement_window, ranks_per_node)
    mesh = comm.sub_mesh(expert_mesh, "expert")
    for layer in layers:
        experts = layer.experts
        for name in ("w1", "w3", "w2"):
            setattr(experts, name, torch.nn.Parameter(shard_over_experts(getattr(experts, name), mesh)))
        experts.placement = None  # FlexMoE's placement of this layer (the dispatcher reads it)
        layer.dispatcher = dispatcher
    return dispatcher


def model_dispatcher(model) -> ExpertParallelDispatcher | None:
    """The expert-parallel dispatcher installed on `model`'s MoE layers (None: one device's)."""
    for layer in moe_layers(model):
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            return layer.dispatcher
    return None


def expert_placer(model) -> ExpertPlacer | None:
    """FlexMoE's placer installed on `model` (parallel.expert_replicas > 0), else None."""
    return getattr(model_dispatcher(model), "placer", None)


def node_meshes(expert_mesh, ranks_per_node: int):
    """The (across nodes, inside a node) groups of every expert group, as one 3-D mesh (expert_data,
    expert_node, expert_local) over the same ranks in the same order (every rank builds it)."""
    grid = expert_mesh.mesh
    ed, ep = grid.shape
    if ep % ranks_per_node:
        raise ValueError(f"parallel.expert = {ep} is not a whole number of nodes of {ranks_per_node} ranks "
                         f"(parallel.expert_ranks_per_node): set it to a divisor of {ep}")
    mesh3 = comm.mesh_with_backstop(DeviceMesh(expert_mesh.device_type, grid.reshape(ed, ep // ranks_per_node,
                                                                                     ranks_per_node),
                                               mesh_dim_names=("expert_data", "expert_node", "expert_local")))
    return comm.sub_mesh(mesh3, "expert_node"), comm.sub_mesh(mesh3, "expert_local")


def expert_step_notes(model, step: int, last_counts) -> list[str]:
    """Before optimizer step `step` (1-based): the expert dispatcher's decisions that take effect at
    this boundary, as log lines (ExpertParallelDispatcher.step_notes: the online chunk profile moves
    on, FlexMoE's placer sees the last step's router counts [layers, E], None before the first
    step); none without expert parallelism."""
    dispatcher = model_dispatcher(model)
    return [] if dispatcher is None else dispatcher.step_notes(step, last_counts)
