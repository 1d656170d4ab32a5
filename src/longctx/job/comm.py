"""The only module that calls torch.distributed communication ops, with exact byte counters.

Every call names the mesh dim it runs over (a 1-D DeviceMesh such as `mesh["ctx"]`) and a label
for what it carries; `counters()` returns the bytes THIS rank sent, per dim and label:

- all_to_all: the bytes of the chunks that leave this rank ((n-1)/n of the input);
- all_gather: the input once to each of the n-1 peers' outputs is counted as (n-1)/n of the
  output, the volume of a bandwidth-optimal ring all-gather;
- all_reduce: 2 (n-1)/n of the tensor (ring all-reduce);
- exchange (point-to-point): the bytes of every tensor sent.

Groups of size 1 communicate nothing and count nothing. `barrier` and `broadcast_object` carry
control data and are not counted. `groups_used()` says which process group each (dim, label) ran on.

Lanes. NCCL runs the operations of one communicator in the order they were posted, so transfers
that should overlap need process groups of their own. A mesh dim's group may be shared (when the
dim spans the whole job, DeviceMesh hands it the default group, which FSDP and the metrics also
use), so the attention's transfers run on lanes: process groups over the same ranks as a dim's
group, opened once at setup (`open_lane`, from ParallelDims.build_mesh) and found with
`lane(mesh, name)`: "ulysses" for the head all-to-all, "ring" for the ring's (inner) hops,
"ring_outer" for a Double-Ring's outer transfers, which posted first on the inner hops' group would
hold up every inner hop behind the slow inter-node transfer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import watchdog
from .link_hook import link_hook, paced, set_link_hook  # noqa: F401 (comm's API: benchmarks and experts call them here)

_BYTES: dict[tuple[str, str], int] = defaultdict(int)
_GROUPS: dict[tuple[str, str], set[str]] = defaultdict(set)  # (dim, label) -> names of the groups it ran on
_LANES: dict[tuple[str, str], object] = {}  # (group name of a 1-D mesh, lane name) -> 1-D mesh, same ranks
_OWN = threading.local()  # depth > 0 while one of this module's functions runs its c10d op

# torch >= 2.10 renamed all_gather_into_tensor (output concatenated along dim 0) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def counters() -> dict[str, dict[str, int]]:
    """{dim: {label: bytes sent by this rank}} since the last reset."""
    out: dict[str, dict[str, int]] = {}
    for (dim, label), n in sorted(_BYTES.items()):
        out.setdefault(dim, {})[label] = n
    return out


def reset_counters() -> None:
    _BYTES.clear()
    _GROUPS.clear()


def forget_meshes() -> None:
    """Drop this module's references to meshes and their process groups (the lane and mesh-fact
    caches): after the groups are destroyed, so that their C++ objects are freed now, not by the
    interpreter's exit."""
    _LANES.clear()
    _MESH_FACTS.clear()


def groups_used() -> dict[str, dict[str, list[str]]]:
    """{dim: {label: names of the process groups its transfers ran on}} since the last reset."""
    out: dict[str, dict[str, list[str]]] = {}
    for (dim, label), names in sorted(_GROUPS.items()):
        out.setdefault(dim, {})[label] = sorted(names)
    return out


@contextlib.contextmanager
def _own():
    """Marks the c10d ops issued inside as this module's (counted here, not by library_traffic)."""
    _OWN.depth = getattr(_OWN, "depth", 0) + 1
    watchdog.tick()  # a collective is progress for the hang watchdog, issued and finished
    try:
        yield
    finally:
        _OWN.depth -= 1
        watchdog.tick()


def _count(mesh, label: str, nbytes: int) -> None:
    key = (dim_name(mesh), label)
    _BYTES[key] += int(nbytes)
    _GROUPS[key].add(group_name(mesh))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _emulator(mesh):
    """The link hook if one is installed and covers this mesh's dim."""
    hook = link_hook()
    return hook if hook is not None and mesh.size() > 1 and hook.covers(dim_name(mesh)) else None


def _peer_bytes(mesh, send: list[int], recv: list[int]) -> dict[int, tuple[int, int]]:
    return {r: (s, v) for r, s, v in zip(group_ranks(mesh), send, recv)}


def dim_name(mesh) -> str:
    names = mesh.mesh_dim_names
    return names[0] if names else "?"


# Slicing a DeviceMesh and asking it for a local rank run tensor ops on its rank table (nonzero,
# item) and cost tens of microseconds; the meshes live as long as the job, so each answer is kept.
_MESH_FACTS: dict[tuple[int, object], tuple[object, object]] = {}


def _mesh_fact(mesh, key, compute):
    hit = _MESH_FACTS.get((id(mesh), key))
    if hit is None or hit[0] is not mesh:  # (holding the mesh keeps its id from being reused)
        hit = (mesh, compute())
        _MESH_FACTS[(id(mesh), key)] = hit
    return hit[1]


def mesh_with_backstop(mesh):
    """`mesh` (a DeviceMesh built here), each of its dims' process groups given the backstop timeout
    (watchdog.group_timeout: parallel.timeout_s + grace + 30 s) that the default group and comm's own
    groups get. DeviceMesh creates its groups with torch's default (gloo 30 min, NCCL 10 min), which
    would end a hang in FSDP's or the ring's collectives before the watchdog could report it whenever
    parallel.timeout_s is raised past that default. Returns `mesh`."""
    timeout = watchdog.group_timeout()
    if timeout is not None and dist.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout

        for dim in range(mesh.ndim):
            _set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


def flattened(mesh, name: str):
    """mesh._flatten(name) (DeviceMesh's one group over several of its dims), given the backstop timeout too."""
    return mesh_with_backstop(mesh._flatten(name))


def sub_mesh(mesh, name):
    """mesh[name], computed once per mesh."""
    return _mesh_fact(mesh, ("sub", name), lambda: mesh[name])


def local_rank(mesh) -> int:
    """This rank's index in a 1-D mesh, computed once per mesh."""
    return _mesh_fact(mesh, "local_rank", mesh.get_local_rank)


def group_ranks(mesh) -> list[int]:
    """Global ranks of this 1-D mesh, in group order."""
    return _mesh_fact(mesh, "ranks", lambda: mesh.mesh.flatten().tolist())


def group_of(mesh):
    """The process group of this 1-D mesh, looked up once per mesh."""
    return _mesh_fact(mesh, "group", mesh.get_group)


def group_name(mesh) -> str:
    return _mesh_fact(mesh, "group_name", lambda: group_of(mesh).group_name)


def open_lane(mesh, dim: str, name: str) -> None:
    """Give every group of `mesh`'s dim `dim` a second process group over the same ranks, found by
    `lane(sub_mesh(mesh, dim), name)`. Collective over the whole job: every rank calls it, at setup
    (a process group is created by all ranks, including those outside it)."""
    d = mesh.mesh_dim_names.index(dim)
    every = mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.shape[d]).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(every, timeout=watchdog.group_timeout(), group_desc=f"{dim}_{name}")
    own = sub_mesh(mesh, dim)
    _LANES[(group_name(own), name)] = DeviceMesh.from_group(mine, mesh.device_type, mesh=group_ranks(own),
                                                             mesh_dim_names=(dim,))


def lane(mesh, *names: str):
    """The first of the lanes `names` opened over this 1-D mesh's ranks (`open_lane`); the mesh itself
    if none was (a mesh built by hand: correct, only without the separate groups)."""
    if mesh.size() == 1:
        return mesh
    for name in names:
        found = _LANES.get((group_name(mesh), name))
        if found is not None:
            return found
    return mesh


def all_to_all(x: torch.Tensor, mesh, label: str = "all_to_all") -> torch.Tensor:
    """x [n, ...]: slice i goes to group rank i; returns [n, ...] whose slice j came from rank j."""
    n = mesh.size()
    if x.shape[0] != n:
        raise ValueError(f"all_to_all over '{dim_name(mesh)}' needs a leading dim of {n}, got {tuple(x.shape)}")
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    started = time.monotonic()
    with _own():
        dist.all_to_all_single(out, x, group=group_of(mesh))
    _count(mesh, label, nbytes(x) * (n - 1) // n)
    if (emu := _emulator(mesh)) is not None:
        each = nbytes(x) // n
        emu.wait_until(emu.post(_peer_bytes(mesh, [each] * n, [each] * n), started), started)
    return out


def all_to_all_v(x: torch.Tensor, mesh, send_rows: list[int], recv_rows: list[int],
                 label: str = "all_to_all_v") -> torch.Tensor:
    """Variable splits: x's first send_rows[0] rows go to group rank 0, the next send_rows[1] to rank
    1, ...; returns the rows received, recv_rows[j] of them from rank j, in rank order. Both lists
    are host integers (the caller exchanged the counts first). Counted: the rows that leave this rank."""
    return all_to_all_v_async(x, mesh, send_rows, recv_rows, label).wait()


class AllToAllV(torch.autograd.Function):
    """all_to_all_v with a gradient: backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x, mesh, send_rows, recv_rows, label):
        ctx.mesh, ctx.send_rows, ctx.recv_rows, ctx.label = mesh, send_rows, recv_rows, label
        return all_to_all_v(x, mesh, send_rows, recv_rows, label=label)

    @staticmethod
    def backward(ctx, grad):
        back = all_to_all_v(grad.contiguous(), ctx.mesh, ctx.recv_rows, ctx.send_rows, label=ctx.label)
        return back, None, None, None, None


def all_to_all_v_grad(x: torch.Tensor, mesh, send_rows: list[int], recv_rows: list[int],
                      label: str = "all_to_all_v") -> torch.Tensor:
    """AllToAllV.apply, but over one rank x itself: a Function returning its input returns a view of it, which as
    the experts' output (hierarchical dispatch, one rank a node) drew FSDP2's "FSDPExperts returned a view tensor"."""
    if mesh.size() == 1 and list(send_rows) == list(recv_rows) == [x.shape[0]]:
        return x
    return AllToAllV.apply(x, mesh, send_rows, recv_rows, label)  # (which refuses splits that do not fit x)


class PendingTransfer:
    """An all-to-all in flight (`all_to_all_v_async`); `wait()` returns its output once it has
    arrived: on an emulated link, once the modelled transfer is complete too."""

    def __init__(self, out: torch.Tensor, work, done: float | None, emu, sent: torch.Tensor | None = None):
        self.out, self._work, self._done, self._emu = out, work, done, emu
        self._sent = sent  # the input stays alive while the transfer may still read it

    def wait(self) -> torch.Tensor:
        started = time.monotonic()
        if self._work is not None:
            with _own():
                self._work.wait()
            self._work = self._sent = None
        if self._emu is not None:
            self._emu.wait_until(self._done, started)
            self._emu = None
        return self.out


def all_to_all_v_async(x: torch.Tensor, mesh, send_rows: list[int], recv_rows: list[int],
                       label: str = "all_to_all_v") -> PendingTransfer:
    """all_to_all_v, started and not waited for: the caller computes meanwhile and calls `.wait()`
    on the result before it reads the received rows (and before it writes `x` again)."""
    n = mesh.size()
    if len(send_rows) != n or len(recv_rows) != n or sum(send_rows) != x.shape[0]:
        raise ValueError(f"all_to_all_v over '{dim_name(mesh)}' ({n} ranks): {len(send_rows)} send and "
                         f"{len(recv_rows)} receive splits for {x.shape[0]} rows")
    if n == 1:
        return PendingTransfer(x, None, None, None)
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    started = time.monotonic()
    with _own():
        work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows),
                                      group=group_of(mesh), async_op=True)
    me = local_rank(mesh)
    row = nbytes(x[:1]) if x.shape[0] else 0
    _count(mesh, label, row * (sum(send_rows) - send_rows[me]))
    emu = _emulator(mesh)
    done = None if emu is None else emu.post(_peer_bytes(mesh, [row * r for r in send_rows],
                                                         [row * r for r in recv_rows]), started)
    return PendingTransfer(out, work, done, emu, x)


def all_gather(x: torch.Tensor, mesh, label: str = "all_gather") -> torch.Tensor:
    """Returns [n, *x.shape] with every group rank's x, in group order."""
    n = mesh.size()
    if n == 1:
        return x[None]
    x = x.contiguous().reshape(1, *x.shape)
    out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    started = time.monotonic()
    with _own():
        _all_gather_single(out, x, group=group_of(mesh))
    _count(mesh, label, nbytes(x) * (n - 1))
    if (emu := _emulator(mesh)) is not None:
        emu.wait_until(emu.post_ring(group_ranks(mesh), nbytes(x) * (n - 1), started), started)
    return out


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, label: str) -> None:
    """Every rank's x, concatenated along dim 0 into `out`, over a process group as FSDP hands one
    to its communication hooks (parallel/fsdp/quantized.py; no mesh there): counted under dim
    "fsdp", as all_gather counts; paced by an installed link hook that covers "fsdp"."""
    n, started = group.size(), time.monotonic()
    with _own():
        _all_gather_single(out, x.contiguous(), group=group)
    _count_group(group, label, nbytes(x) * (n - 1), started)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, op, label: str) -> None:
    """FSDP's gradient reduce-scatter through this module (a benchmark's link hook paces it): x holds
    every group rank's chunk in order, `out` receives this rank's, reduced with `op`."""
    n, started = group.size(), time.monotonic()
    with _own():
        _reduce_scatter_single(out, x.contiguous(), op=op, group=group)
    _count_group(group, label, nbytes(x) * (n - 1) // n, started)


def _count_group(group, label: str, sent: int, started: float) -> None:
    """Count a ring collective over a bare process group under dim "fsdp"; wait out an emulated link."""
    key = ("fsdp", label)
    _BYTES[key] += sent
    _GROUPS[key].add(group.group_name)
    hook = link_hook()
    if hook is not None and group.size() > 1 and hook.covers("fsdp"):
        hook.wait_until(hook.post_ring(dist.get_process_group_ranks(group), sent, started), started)


def all_reduce(x: torch.Tensor, mesh, op=dist.ReduceOp.SUM, label: str = "all_reduce") -> torch.Tensor:
    n = mesh.size()
    if n == 1:
        return x
    started = time.monotonic()
    with _own():
        dist.all_reduce(x, op=op, group=group_of(mesh))
    _count(mesh, label, 2 * nbytes(x) * (n - 1) // n)
    if (emu := _emulator(mesh)) is not None:
        emu.wait_until(emu.post_ring(group_ranks(mesh), 2 * nbytes(x) * (n - 1) / n, started), started)
    return x


def all_reduce_async(x: torch.Tensor, mesh, label: str = "all_reduce") -> PendingTransfer:
    """all_reduce (a sum, in place) started and not waited for: `.wait()` returns x once summed (on an
    emulated link, once the modelled transfer is complete too). The caller leaves x alone until then."""
    n = mesh.size()
    if n == 1:
        return PendingTransfer(x, None, None, None)
    started = time.monotonic()
    with _own():
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group_of(mesh), async_op=True)
    moved = 2 * nbytes(x) * (n - 1) // n
    _count(mesh, label, moved)
    emu = _emulator(mesh)
    return PendingTransfer(x, work, None if emu is None else emu.post_ring(group_ranks(mesh), moved, started), emu)


class Pending:
    """Handles of in-flight point-to-point ops; `wait()` blocks until all have completed."""

    def __init__(self, works=()):
        self._works = list(works)

    @classmethod
    def join(cls, pendings) -> Pending:
        return cls([w for p in pendings for w in p._works])

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


def exchange(mesh, sends=(), recvs=(), label: str = "p2p") -> Pending:
    """Start point-to-point transfers within a 1-D mesh without waiting for them.

    sends: (tensor, group_rank_of_destination, tag); recvs: (buffer, group_rank_of_source, tag).
    Peers are given as ranks within the group; tags keep several messages between the same pair
    apart. Call `.wait()` on the result before reading the receive buffers.
    """
    sends, recvs = list(sends), list(recvs)
    if not sends and not recvs:
        return Pending()
    ranks = group_ranks(mesh)
    group = group_of(mesh)
    ops = []
    for t, peer, tag in sends:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), ranks[peer], group=group, tag=tag))
        _count(mesh, label, nbytes(t))
    for buf, peer, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], group=group, tag=tag))
    with _own():
        return Pending(dist.batch_isend_irecv(ops))


def broadcast_object(obj, mesh, src: int = 0):
    """Group rank `src`'s picklable object, on every rank of the 1-D mesh (not byte-counted: control data)."""
    if mesh.size() == 1:
        return obj
    box = [obj]
    with _own():
        dist.broadcast_object_list(box, src=group_ranks(mesh)[src], group=group_of(mesh))
    return box[0]


def all_gather_object(obj, mesh) -> list:
    """Every rank's picklable object of the 1-D mesh, by group rank, on each rank (not byte-counted: control data)."""
    if mesh.size() == 1:
        return [obj]
    out = [None] * mesh.size()
    with _own():
        dist.all_gather_object(out, obj, group=group_of(mesh))
    return out


def broadcast_object_in_group(obj, group, src: int = 0):
    """Global rank `src`'s picklable object on every rank of a process group (one not part of a mesh,
    e.g. the checkpoint manager's own group); not byte-counted: control data."""
    box = [obj]
    with _own():
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_reduce_in_group(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over a process group that is not part of a mesh (a CPU-side gloo group for control
    flags: preemption.StopOnSignal); not byte-counted: control data."""
    with _own():
        dist.all_reduce(x, op=op, group=group)
    return x


def barrier(mesh=None) -> None:
    """Wait until every rank of the 1-D mesh (all ranks when None) gets here (not byte-counted)."""
    if mesh is not None and mesh.size() == 1:
        return
    with _own():
        dist.barrier(group=None if mesh is None else group_of(mesh))


def world_mesh(device_type: str = "cpu"):
    """A 1-D mesh named "world" over every rank of the initialised process group (its default group),
    for callers outside a training layout (calibration, validation)."""
    return mesh_with_backstop(init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("world",)))
