"""Closed forms of the bytes per optimizer step that cross node boundaries, and that stay inside
nodes, for each mode of `longctx bench comm --cluster` (docs/parallelism.md states them; tests/
distributed/test_bench_comm.py checks the emulated cluster's count against them, exactly).

A job of `nodes` x `ranks` ranks, ranks placed node by node. Bytes are job totals: the sum over
ranks of what each puts on a hop. A ring collective (all-gather, reduce-scatter, all-reduce) over a
group of g ranks spanning k nodes sends, from each rank, its share (n - 1) times to its ring
successor; k of the g successors are on another node. So one ring collective whose ranks send s
bytes each puts k x s across nodes and (g - k) x s inside them. An all-to-all sends each row
straight to its peer: across nodes when the peer's node is another.

The step of one micro-batch under FSDP2: each block unit is all-gathered for forward and again for
backward and reduce-scattered once; the root module (embeddings, final norm, LM head) gathered once
(FSDP2 keeps it unsharded from forward to backward) and reduce-scattered once; the metrics all-reduce
of the step's loss (one float64 over every rank). A unit's shard is its flat parameters padded to a
multiple of the group size, fp32 on CPU (`Unit.elements` per rank).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    elements: int  # this unit's padded shard per rank of the full FSDP group, in elements
    node_elements: int  # ... of a group of one node's ranks (hpz's backward gather; co2's replica)
    root: bool = False  # the root module: gathered once per step


def _ring(ranks: int, nodes: int, sent: int) -> tuple[int, int]:
    """(inter, intra) bytes of a ring collective over `ranks` ranks on `nodes` nodes, `sent` bytes each
    (a ring inside one node never leaves it)."""
    crossing = nodes if nodes > 1 else 0
    return crossing * sent, (ranks - crossing) * sent


def _add(total: list[int], part: tuple[int, int], times: float = 1.0) -> None:
    total[0] += int(part[0] * times)
    total[1] += int(part[1] * times)


def _int8_blocks(elements: int, block: int) -> int:
    """Bytes of `elements` values sent as int8 blocks of `block` with one fp32 scale each."""
    blocks = -(-elements // block)
    return blocks * block + 4 * blocks


def step_bytes(mode: str, units: list[Unit], nodes: int, ranks: int, block: int = 512,
               local_steps: int = 4) -> dict[str, int]:
    """{"inter_node_bytes", "intra_node_bytes"} per step of `mode` (fsdp, hpz, qwz, qgz, zeropp, co2)."""
    world, total = nodes * ranks, [0, 0]
    parts = {"fsdp": set(), "hpz": {"hpz"}, "qwz": {"qwz"}, "qgz": {"qgz"}, "zeropp": {"hpz", "qwz", "qgz"},
             "co2": set()}[mode]
    g, k = (ranks, 1) if mode == "co2" else (world, nodes)  # co2: each replica is one node's FSDP group
    for u in units:
        n = u.node_elements if mode == "co2" else u.elements
        plain = 4 * n * (g - 1)
        quantised = _int8_blocks(n, block) * (g - 1)
        gather = quantised if "qwz" in parts else plain
        for _ in range(1 if u.root else 2):  # (per replica under co2: times the nodes below)
            _add(total, _ring(g, k, gather), nodes if mode == "co2" else 1)
        if "hpz" in parts and not u.root:  # backward's gather stays in the node, in the gather dtype
            total[0] -= _ring(g, k, gather)[0]
            total[1] -= _ring(g, k, gather)[1]
            _add(total, _ring(ranks, 1, 4 * u.node_elements * (ranks - 1)), nodes)
        if "qgz" in parts:
            _add(total, _qgz(n, nodes, ranks, block))
        else:
            _add(total, _ring(g, k, plain), nodes if mode == "co2" else 1)
    _add(total, _ring(world, nodes, 2 * 8 * (world - 1) // world))  # the loss, summed over every rank
    if mode == "co2":
        _add(total, _ring(nodes, nodes, 2 * 4 * (nodes - 1) // nodes), ranks)  # the replicas' largest grad norm
        shard = 4 * sum(u.node_elements for u in units)  # each rank's share of its replica's weights
        _add(total, _ring(nodes, nodes, 2 * shard * (nodes - 1) // nodes), ranks / local_steps)  # outer all-reduce
    return {"inter_node_bytes": total[0], "intra_node_bytes": total[1]}


def _qgz(n: int, nodes: int, ranks: int, block: int) -> tuple[int, int]:
    """qgZ's two all-to-alls for a unit whose reduce-scatter output is n elements per rank: within the
    node each rank sends ranks - 1 rows of nodes x n values; across nodes, nodes - 1 rows of n."""
    intra = nodes * ranks * (ranks - 1) * _int8_blocks(nodes * n, block)
    inter = nodes * ranks * (nodes - 1) * _int8_blocks(n, block)
    return inter, intra
