"""The only module that calls torch.distributed communication ops, with exact byte counters.

Every call names the mesh dim it runs over (a 1-D DeviceMesh such as `mesh["ctx"]`) and a label
for what it carries; `counters()` returns the bytes THIS rank sent, per dim and label:

- all_to_all: the bytes of the chunks that leave this rank ((n-1)/n of the input);
- all_gather: the input once to each of the n-1 peers' outputs is counted as (n-1)/n of the
  output, the volume of a bandwidth-optimal ring all-gather;
- all_reduce: 2 (n-1)/n of the tensor (ring all-reduce);
- exchange (point-to-point): the bytes of every tensor sent.

Groups of size 1 communicate nothing and count nothing.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

_BYTES: dict[tuple[str, str], int] = defaultdict(int)

# torch >= 2.10 renamed all_gather_into_tensor (output concatenated along dim 0) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def counters() -> dict[str, dict[str, int]]:
    """{dim: {label: bytes sent by this rank}} since the last reset."""
    out: dict[str, dict[str, int]] = {}
    for (dim, label), n in sorted(_BYTES.items()):
        out.setdefault(dim, {})[label] = n
    return out


def reset_counters() -> None:
    _BYTES.clear()


def _count(mesh, label: str, nbytes: int) -> None:
    _BYTES[(dim_name(mesh), label)] += int(nbytes)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dim_name(mesh) -> str:
    names = mesh.mesh_dim_names
    return names[0] if names else "?"


def group_ranks(mesh) -> list[int]:
    """Global ranks of this 1-D mesh, in group order."""
    return mesh.mesh.flatten().tolist()


def all_to_all(x: torch.Tensor, mesh, label: str = "all_to_all") -> torch.Tensor:
    """x [n, ...]: slice i goes to group rank i; returns [n, ...] whose slice j came from rank j."""
    n = mesh.size()
    if x.shape[0] != n:
        raise ValueError(f"all_to_all over '{dim_name(mesh)}' needs a leading dim of {n}, got {tuple(x.shape)}")
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=mesh.get_group())
    _count(mesh, label, nbytes(x) * (n - 1) // n)
    return out


def all_gather(x: torch.Tensor, mesh, label: str = "all_gather") -> torch.Tensor:
    """Returns [n, *x.shape] with every group rank's x, in group order."""
    n = mesh.size()
    if n == 1:
        return x[None]
    x = x.contiguous().reshape(1, *x.shape)
    out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=mesh.get_group())
    _count(mesh, label, nbytes(x) * (n - 1))
    return out


def all_reduce(x: torch.Tensor, mesh, op=dist.ReduceOp.SUM, label: str = "all_reduce") -> torch.Tensor:
    n = mesh.size()
    if n == 1:
        return x
    dist.all_reduce(x, op=op, group=mesh.get_group())
    _count(mesh, label, 2 * nbytes(x) * (n - 1) // n)
    return x


class Pending:
    """Handles of in-flight point-to-point ops; `wait()` blocks until all have completed."""

    def __init__(self, works=()):
        self._works = list(works)

    @classmethod
    def join(cls, pendings) -> "Pending":
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
    group = mesh.get_group()
    ops = []
    for t, peer, tag in sends:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), ranks[peer], group=group, tag=tag))
        _count(mesh, label, nbytes(t))
    for buf, peer, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], group=group, tag=tag))
    return Pending(dist.batch_isend_irecv(ops))


def broadcast_object(obj, mesh, src: int = 0):
    """Group rank `src`'s picklable object, on every rank of the 1-D mesh (not byte-counted: control data)."""
    if mesh.size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=group_ranks(mesh)[src], group=mesh.get_group())
    return box[0]
