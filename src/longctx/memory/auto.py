"""`memory.offload_fraction = auto`: the largest fraction whose transfers hide behind compute and
whose host copies fit in host memory (MEMO's rule, applied to this implementation's byte counts).

An offloaded block always sends its input and attention state (S_fixed) and the first A of the
other activations (A x S_other) to the host:

  A_link   = (t_block_forward x host_link_bandwidth - S_fixed) / S_other
  A_memory = (0.8 x host_memory_per_rank - H - R_fixed) / R_other   (R: the rank's whole host tier, every
             offloaded block's and what the run's other settings put there, attention_offload's; H: the
             rest of the rank's host bytes, the model-state tier's states, checkpoint staging, the loader)
  A        = min(1, A_link, A_memory), rounded down to a multiple of 0.05 (at least 0.05 when host
             memory allows it; else A_memory rounded down to 0.001); 0 (no offload) when even
             S_fixed does not fit in host memory

t_block_forward is measured on the real block (attention and its communication included), the
host link by timing a copy of 64 MiB to host memory (pinned on CUDA), the host memory from
/proc/meminfo shared by the ranks of this node.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch

from .accounting import estimate_activations
from .host_parts import pinned_activation_bytes
from .policy import MemoryPolicy


def host_link_bandwidth(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes/s of a device -> host copy (on CPU: a copy into another buffer, the host tier there)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=device.type == "cuda")
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


CGROUP_ROOT = "/sys/fs/cgroup"


def host_memory_available() -> int:
    """Bytes of memory the OS could give us now (host_memory_free's figure)."""
    return host_memory_free()[0]


def host_memory_free() -> tuple[int, str]:
    """(bytes of memory the OS could give us now, where the figure comes from): MemAvailable (total memory as
    a fallback), or less where this process's memory cgroup (a container's or a batch job's limit) leaves
    less. MemAvailable is the machine's: inside a container limited to 64 GiB on a 1 TB machine it says
    ~1 TB, and a run sized by it is killed by the cgroup's OOM killer, what the host budget exists to prevent."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    source = "free (MemAvailable)"
    if free is None:
        free, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"
    limited = cgroup_memory_available()
    if limited is not None and limited < free:
        return limited, "free under this process's memory cgroup limit (a container's or a job's memory.max)"
    return free, source


def cgroup_memory_available(root: str | None = None) -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less its usage, reclaimable page cache
    counted as free: the file pages, active and inactive, as MemAvailable counts them, the kernel reclaiming
    either before the cgroup's OOM killer acts), the tightest over the cgroup and its parents; None where no
    limit is set or none is readable. cgroup v2 (memory.max, memory.current, memory.stat's inactive_file and
    active_file) and v1 (memory/memory.limit_in_bytes, memory.usage_in_bytes, memory.stat's total_*_file)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v2 = next((path for _, names, path in fields if not names), "/")
    v1 = next((path for _, names, path in fields if "memory" in names.split(",")), "/")
    best, root = None, root or CGROUP_ROOT
    for base, path, files in ((root, v2, ("memory.max", "memory.current", ("inactive_file", "active_file"))),
                              (os.path.join(root, "memory"), v1, ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                                  ("total_inactive_file", "total_active_file")))):
        parts = [p for p in path.split("/") if p and p != ".."]
        # the cgroup's own directory and each parent up to the mount's root (a container sees its own as "/")
        for depth in range(len(parts), -1, -1):
            left = _cgroup_left(os.path.join(base, *parts[:depth]), *files)
            if left is not None:
                best = left if best is None else min(best, left)
    return best


def _cgroup_left(directory: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> int | None:
    """limit - usage + reclaimable page cache (memory.stat's `cache_keys`) of one cgroup directory (None: no
    limit there)."""
    try:
        with open(os.path.join(directory, limit_file)) as f:
            text = f.read().strip()
        if text == "max" or not text.isdigit() or int(text) >= 2**62:  # (v1's "no limit" is ~2**63)
            return None
        limit = int(text)
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    cache = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in cache_keys:
                    cache += int(value)
    except (OSError, ValueError):
        pass
    return max(0, min(limit, limit - usage + cache))


@torch.no_grad()
def measured_block_forward_seconds(block, x, cos, sin, doc_ids, repeats: int = 2) -> float:
    """Wall time of one block forward (the first call warms up)."""
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.device.type == "cuda" else (lambda: None)
    block(x, cos, sin, doc_ids)
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        block(x, cos, sin, doc_ids)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def choose_offload_fraction(model_cfg, seq_len: int, micro_batch: int, *, head: int, ctx: int, skip_last: int,
                            dtype_bytes: int, block_seconds: float, link_bytes_per_s: float,
                            host_bytes_per_rank: float, policy: MemoryPolicy | None = None,
                            expert: int = 1, host_bytes_taken: float = 0.0,
                            pinned: bool = False, autocast: bool = False,
                            expert_replicas: int = 0, expert_ranks_per_node: int = 0) -> tuple[float, str]:
    """(fraction, the reason in one line) from measured times and bandwidths. `policy`: the run's other
    [memory] settings (attention_offload, expert_chunk, block_chunk...; its recompute and fraction are
    replaced): they change what the rank keeps on the host, so they must be counted; `expert`: the
    expert-parallel degree, `expert_replicas` its FlexMoE copy slots and `expert_ranks_per_node` its hierarchical
    dispatch, as the host budget counts them;
    `host_bytes_taken`: the rank's host bytes besides the offloaded activations (the model-state tier's
    states, checkpoint staging, the data loader: train/host_budget.py host_bytes_besides_offload), which
    the 0.8 x host_bytes_per_rank must hold too. `pinned` (a CUDA device): the offloaded parts are pinned,
    each locked rounded up to a power of two (memory/host_parts.py), so the fraction is lowered until that
    figure fits too (the byte count alone is linear in the fraction; the locked one is not). `autocast`: one
    process in bf16 autocast over fp32 weights (dtype_bytes 4: memory/accounting.py activation_dtype), whose
    offloaded activations are counted at each tensor's dtype, as the host budget counts them (at 4 B each,
    1.5x what is offloaded, auto chose a smaller fraction than host memory allows)."""
    base = policy if policy is not None else MemoryPolicy()
    shape = dict(head=head, ctx=ctx, dtype_bytes=dtype_bytes, expert=expert, autocast=autocast,
                 expert_replicas=expert_replicas, expert_ranks_per_node=expert_ranks_per_node)

    def at(a):  # the run's policy, offloading fraction a of the blocks' activations
        return dataclasses.replace(base, recompute="selective", offload_fraction=a, offload_skip_last=skip_last)

    def host(a):
        est = estimate_activations(model_cfg, seq_len, micro_batch, policy=at(a), **shape)
        return est.per_block_host, est.total_host

    offloaded = max(0, model_cfg.layers - skip_last)
    if offloaded == 0:
        return 0.0, f"nothing to offload: all {model_cfg.layers} blocks are among the last offload_skip_last"
    (whole, whole_rank), (half, half_rank) = host(1.0), host(0.5)
    other, other_rank = 2 * (whole - half), 2 * (whole_rank - half_rank)
    fixed, fixed_rank = whole - other, whole_rank - other_rank
    # host memory holds the rank's whole host tier: every offloaded block's, and what the kept blocks
    # put there too (memory.attention_offload's core state)
    # and what the run's other parts keep there (memory.model_states host / host_optimizer: 16 B per parameter)
    budget = 0.8 * host_bytes_per_rank - host_bytes_taken
    taken = f" ({host_bytes_taken / 2**30:.2f} GiB of it taken by the model states and the rest)" \
        if host_bytes_taken > 0 else ""
    if budget < fixed_rank:
        return 0.0, (f"offload_fraction auto -> 0 (offload off): {offloaded} blocks x {fixed / 2**20:.1f} MiB of block "
                     f"inputs and attention state would not fit in {host_bytes_per_rank / 2**30:.1f} GiB of host "
                     f"memory per rank{taken}; raise memory.offload_skip_last or add host memory")
    a_link = (block_seconds * link_bytes_per_s - fixed) / other
    a_mem = (budget - fixed_rank) / other_rank
    fraction, limit = _fraction_and_limit(a_link, a_mem)
    reason = (f"offload_fraction auto -> {fraction:.3g} (limited by {limit}): a block's forward takes "
              f"{block_seconds * 1e3:.1f} ms and the host link moves {link_bytes_per_s / 1e9:.1f} GB/s; a block "
              f"always offloads {fixed / 2**20:.1f} MiB (input, attention state) plus A x {other / 2**20:.1f} MiB, "
              f"which hides behind its forward up to A = {max(a_link, 0.0):.2f}; {host_bytes_per_rank / 2**30:.1f} GiB "
              f"of host memory per rank{taken} allows A = {min(a_mem, 1.0):.2f} over {offloaded} blocks")
    if a_link < 0.05:
        reason += " (transfers will not fully hide behind compute even at the smallest fraction)"
    if pinned:
        locked = lambda a: pinned_activation_bytes(model_cfg, seq_len, micro_batch, policy=at(a), **shape)
        fraction, reason = _fit_pinned(fraction, reason, locked, budget)
    return fraction, reason


def _fraction_and_limit(a_link: float, a_mem: float) -> tuple[float, str]:
    """choose_offload_fraction's fraction, in steps of 0.05 (finer only where host memory allows less than
    0.05), from the largest the host link hides (`a_link`) and host memory holds (`a_mem`), and which of them
    limits it."""
    fraction = math.floor(min(1.0, a_link, a_mem) * 20) / 20
    if fraction < 0.05:
        # a slow link may not push the fraction under 0.05 (its transfers then show), host memory must:
        # a fraction above a_mem would put more on the host than it holds
        fraction = 0.05 if a_mem >= 0.05 else max(math.floor(a_mem * 1000) / 1000, 1e-6)
    limit = ("host memory" if a_mem < min(1.0, a_link, 0.05) else "the host link" if a_link <= min(1.0, a_mem)
             else "host memory" if a_mem < 1.0 else "nothing")
    return fraction, limit


def _fit_pinned(fraction: float, reason: str, locked, budget: float) -> tuple[float, str]:
    """The largest fraction at most `fraction` (in steps of 0.05, then halving) whose pinned host bytes,
    locked(fraction), fit `budget`; 0 (offload off) when none does."""
    chosen = fraction
    while chosen > 0 and locked(chosen) > budget:
        step = math.floor(round(chosen * 20, 9) - 1) / 20 if chosen > 0.05 else chosen / 2
        chosen = step if step >= 1e-6 else 0.0
    if chosen == fraction:
        return fraction, reason
    return chosen, (f"{reason}; pinned, the offloaded parts lock {locked(fraction) / 2**30:.2f} GiB at "
                    f"A = {fraction:.3g} (each rounded up to a power of two): A = {chosen:.3g} fits")

