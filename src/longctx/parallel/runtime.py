"""Runtime: this process's place in the job, and the few operations the training loop needs from it.

One object answers: which rank am I, which slice of the global batch is mine (data-parallel rank),
how is my part of each sequence cut (head x ctx), and how do per-rank numbers become job numbers.
With one process every method is the identity, so the loop has a single code path.

A rank's share of a batch is planned once (`plan_share`: the sequence layout of its rows and the
global positions it holds) and then taken either from a whole batch (`local_batch`) or read
straight from a memory-mapped store, only those positions (`read_local_batch`); both give the same
tensors, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..data.samples import Batch
from ..ops.segments import keep_host_copy
from . import comm
from .dims import ParallelDims
from .sequence import SequenceLayout, attach_layout, layout_of, plan_layout, shard_indices

TRACKED_DIMS = ("dp_replicate", "dp_shard", "head", "ctx", "expert")  # "expert": MoE token all-to-all


@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    dims: ParallelDims | None = None
    mesh: object = None        # the 4-D DeviceMesh (None with one process)
    world_mesh: object = None  # all ranks flattened, for job-wide reductions
    device: torch.device = torch.device("cpu")
    split: str = "docs"        # how sequences with documents are split over head x ctx (parallel.split)

    @classmethod
    def create(cls, cfg, rank: int, world: int, device_type: str) -> Runtime:
        dims = ParallelDims.from_config(cfg, world_size=world)
        device = (torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda"
                  else torch.device("cpu"))
        if world == 1:
            return cls(dims=dims, device=device, split=cfg.parallel.split)
        mesh = dims.build_mesh(device_type)
        world_mesh = mesh["dp_replicate", "dp_shard", "head", "ctx"]._flatten("world")
        return cls(rank, world, dims, mesh, world_mesh, device, cfg.parallel.split)

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

    def dp_rows(self, batch_size: int) -> slice:
        """My data-parallel rows of a global batch of `batch_size` samples."""
        rows = batch_size // self.dp
        return slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)

    def plan_share(self, doc_ids, rows: int, seq_len: int) -> tuple[SequenceLayout | None, torch.Tensor | None]:
        """How my part of each of my `rows` sequences is cut: the layout planned on the host from
        their document ids [rows, seq_len] (None without documents: zigzag), and the global
        positions I hold, LongTensor [rows, seq_len / (head x ctx)] in local order (None: all)."""
        if self.mesh is None or self.dims.head * self.dims.ctx == 1:
            return None, None
        ctx_rank = comm.local_rank(comm.sub_mesh(self.mesh, "ctx"))
        head_rank = comm.local_rank(comm.sub_mesh(self.mesh, "head"))
        if doc_ids is not None:
            layout = plan_layout(doc_ids, self.dims.ctx, self.dims.head, split=self.split)
            return layout, layout.indices(ctx_rank, head_rank)
        return None, shard_indices(seq_len, self.dims.ctx, self.dims.head, ctx_rank, head_rank).expand(rows, -1)

    def local_batch(self, batch: Batch, device=None) -> Batch:
        """My data-parallel share of a global batch, then my balanced part of each sequence (on
        `device` if given).

        With document ids the split is `plan_layout(..., split=parallel.split)`, planned here on
        the host from the ids every rank already has; the layout rides on the local document-id
        tensor to the attention core, so no rank ever asks the device where documents are."""
        if self.mesh is None:
            return batch if device is None else batch.to(device)
        sl = self.dp_rows(batch.tokens.shape[0])
        mine = Batch(*(None if t is None else t[sl] for t in (batch.tokens, batch.labels, batch.positions,
                                                             batch.doc_ids)))
        layout, held = self.plan_share(mine.doc_ids, mine.tokens.shape[0], mine.tokens.shape[1])
        take = lambda t: t if t is None or held is None else t.gather(1, held)  # noqa: E731
        local = Batch(take(mine.tokens), take(mine.labels), take(mine.positions), take(mine.doc_ids))
        if layout is not None:
            attach_layout(local.doc_ids, layout)
        return local if device is None else self.to_device(local, device)

    def read_local_batch(self, samples, indices: list[int]) -> tuple[Batch, int]:
        """My share of the global batch of samples `indices`, on the host (layout attached), and the
        number of valid labels in the whole global batch (the loss denominator, the same on every rank).

        A sample set that reads by position (a memory-mapped store, data/loader.py) reads its segment
        index for my rows, plans my share from it, and then reads only the tokens I hold, plus the next
        token of each one that has a label; its label count comes from the index too. Any other sample
        set (a synthetic mixture, a test's) is read whole and cut as `local_batch` cuts it."""
        if not getattr(samples, "reads_by_position", False):
            full = samples.batch(indices)
            return self.local_batch(full), full.valid_tokens
        mine = list(indices)[self.dp_rows(len(indices))]
        frames = samples.frames(mine)  # positions, document ids, labelled tokens: no token reads
        layout, held = self.plan_share(frames.doc_ids, len(mine), samples.seq_len)
        local = samples.read_at(mine, frames, None if held is None else held.numpy())
        if layout is not None:
            attach_layout(local.doc_ids, layout)
        return local, samples.label_count(indices)

    def to_device(self, local: Batch, device) -> Batch:
        """A local batch on `device`, its sequence layout (if any) still riding on the document ids."""
        layout = None if local.doc_ids is None else layout_of(local.doc_ids)
        moved = local.to(device)
        if layout is not None:
            attach_layout(moved.doc_ids, layout)
        elif local.doc_ids is not None:
            keep_host_copy(moved.doc_ids, local.doc_ids)
        return moved

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
