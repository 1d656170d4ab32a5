"""One low-precision copy of each weight per block call, however many token pieces the call runs in.

Under bf16 autocast over fp32 weights (one process off the `host` tier: memory/accounting.py
activation_dtype) every matmul casts its weight, and autograd saves that cast for the matmul's
backward. A block run in pieces (memory.block_chunk) whose pieces are stored rather than recomputed
(selective + offload_fraction: apply_policy.py `_in_parts`) cast each weight once per piece, and each
stored piece kept its own copy until backward: tokens x fraction / block_chunk copies of the block's
matmul weights on the device (an 8B block at 512K tokens, block_chunk 8192, fraction 1: 64 copies of
0.44 GB), where the accounting counts one. With fraction < 1 the other pieces are recomputed in backward,
before the stored ones' backward (they hold the later tokens), and each recomputation cast the weights
afresh while the stored pieces' copy was alive: two copies of the block's weights (0.41 GiB more for an
8B block), where one suffices.

`SharedCasts`, active around every piece of such a call, makes each cast of a block weight (or of a view
of one) after the first (the same elements, unchanged, cast the same way) an alias of the first one's
storage: the stored pieces' and the recomputed pieces' forward while the call runs, and afterwards the
recomputations in backward, as long as the stored pieces' saved casts keep that storage alive.
Autograd still records one cast per piece, whose backward hands that piece's weight gradient to the
fp32 weight in fp32, summed over the pieces in the same order as before; only the storage is shared,
and a cast is deterministic, so values and gradients are bit-identical. Autocast's own cache would not
do: it gives every piece the same cast node, whose incoming gradients autograd sums in bf16 before the
cast back (other bits), and it holds its copies until the outermost autocast region ends (step/loss.py
turns it off for that).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SharedCasts(TorchDispatchMode):
    """Casts (aten._to_copy) of `weights` or of views of them (an expert's transposed [E, in, out] weight:
    models/moe.py) made inside, each made once: later ones alias its storage. While the block call runs each
    first cast is held here; `release()` at the call's end keeps them only weakly (autograd then holds what
    backward needs), so a recomputation in backward, run inside again, aliases a first cast while the stored
    pieces still keep it and casts afresh, keeping nothing here, once they do not."""

    def __init__(self, weights):
        super().__init__()
        # by storage: a view of a weight is a new tensor at each use, over the weight's storage
        # (an expert weight under expert parallelism is a DTensor: its local shard, which its users cast, holds
        # the storage)
        local = (w.to_local() if hasattr(w, "to_local") else w for w in weights)
        self._storages = {w.untyped_storage().data_ptr() for w in local} - {0}
        # key -> (source, cast) while the call runs; None after release()
        self._casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] | None = {}
        # key -> (source, the cast's storage held weakly, the cast's dtype, offset, shape, stride) after it
        self._released: dict[tuple, tuple] = {}

    def release(self) -> None:
        """The block call's forward is over: from now on a cast is shared only while autograd keeps it."""
        self._released = {key: (source, weakref.ref(cast.untyped_storage()), cast.dtype, cast.storage_offset(),
                                tuple(cast.shape), cast.stride())
                          for key, (source, cast) in self._casts.items()}
        self._casts = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._to_copy.default or len(args) != 1:
            return func(*args, **kwargs)
        t = args[0]
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._storages:
            return func(*args, **kwargs)
        # the same elements of the same weight, unchanged (the version: none is changed in place inside a
        # forward, nor between a forward and its backward), cast the same way: the same values. The source
        # is held with its entry, so its storage (_cdata) is no other's while the entry lives; with the
        # address, an FSDP weight freed and gathered again elsewhere, or another weight gathered where it
        # was, matches no entry
        key = (storage._cdata, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version,
               tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        if self._casts is None:
            live = self._alias_of_live(key)
            return func(t, **kwargs) if live is None else live
        held = self._casts.get(key)
        if held is None:
            held = self._casts[key] = (t, func(t, **kwargs))
        # a new tensor over the one storage (below autograd: no view of anything autograd knows), which
        # autograd makes this piece's cast output, with its own cast node
        return torch.ops.aten.alias.default(held[1])

    def _alias_of_live(self, key) -> torch.Tensor | None:
        """After release(): a new tensor over the first cast's storage while autograd still keeps it, else None."""
        entry = self._released.get(key)
        storage = entry[1]() if entry is not None else None
        if storage is None:
            return None
        _, _, dtype, offset, shape, stride = entry
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
