"""Pinned host memory as torch allocates it, and buffers carved so that none of it is wasted.

torch's caching host allocator (ATen/core/CachingHostAllocator.h, `allocate`; torch 2.6 to 2.13 at
least) rounds every pinned request up to the next power of two: `torch.empty(..., pin_memory=True)`,
`t.pin_memory()` and a non-blocking device-to-host `.to("cpu")` of 2.1 GB lock 4 GiB. Newer torch
can lift the rounding above `pinned_max_round_threshold_mb` (an allocator-config key older torch
lacks; by default there is no threshold: every size is rounded), so longctx does not rely on it:

- what longctx pins for the whole run (step/host_optimizer.py's fp32 masters and gradient buffers)
  is carved out of slabs whose sizes are exact powers of two (`carve`): the allocator rounds nothing,
  and the waste is what the packing leaves (`plan_slabs`: at most one slab is under half full);
- what longctx cannot carve (FSDP2's CPU-offload shards and gradients, pinned per tensor by FSDP; the
  offloaded activation parts, pinned as they come) costs `pinned_bytes` per tensor, which is what
  costs/host_bytes.py counts.

Nothing is pinned on a CPU run (`pins`): there the sizes are the tensors' own.
"""

from __future__ import annotations

import math

import torch

ALIGN = 512  # bytes: each carved tensor starts on this boundary (vectorised kernels, any dtype)


def pins(device: torch.device | str) -> bool:
    """Whether host buffers that serve `device` are pinned (page-locked): only for a CUDA device."""
    return torch.device(device).type == "cuda"


def pow2_ceil(n: int) -> int:
    """The least power of two >= n (0 for 0)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pinned_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator locks for one pinned request of `nbytes`."""
    return pow2_ceil(nbytes)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_slabs(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where tensors of `sizes` bytes go: (slab sizes, (slab, byte offset) per tensor), every slab a
    power of two. First fit, largest first, into slabs of the least power of two that holds the largest
    tensor (and at least 1/8 of the total: fewer, fuller slabs); each slab then shrinks to the least
    power of two that holds what it got. Two slabs can never both be at most half full (the later's
    tensors would have fit in the earlier), so the waste is bounded; in practice it is a few percent
    (tests/unit/test_pinned_slabs.py)."""
    total = sum(_aligned(s) for s in sizes)
    if total == 0:
        return [], [(0, 0)] * len(sizes)
    cap = pow2_ceil(max(max(_aligned(s) for s in sizes), total // 8))
    used: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        need = _aligned(sizes[i])
        if need == 0:
            continue
        slab = next((k for k, u in enumerate(used) if u + need <= cap), len(used))
        if slab == len(used):
            used.append(0)
        where[i] = (slab, used[slab])
        used[slab] += need
    return [pow2_ceil(u) for u in used], where


def planned_pinned_bytes(sizes: list[int]) -> int:
    """Host bytes `carve` pins for tensors of `sizes` bytes (the sum of plan_slabs' slabs)."""
    return sum(plan_slabs(sizes)[0])


def allocate(nbytes: int) -> torch.Tensor:
    """`nbytes` of pinned host memory (a power of two from `carve`: the allocator rounds nothing)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def carve(specs: list[tuple[torch.Size | tuple, torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """Host tensors of the given (shape, dtype), uninitialised: each its own allocation when not `pin`,
    else views into pinned power-of-two slabs (plan_slabs) allocated through `allocate`."""
    if not pin:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    slab_sizes, where = plan_slabs(sizes)
    slabs = [allocate(n) for n in slab_sizes]
    out = []
    for (shape, dtype), size, (slab, offset) in zip(specs, sizes, where):
        if size == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        out.append(slabs[slab][offset:offset + size].view(dtype).view(shape))
    return out
