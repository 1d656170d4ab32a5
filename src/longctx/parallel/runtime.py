"""Runtime: this process's place in the job, and the few operations the training loop needs from it.

One object answers: which rank am I, which slice of the global batch is mine (data-parallel rank),
how is my part of each sequence cut (head x ctx), and how do per-rank numbers become job numbers.
With one process every method is the identity, so the loop has a single code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..data.samples import Batch
from . import comm
from .dims import ParallelDims
from .sequence import attach_layout, plan_layout, shard_sequence

TRACKED_DIMS = ("dp_replicate", "dp_shard", "head", "ctx")


@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    dims: ParallelDims | None = None
    mesh: object = None        # the 4-D DeviceMesh (None with one process)
    world_mesh: object = None  # all ranks flattened, for job-wide reductions
    device: torch.device = torch.device("cpu")
    balance: str = "docs"      # how sequences with documents are split over head x ctx (parallel.balance)

    @classmethod
    def create(cls, cfg, rank: int, world: int, device_type: str) -> "Runtime":
        dims = ParallelDims.from_config(cfg, world_size=world)
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        if world == 1:
            return cls(dims=dims, device=device, balance=cfg.parallel.balance)
        mesh = dims.build_mesh(device_type)
        world_mesh = mesh["dp_replicate", "dp_shard", "head", "ctx"]._flatten("world")
        return cls(rank, world, dims, mesh, world_mesh, device, cfg.parallel.balance)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.dims.dp_replicate * self.dims.dp_shard

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        replicate, shard = comm.sub_mesh(self.mesh, "dp_replicate"), comm.sub_mesh(self.mesh, "dp_shard")
        return comm.local_rank(replicate) * self.dims.dp_shard + comm.local_rank(shard)

    def local_batch(self, batch: Batch, device=None) -> Batch:
        """My data-parallel share of a global batch, then my balanced part of each sequence (on
        `device` if given).

        With document ids the split is `plan_layout(..., balance=parallel.balance)`, planned here on
        the host from the ids every rank already has; the layout rides on the local document-id
        tensor to the attention core, so no rank ever asks the device where documents are."""
        if self.mesh is None:
            return batch if device is None else batch.to(device)
        rows = batch.tokens.shape[0] // self.dp
        sl = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        layout = None
        if batch.doc_ids is not None and self.dims.head * self.dims.ctx > 1:
            layout = plan_layout(batch.doc_ids[sl], self.dims.ctx, self.dims.head, balance=self.balance)

        def part(t):
            if t is None:
                return None
            return shard_sequence(t[sl], self.mesh, seq_dim=1) if layout is None else layout.shard(t[sl], self.mesh)

        local = Batch(part(batch.tokens), part(batch.labels), part(batch.positions), part(batch.doc_ids))
        if device is not None:
            local = local.to(device)
        if layout is not None:
            attach_layout(local.doc_ids, layout)
        return local

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks of a device tensor, left on the device (no host read)."""
        if self.world_mesh is None:
            return t
        return comm.all_reduce(t, self.world_mesh, op=dist.ReduceOp.SUM, label="metrics")

    def _reduce(self, values, op):
        if self.world_mesh is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return comm.all_reduce(t, self.world_mesh, op=op, label="metrics").tolist()

    def broadcast(self, obj):
        return obj if self.world_mesh is None else comm.broadcast_object(obj, self.world_mesh)

    def comm_bytes(self) -> list[float]:
        """Bytes sent by this rank so far over each tracked mesh dim (from comm's counters)."""
        c = comm.counters()
        return [float(sum(c.get(d, {}).values())) for d in TRACKED_DIMS]
