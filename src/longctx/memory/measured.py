"""Activation memory as measured: `measure_activations` runs one forward under a dispatch mode that records every
storage an op creates, then counts those still referenced after the forward (by autograd, by a checkpoint keeping
its inputs, by the host offloader), attributed to the block that created them and split into device and host tier.
It measures structure (bytes held), not the allocator, so it works on CPU as on GPU; memory/accounting.py's
analytic count is checked against it to the byte.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..ops.chunked import chunk_store_host_ptrs


class _StorageTracker(TorchDispatchMode):
    """Records every storage an op creates (not aliases of its inputs), holding a reference so the
    address cannot be reused; afterwards a storage is live iff someone besides us refers to it.
    Storages only we still hold are dropped from time to time (amortised), so temporaries are
    freed as they would be without the tracker."""

    def __init__(self):
        super().__init__()
        self.block: int | None = None
        self.created: dict[int, tuple[torch.UntypedStorage, int | None]] = {}
        self._prune_at = 256

    def prune(self) -> None:
        self.created = {p: v for p, v in self.created.items() if torch._C._storage_Use_Count(v[0]._cdata) > 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in inputs and ptr not in self.created:
                    self.created[ptr] = (st, self.block)
        if len(self.created) >= self._prune_at:
            self.prune()
            self._prune_at = max(256, 2 * len(self.created))
        return out


def measure_activations(model, tokens, positions=None, doc_ids=None, labels=None, backward: bool = True,
                        extra_loss=None) -> dict:
    """Run one forward (and backward) of `model` and report the bytes held for backward after the
    forward: {"blocks": [{"device": B, "host": B}, ...], "model": {...}, "total_device", "total_host"}.
    `extra_loss(model)`: a term (or None) the backward adds to the loss, made after the count (its tensors are
    no activation): step/loss.py router_loss, so that an MoE model's backward is a training step's."""
    tracker = _StorageTracker()
    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_pre_hook(lambda mod, args, i=i: setattr(tracker, "block", i)))
        handles.append(block.register_forward_hook(lambda mod, args, out: setattr(tracker, "block", None)))
    try:
        with tracker:
            loss = model(tokens, positions, doc_ids, labels=labels)
    finally:
        for h in handles:
            h.remove()
    offloader = getattr(model, "memory_offloader", None)
    host_ptrs = offloader.host_storage_ptrs() if offloader is not None else set()
    host_ptrs |= chunk_store_host_ptrs()  # the chunked attention core's host-resident chunks
    # (an expert-parallel model's expert weights are DTensors: their local shards hold the storage)
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
              for p in model.parameters()}

    def count():
        gc.collect()  # tensors held only by reference cycles (finished communication handles) are not held
        held = defaultdict(lambda: {"device": 0, "host": 0})
        for ptr, (st, block) in tracker.created.items():
            if ptr in params or torch._C._storage_Use_Count(st._cdata) <= 1:
                continue
            held[block]["host" if ptr in host_ptrs else "device"] += st.nbytes()
        return {k: dict(v) for k, v in held.items()}

    held = count()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # a finished ring send's buffer can stay referenced by the backend's worker thread for a
        # moment after wait() returned (seen under load): count until two counts agree
        for _ in range(50):
            time.sleep(0.05)
            again = count()
            if again == held:
                break
            held = again
    held = defaultdict(lambda: {"device": 0, "host": 0}, held)
    tracker.created.clear()
    if backward:
        term = None if extra_loss is None else extra_loss(model)
        (loss if term is None else loss + term).backward()
    blocks = [dict(held.get(i, {"device": 0, "host": 0})) for i in range(len(model.layers))]
    return {
        "blocks": blocks,
        "model": dict(held.get(None, {"device": 0, "host": 0})),
        "total_device": sum(b["device"] for b in blocks) + held[None]["device"],
        "total_host": sum(b["host"] for b in blocks) + held[None]["host"],
    }
