"""Which storages are alive after every op of a region, measured on CPU: what a backward's peak
holds beyond what its forward saved (tests of memory/transients.py)."""

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _stored(t) -> bool:
    """A tensor with a storage of its own: not a DTensor (a wrapper whose local shard the mode sees too)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


class LiveStorages(TorchDispatchMode):
    """After every op, the bytes of each storage created in the mode that is still referenced
    (not a view or an in-place result of an op's inputs).

    Each storage is known by a serial number given when it is first seen, not by its address: the
    allocator hands a freed storage's address to a later one (glibc's reuse depends on the address
    layout, so it differs from run to run), and `peak` excludes storages that exist after the
    backward (the parameters' gradients) from every earlier step. By address, a temporary that had
    held a gradient's address earlier was excluded too, and the peak read 0.42-0.83 of the count in
    one run in three. While a storage is held here its address cannot be reused, so the address
    identifies it only as long as it is held."""

    def __init__(self):
        super().__init__()
        self.held, self.steps, self._serials = {}, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _stored(t)}
        for t in tree_leaves(out):
            if _stored(t):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.held and ptr not in inputs:
                    self._serials += 1
                    self.held[ptr] = (self._serials, t.untyped_storage())
        self.held = {p: v for p, v in self.held.items() if torch._C._storage_Use_Count(v[1]._cdata) > 1}
        self.steps.append({serial: s.nbytes() for serial, s in self.held.values()})
        return out

    def peak(self, besides=(), since: int = 0) -> int:
        """The most bytes live after any op from the `since`-th on, not counting the storages of the
        tensors `besides` (alive now; those the mode did not create are not counted anyway)."""
        ptrs = {t.untyped_storage().data_ptr() for t in besides}
        skip = {self.held[p][0] for p in ptrs if p in self.held}
        return max(sum(n for serial, n in live.items() if serial not in skip) for live in self.steps[since:])


def held_bytes(leave_out=()) -> int:
    """Bytes of the distinct storages behind every live plain tensor of this process (a DTensor's local shard is
    one of them), less those of the tensors `leave_out`: what a rank holds, FSDP2's private buffers included."""
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated reduce_op object warns)
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in objects
                if not isinstance(t, DTensor) and t.device.type != "meta"}
    for t in leave_out:
        storages.pop(t.untyped_storage().data_ptr(), None)
    return sum(storages.values())
