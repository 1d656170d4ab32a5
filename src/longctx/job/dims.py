"""ParallelDims: the parallel degrees, validated, and the ONE named DeviceMesh built from them.

Mesh dims, outermost first: `dp_replicate` (HSDP replicas), `dp_shard` (FSDP over data), `head`
(Ulysses all-to-all), `ctx` (ring attention). `placement` decides which of the two sequence
groups gets adjacent ranks (on GPUs: the same node, the fast links):

- head-first: the ranks of a head group are adjacent (all-to-all is the heavier collective);
- ctx-first:  the ranks of a context group are adjacent.

`window` is the Double-Ring inner ring size: the context group is cut into ctx / window windows of
`window` consecutive context ranks (0 = one plain ring over the whole group). The Ulysses
all-to-all, the ring's hops and a Double-Ring's outer transfers each run on a process group of
their own (comm.open_lane, opened here with the mesh), never on one FSDP or the metrics use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..config.rules import DEGREES, degree_problems, degrees_on
from ..errors import ConfigError
from . import comm

DIM_NAMES = DEGREES
PLACEMENTS = ("head-first", "ctx-first")


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1
    head: int = 1
    ctx: int = 1
    window: int = 0
    placement: str = "head-first"
    world_size: int | None = None
    expert: int = 1  # MoE layers: expert-parallel degree, folded over the same ranks (expert_mesh)

    def __post_init__(self):
        if self.world_size is None:
            self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._validate()
        self._mesh = None
        self._expert_mesh = None

    def _validate(self):
        if self.world_size < 1:  # (an inferred degree would become 0 or negative, and nothing else refuses it)
            raise ConfigError(f"the world size is {self.world_size}: a job runs on at least 1 process; with "
                              f"`longctx train`, --nproc N takes N >= 1 (1 = this process).")
        degrees = {n: getattr(self, n) for n in DIM_NAMES}
        problems = degree_problems(degrees, self.window)
        if problems:
            raise ConfigError(" ".join(problems))
        known = math.prod(d for d in degrees.values() if d != -1)
        inferred = [n for n, d in degrees.items() if d == -1]
        ran = degrees_on(degrees, self.world_size)
        if inferred:
            if ran is None:
                raise ConfigError(
                    f"the world size {self.world_size} is not divisible by the product of the given degrees "
                    f"({' x '.join(f'{n}={d}' for n, d in degrees.items() if d != -1)} = {known}), so "
                    f"parallel.{inferred[0]} cannot be inferred: run on a multiple of {known} ranks (with `longctx "
                    f"train`, --nproc {known}; a resume otherwise keeps its checkpoint's ranks), or choose degrees "
                    f"whose product divides {self.world_size}."
                )
            setattr(self, inferred[0], ran[inferred[0]])
        elif ran is None:
            raise ConfigError(
                f"the parallel degrees multiply to {known} "
                f"({' x '.join(f'{n}={d}' for n, d in degrees.items())}) but the world size is {self.world_size}; "
                f"make them multiply to {self.world_size} or set one degree to -1 (with `longctx train`, "
                f"--nproc {known} starts that many processes)."
            )
        problems = degree_problems({"ctx": self.ctx}, self.window)  # ctx may have been inferred just now
        if problems:
            raise ConfigError(" ".join(problems))
        if self.expert < 1 or self.world_size % self.expert:
            raise ConfigError(f"parallel.expert ({self.expert}) must divide the world size ({self.world_size}): the "
                              f"MoE layers fold groups of {self.expert} ranks over the job's ranks.")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"parallel.placement '{self.placement}' is not one of {', '.join(PLACEMENTS)}.")

    @property
    def sequence_degree(self) -> int:
        return self.head * self.ctx

    def rank_grid(self) -> torch.Tensor:
        """Global ranks laid out as [dp_replicate, dp_shard, head, ctx] according to the placement."""
        n = torch.arange(self.world_size)
        if self.placement == "ctx-first":  # ctx varies fastest: a context group is contiguous
            return n.reshape(self.dp_replicate, self.dp_shard, self.head, self.ctx)
        # head-first: head varies fastest; lay out [.., ctx, head] then name the dims in mesh order
        return n.reshape(self.dp_replicate, self.dp_shard, self.ctx, self.head).transpose(2, 3)

    def build_mesh(self, device_type: str = "cpu"):
        """The DeviceMesh with dims dp_replicate, dp_shard, head, ctx (needs an initialised process group)."""
        if self._mesh is None:
            self._mesh = comm.mesh_with_backstop(DeviceMesh(device_type, self.rank_grid(), mesh_dim_names=DIM_NAMES))

            # the attention's transfers get process groups of their own (comm's "Lanes")
            if self.head > 1:
                comm.open_lane(self._mesh, "head", "ulysses")
            if self.ctx > 1:
                comm.open_lane(self._mesh, "ctx", "ring")
            if 1 < self.window < self.ctx:  # a Double-Ring: inner and outer transfers apart
                comm.open_lane(self._mesh, "ctx", "ring_outer")
        return self._mesh

    @property
    def expert_data(self) -> int:
        """Expert-data-parallel degree: how many ranks hold the same experts (their weights FSDP-sharded)."""
        return self.world_size // self.expert

    def build_expert_mesh(self, device_type: str = "cpu"):
        """The MoE layers' mesh, folded over every rank: dims (expert_data, expert), an expert group
        being `expert` adjacent ranks (with head-first placement: a head group first, on GPUs the same
        node) and an expert-data group the ranks at the same place in every expert group. Attention
        keeps the 4-D mesh; only the experts see this one."""
        if getattr(self, "_expert_mesh", None) is None:
            grid = torch.arange(self.world_size).reshape(self.expert_data, self.expert)
            self._expert_mesh = comm.mesh_with_backstop(
                DeviceMesh(device_type, grid, mesh_dim_names=("expert_data", "expert")))
            # The expert weights' gradients are DTensors on both dims, so their norm (step/gradients.py
            # clip_gradients) is a partial result over both. With this flattened mesh registered,
            # DTensor reduces it in one all-reduce over every rank; without it, in one all-reduce per
            # dim, which PyTorch warns about on every rank ("may give inconsistent results between
            # ranks due to different reduction orders").
            comm.flattened(self._expert_mesh, "expert_data_expert")
        return self._expert_mesh

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None) -> ParallelDims:
        p = cfg.parallel if hasattr(cfg, "parallel") else cfg
        return cls(p.dp_replicate, p.dp_shard, p.head, p.ctx, p.window, p.placement, world_size,
                   expert=getattr(p, "expert", 1))
