"""Runtime: this process's place in the job, and the few job-wide operations the loop needs from it.

One object answers: which rank am I, on which mesh of degrees (dims), which data-parallel rows of a
global batch are mine, and how do per-rank numbers become job numbers (sum, max, broadcast, the
bytes sent per mesh dim). With one process every method is the identity, so the loop has a single
code path. How a rank's part of each sequence is cut over head x ctx is context parallelism's
business (parallel/context/shares.py), which reads the mesh and `seq_balance` from here.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DataError, UserError
from . import comm, watchdog
from .dims import ParallelDims

# "expert": MoE token all-to-all; under hierarchical dispatch (parallel.expert_ranks_per_node) its two levels,
# across nodes and inside one (parallel/expert/hierarchy.py), which the line once left out (no expert bytes at all);
# "router": a MoE model's router statistics summed over every rank (parallel/parallelize.py use_router_sum)
TRACKED_DIMS = ("dp_replicate", "dp_shard", "head", "ctx", "expert", "expert_node", "expert_local", "router")


@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    dims: ParallelDims | None = None
    mesh: object = None        # the 4-D DeviceMesh (None with one process)
    world_mesh: object = None  # all ranks flattened, for job-wide reductions
    device: torch.device = torch.device("cpu")
    seq_balance: str = "docs"  # how sequences with documents are cut over head x ctx (parallel.seq_balance)

    @classmethod
    def create(cls, cfg, rank: int, world: int, device_type: str) -> Runtime:
        dims = ParallelDims.from_config(cfg, world_size=world)
        device = (torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda"
                  else torch.device("cpu"))
        if world == 1:
            return cls(dims=dims, device=device, seq_balance=cfg.parallel.seq_balance)
        mesh = dims.build_mesh(device_type)
        world_mesh = comm.flattened(mesh["dp_replicate", "dp_shard", "head", "ctx"], "world")
        return cls(rank, world, dims, mesh, world_mesh, device, cfg.parallel.seq_balance)

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

    def gather(self, obj) -> list:
        """Every rank's picklable `obj`, by rank, on every rank (control data, at a metrics line: a hook's notes)."""
        return [obj] if self.world_mesh is None else comm.all_gather_object(obj, self.world_mesh)

    def comm_bytes(self) -> list[float]:
        """Bytes sent by this rank so far over each tracked mesh dim (from comm's counters)."""
        c = comm.counters()
        return [float(sum(c.get(d, {}).values())) for d in TRACKED_DIMS]


_RANK_0_WAITS = itertools.count()  # (every rank counts its waits alike: they are collective, as on_main's calls)


def _wait_for_rank_0(done: bool) -> None:
    """Every rank until rank 0 (`done` True there) has ended a piece of work of its own (on_main), without a
    time limit: rank 0 works for as long as its work takes (a first build of the data store, under torchrun started
    directly: hours for a large corpus). Waited for in a collective, the others gave up at the process groups'
    backstop (watchdog.group_timeout: 340 s by default) with gloo's 'Timed out waiting 340000ms for recv operation'.
    They wait on the job's store instead, for the key rank 0 sets (a rank 0 that dies: its launcher stops them, as
    on any rank's failure; one whose work raised a KeyboardInterrupt or SystemExit sets it too, on_main).
    Under the hang watchdog (the training loop, where a stage's store, built at set-up, is only opened) the wait
    stays the collective, which the watchdog sees and times."""
    if watchdog.running() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = f"longctx/rank_0_done/{next(_RANK_0_WAITS)}"
    store = dist.distributed_c10d._get_default_store()
    if done:
        store.set(key, "1")
        return
    pause = 0.01
    while not store.check([key]):  # (a look at the store: from 10 ms on a quick fn to once a second on a build)
        time.sleep(pause)
        pause = min(1.0, 2 * pause)


def on_main(rt: Runtime | None, fn, what: str):
    """fn() on rank 0 while the other ranks wait; its result, or its failure, on every rank (a failure
    on rank 0 alone would leave the others waiting in a collective until the timeout)."""
    failure = outcome = None
    if rt is None or rt.is_main:
        try:
            outcome = ("ok", fn())
        except Exception as e:  # every failure reaches the waiting ranks, not only a UserError
            failure = e
            outcome = (("error", type(e), str(e)) if isinstance(e, UserError) else
                       ("error", DataError, f"{what} failed on rank 0: {type(e).__name__}: {e}"))
        except BaseException:
            # (KeyboardInterrupt, SystemExit: rank 0's alone) the others go on to the broadcast, which fails as rank 0
            # leaves: the store's wait has no time limit, and a rank 0 that caught it and lived on (or exited 0) left
            # them waiting there forever
            if rt is not None:
                _wait_for_rank_0(True)
            raise
    if rt is not None:
        _wait_for_rank_0(rt.is_main)  # (fn may take longer than a collective waits: a data build)
        outcome = rt.broadcast(outcome if rt.is_main else None)
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        raise _same_error(*outcome[1:])
    return outcome[1]


def _same_error(cls: type[UserError], message: str) -> UserError:
    """Rank 0's error as raised on another rank: the same class (and so exit code) where it is built
    from its message alone, else a UserError with that exit code."""
    try:
        return cls(message)
    except TypeError:
        error = UserError(message)
        error.exit_code = cls.exit_code
        return error


def on_rank_0(fn, what: str):
    """on_main over the default process group, for a caller given no Runtime (generate's load_model, under head
    x ctx ranks); fn() alone where there is no group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    return on_main(_DefaultGroup(), fn, what)


class _DefaultGroup:
    """What on_main reads of a Runtime, for the default process group."""

    def __init__(self):
        self.is_main = dist.get_rank() == 0

    def broadcast(self, obj):
        return comm.broadcast_object_in_group(obj, None)  # (group None: the default one)
