"""Find device-to-host synchronisations inside a training step (a test tool: tests put it in the
Trainer's `device_section`, around each step's forward and backward; `from host_sync import ...`,
tests/ being on pytest's path).

A host read of device data (`.item()`, `float(t)`, `bool(t)`, a boolean mask, `nonzero`, `unique`)
makes the CPU wait for the GPU queue to drain: the launch pipeline stalls and communication can no
longer overlap computation. On CUDA `torch.cuda.set_sync_debug_mode("error")` catches these; on a
CPU there is no queue to drain, so `HostSyncProbe` recognises the same operations by name as they
pass the dispatcher. Both run in CI through `no_host_sync()`; the probe is what a CPU-only test can
check, and it flags exactly the operations that would synchronise on a GPU.

The backward pass of CPU tensors runs on the calling thread, so a probe around `loss.backward()`
sees the backward too.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# operations whose result (or result shape) the host must read from the device
SYNCING_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t) of a one-element tensor
    aten.is_nonzero.default,           # bool(t) / `if t:`
    aten.nonzero.default,              # output shape depends on the data (nonzero_static does not)
    aten.masked_select.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,     # without output_size the length is read from the device
}


def _is_syncing(func, args) -> bool:
    if func in SYNCING_OPS:
        return True
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)  # boolean masks
    return False


# tensor methods that copy device data to the host without passing the dispatcher as an operation
# (on CUDA `.tolist()` is a device-to-host copy; on a CPU tensor the dispatcher never sees it)
HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


class HostSyncError(RuntimeError):
    pass


class _HostReadMethods(TorchFunctionMode):
    """The half of the probe that sees tensor methods (`.tolist()`, `.numpy()`) before dispatch."""

    def __init__(self, probe: HostSyncProbe):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS:
            self.probe.saw(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class HostSyncProbe(TorchDispatchMode):
    """Records (or, with raise_on_sync, refuses) every operation that reads device data on the host."""

    def __init__(self, raise_on_sync: bool = True):
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.syncs: list[tuple[str, str]] = []  # (operation, where in our code)

    def saw(self, what: str) -> None:
        where = _our_frame()
        self.syncs.append((what, where))
        if self.raise_on_sync:
            raise HostSyncError(f"host synchronisation inside the step: {what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_syncing(func, args):
            self.saw(str(func))
        return func(*args, **(kwargs or {}))


def _our_frame() -> str:
    """The innermost longctx frame that issued the operation (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/longctx/" in frame.filename and not frame.filename.endswith("host_sync.py"):
            return f"{frame.filename.rsplit('/longctx/', 1)[1]}:{frame.lineno} {frame.name}"
    return "outside longctx"


@contextlib.contextmanager
def no_host_sync(device: torch.device | str = "cpu", raise_on_sync: bool = True):
    """Fail (or record, yielding the probe) on host synchronisation inside the block: the dispatch
    probe everywhere, plus CUDA's own sync debug mode on a GPU."""
    device = torch.device(device)
    previous = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error" if raise_on_sync else "warn")
    try:
        probe = HostSyncProbe(raise_on_sync)
        with _HostReadMethods(probe), probe:
            yield probe
    finally:
        if previous is not None:
            torch.cuda.set_sync_debug_mode(previous)
