"""qgZ's reduce-scatter (parallel/fsdp/quantized.py QuantizedReduceScatter) run in one process: each rank of an
FSDP group of `nodes` x `local` ranks a thread calling the hook itself, the all-to-alls exchanging the threads'
packed rows (tests/unit/test_leftovers119_quant.py; tests/distributed/test_leftovers119_quant_ranks.py runs the
hook over gloo ranks against gloo's own fp32 reduce-scatter)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from longctx.parallel.fsdp import quantized
from longctx.parallel.fsdp.quantized import QuantizedReduceScatter


class _Level:
    """One level of the node mesh ("inter" or "intra") as the hook reads it: its size, and the ranks of a
    rank's group there (nodes of consecutive ranks)."""

    def __init__(self, nodes: int, local: int, across: bool):
        self.nodes, self.local, self.across = nodes, local, across

    def size(self) -> int:
        return self.nodes if self.across else self.local

    def members(self, rank: int) -> list[int]:
        node, index = divmod(rank, self.local)
        if self.across:
            return [a * self.local + index for a in range(self.nodes)]
        return [node * self.local + b for b in range(self.local)]


class _AllToAll:
    """quantized.all_to_all among the threads: row i of what a rank sends goes to its group's member i."""

    def __init__(self, size: int):
        self.barrier, self.sent, self.me = threading.Barrier(size), {}, threading.local()

    def __call__(self, packed: torch.Tensor, level: _Level, label: str) -> torch.Tensor:
        rank = self.me.rank
        self.sent[rank] = packed
        self.barrier.wait()
        members = level.members(rank)
        got = torch.stack([self.sent[peer][members.index(rank)] for peer in members])
        self.barrier.wait()  # (nobody sends the next exchange's rows before every rank has read these)
        return got


def qgz_reduce(grads: torch.Tensor, nodes: int, local: int, block: int, avg: bool = False,
               compiled: bool = False) -> torch.Tensor:
    """grads [size, size x n] (rank r's flat gradients, chunk c bound for rank c) -> [size, n]: what the hook
    leaves in each rank's output."""
    size, n = nodes * local, grads.shape[1] // (nodes * local)
    exchange, out, errors = _AllToAll(size), torch.full((size, n), 99.0, dtype=grads.dtype), []
    mesh = {"inter": _Level(nodes, local, True), "intra": _Level(nodes, local, False)}
    op = torch.distributed.ReduceOp.AVG if avg else torch.distributed.ReduceOp.SUM

    def rank(r: int) -> None:
        exchange.me.rank = r
        rs = object.__new__(QuantizedReduceScatter)  # (no process group: the hook's own arithmetic)
        rs.block, rs.mesh, rs.compiled, rs.size, rs._ours = block, mesh, compiled, size, {"emulated": True}
        try:
            rs(out[r], grads[r].clone(), SimpleNamespace(group_name="emulated"), op)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
            exchange.barrier.abort()

    original, quantized.all_to_all = quantized.all_to_all, exchange
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        quantized.all_to_all = original
    if errors:
        raise errors[0]
    return out
