"""One low-precision copy of each weight per block call, however many token pieces the call runs in.

Under bf16 autocast over fp32 weights (one process off the `host` tier: memory/accounting.py
activation_dtype) every matmul casts its weight, and autograd saves that cast for the matmul's
backward. A block run in pieces (memory.block_chunk) whose pieces are stored rather than recomputed
(selective + offload_fraction: apply_policy.py `_in_parts`) cast each weight once per piece, and each
stored piece kept its own copy until backward: tokens x fraction / block_chunk copies of the block's
matmul weights on the device (an 8B block at 512K tokens, block_chunk 8192, fraction 1: 64 copies of
0.44 GB), where the accounting counts one.

`SharedCasts`, active around those pieces, makes each cast of a block weight (or of a view of one) after
the first (the same elements, unchanged, cast the same way) an alias of the first one's storage.
Autograd still records one cast per piece, whose backward hands that piece's weight gradient to the
fp32 weight in fp32, summed over the pieces in the same order as before; only the storage is shared,
and a cast is deterministic, so values and gradients are bit-identical. Autocast's own cache would not
do: it gives every piece the same cast node, whose incoming gradients autograd sums in bf16 before the
cast back (other bits), and it holds its copies until the outermost autocast region ends (step/loss.py
turns it off for that).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SharedCasts(TorchDispatchMode):
    """Casts (aten._to_copy) of `weights` or of views of them (an expert's transposed [E, in, out] weight:
    models/moe.py) made inside, each made once: later ones alias its storage. Each first cast is held here
    as long as this object lives (the caller drops it after the pieces; autograd then holds what backward
    needs)."""

    def __init__(self, weights):
        super().__init__()
        # by storage: a view of a weight is a new tensor at each use, over the weight's storage
        # (an expert weight under expert parallelism is a DTensor: its local shard, which its users cast, holds
        # the storage)
        local = (w.to_local() if hasattr(w, "to_local") else w for w in weights)
        self._storages = {w.untyped_storage().data_ptr() for w in local} - {0}
        self._casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._to_copy.default or len(args) != 1:
            return func(*args, **kwargs)
        t = args[0]
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._storages:
            return func(*args, **kwargs)
        # the same elements of the same weight, unchanged (the version: none is changed in place inside a
        # forward), cast the same way: the same values. The source is held with its cast, so the storage
        # keeps its address while the entry lives
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version,
               tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        held = self._casts.get(key)
        if held is None:
            held = self._casts[key] = (t, func(t, **kwargs))
        # a new tensor over the one storage (below autograd: no view of anything autograd knows), which
        # autograd makes this piece's cast output, with its own cast node
        return torch.ops.aten.alias.default(held[1])
