"""The bytes of the collectives that PyTorch libraries (FSDP2) issue themselves, outside job/comm.py's
counters: `library_traffic()` watches the c10d operators as they dispatch."""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .comm import _OWN, nbytes

# c10d operators of the collectives PyTorch libraries issue (FSDP2), by how this rank's bytes are counted
_GATHERS = {"_allgather_base_", "allgather_into_tensor_coalesced_"}         # (n-1)/n of the output
_SCATTERS = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"}   # (n-1)/n of the input
_REDUCES = {"allreduce_", "allreduce_coalesced_"}                          # 2 (n-1)/n of the tensor
_CONTROL = {"barrier", "monitored_barrier_"}


def _bytes_of(x) -> int:
    if isinstance(x, torch.Tensor):
        return nbytes(x)
    if isinstance(x, (list, tuple)):
        return sum(_bytes_of(item) for item in x)
    return 0


def _library_op_bytes(name: str, args) -> tuple[str, float]:
    """(label, bytes this rank sends) of one c10d operator call, by the conventions above."""
    if name in _GATHERS:  # (output, input, group, ...)
        out, inp = _bytes_of(args[0]), _bytes_of(args[1])
        n = round(out / inp)
        return "all_gather", (n - 1) / n * out
    if name in _SCATTERS:  # (output, input, group, op, ...)
        out, inp = _bytes_of(args[0]), _bytes_of(args[1])
        n = round(inp / out)
        return "reduce_scatter", (n - 1) / n * inp
    if name in _REDUCES:  # (tensors, group, op, ...): the group travels boxed
        n = dist.ProcessGroup.unbox(args[1]).size()
        return "all_reduce", 2 * (n - 1) / n * _bytes_of(args[0])
    return name, float(_bytes_of(args))


@contextlib.contextmanager
def library_traffic():
    """Count the bytes this rank sends in the collectives that something other than this module
    (FSDP2) issues inside the block. Yields a dict that fills in as they run: {"all_gather" |
    "reduce_scatter" | "all_reduce": bytes}, with the conventions of the counters above (all-gather:
    (n-1)/n of the output; reduce-scatter: (n-1)/n of the input; all-reduce: 2 (n-1)/n of the
    tensor). Any other c10d operator is recorded under its own name with the bytes of its tensors,
    so nothing passes unseen. A TorchDispatchMode: every c10d operator dispatches through it,
    whichever Python API issued it; the ones this module's functions issue are left out (their
    bytes are in `counters()`)."""
    found: dict[str, float] = defaultdict(float)

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "c10d" and func._opname not in _CONTROL and not getattr(_OWN, "depth", 0):
                label, sent = _library_op_bytes(func._opname, args)
                found[label] += sent
            return out

    with _Watch():
        yield found
