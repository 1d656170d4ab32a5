"""DCP's read of a checkpoint, counted: the MB of this rank's read done so far, for a progress phase.

dcp.load is one call with no count of its own, and a large model's read is minutes in which a heartbeat line could
say only how long it had run. CountingReader is DCP's own FileSystemReader and reads exactly what that reads, in
its order, into the same tensors: only the planner it hands the items to is wrapped, to count each item once it is
in place (load_bytes, commit_tensor). The total is this rank's read plan: FileSystemReader reads each ReadItem's
stored chunk whole (the file sliced at the chunk's offset and length, then narrowed to the part asked for), so the
plan's chunk lengths are the bytes it reads."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ..progress import phase


def read_counted(state: dict, path, **dcp_kwargs) -> None:
    """dcp.load of the checkpoint directory `path` into `state` (`dcp_kwargs`: process_group, no_dist), as a
    progress phase "checkpoint: reading PATH" counting this rank's MB: every read of a checkpoint's tensors (a
    resume, a rollback, init_from, eval, export, generate) is said the same way."""
    with phase(f"checkpoint: reading {path}", done_line=False) as progress:
        dcp.load(state, storage_reader=CountingReader(path, progress), **dcp_kwargs)


class CountingReader(FileSystemReader):
    """The FileSystemReader of the checkpoint directory `path`, counting in `progress` (a progress.Phase of the read
    alone; None: no count) the MB of this rank's read: the total once the plan is known, then each item's bytes as
    it is in place, so the count only goes up and ends at the total."""

    def __init__(self, path, progress=None):
        super().__init__(path)
        self.progress = progress
        self.bytes_read = 0

    def read_data(self, plan, planner):
        if self.progress is None:
            return super().read_data(plan, planner)
        self.bytes_read = 0
        self.progress.expect(sum(self._length(item) for item in plan.items) / 1e6, "MB")
        return super().read_data(plan, _CountedPlanner(planner, self._count))

    def _length(self, item) -> int:
        return self.storage_data[item.storage_index].length

    def _count(self, item) -> None:
        # (assigned from the whole bytes, not added to in MB: the last item's count is the total exactly)
        self.bytes_read += self._length(item)
        self.progress.done = self.bytes_read / 1e6


class _CountedPlanner:
    """The load planner DCP hands the reader, calling `counted(item)` after it has put each item in place;
    everything else is the planner's own."""

    def __init__(self, planner, counted):
        self._planner, self._counted = planner, counted

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        self._planner.load_bytes(read_item, value)
        self._counted(read_item)

    def commit_tensor(self, read_item, tensor) -> None:
        self._planner.commit_tensor(read_item, tensor)
        self._counted(read_item)
