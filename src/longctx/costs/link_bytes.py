"""Closed forms of the bytes per optimizer step that cross node boundaries, and that stay inside
nodes, for each mode of `longctx bench comm --cluster` (docs/parallelism.md states them; tests/
distributed/test_bench_comm.py checks the emulated cluster's count against them, exactly; the planner
reports a plan's bytes per link level from them, planner/slow_links.py). Arithmetic only (a unit's shards
come from costs/model_states.py param_cut, FSDP2's cut): bench/comm_bytes.py names them for the benchmark.

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

from .model_states import param_cut


@dataclass(frozen=True)
class Unit:
    elements: int  # this unit's padded shard per rank of the full FSDP group, in elements
    node_elements: int  # ... of a group of one node's ranks (hpz's backward gather; co2's replica)
    root: bool = False  # the root module: gathered once per step
    hpz_elements: int = 0  # ... of hpz's secondary partition when it is smaller than a node (0: a node's)
    # co2: the elements each rank of a replica (a node's group) holds, unpadded, in rank order: what its share of
    # the outer all-reduce sends (FSDP2's local shards; the last ranks' are short where the group does not divide
    # a parameter's dim 0). (): node_elements on every rank
    local_elements: tuple[int, ...] = ()


def fsdp_unit(shapes, group: int, node: int, hpz: int = 0, even: bool = True, root: bool = False) -> Unit:
    """The Unit of one FSDP unit whose parameters have `shapes`, cut as FSDP2 cuts them over `group` ranks
    (costs/model_states.py shard_dim's dim; dim 0 where not `even`, i.e. under hpz) and padded to a multiple of the
    group. A smaller partition's (a node's, hpz's) is its share of that padded tensor, as FSDP2 cuts its
    post-forward copy from the gathered one: ceil(d / group) x group / size rows, not ceil(d / size) (they differ
    where the group does not divide the dim: 147,840 bytes a step on 3 x 2 ranks). local_elements: each rank's
    unpadded part (co2's outer all-reduce sends those). bench comm (bench/comm_cluster.py units_of) and the
    planner (planner/slow_links.py planner_units) both count with it."""
    rows = [param_cut(dims, group, even) for dims in shapes]  # (the cut dim's size, a rank's rows, per row)

    def shard(size: int) -> int:
        return sum(chunk * (group // size) * rest for _, chunk, rest in rows)

    local = tuple(sum(max(0, min(chunk, n - r * chunk)) * rest for n, chunk, rest in rows) for r in range(group))
    return Unit(shard(group), shard(node), root=root, hpz_elements=shard(hpz) if hpz else 0, local_elements=local)


def _ring(ranks: int, nodes: int, sent: int, group: int = 0) -> tuple[int, int, int]:
    """(across nodes, across groups inside a node, inside a group) bytes of a ring collective over
    `ranks` consecutive ranks on `nodes` nodes, `sent` bytes each: the ring's hops that cross a node
    boundary, then a group boundary (three levels: groups of `group` ranks), the rest. Without a group
    level (0) the second figure is every hop inside a node and the third 0."""
    inter = nodes if nodes > 1 else 0
    if not group:
        return inter * sent, (ranks - inter) * sent, 0
    groups = ranks // group if ranks >= group else 1
    middle = (groups - inter) if groups > 1 else 0
    return inter * sent, middle * sent, (ranks - inter - middle) * sent


def _add(total: list[int], part: tuple, times: float = 1.0) -> None:
    for i, value in enumerate(part):
        total[i] += int(value * times)


def int8_blocks(elements: int, block: int) -> int:
    """Bytes of `elements` values sent as int8 blocks of `block` with one fp32 scale each."""
    blocks = -(-elements // block)
    return blocks * block + 4 * blocks


PARTS = {"fsdp": set(), "hpz": {"hpz"}, "qwz": {"qwz"}, "qgz": {"qgz"}, "zeropp": {"hpz", "qwz", "qgz"},
         "three_level": {"hpz", "qwz", "qgz"}, "co2": set()}


def step_bytes(mode: str, units: list[Unit], nodes: int, ranks: int, block: int = 512, local_steps: int = 4,
               group: int = 0, hpz_ranks: int = 0, gather_bytes: int = 4) -> dict[str, int]:
    """{"inter_node_bytes", "intra_node_bytes", "intra_group_bytes"} per step of `mode` (fsdp, hpz, qwz,
    qgz, zeropp, three_level, co2) on `nodes` x `ranks`, with a third level of `group` ranks (0: none;
    intra_group_bytes is part of intra_node_bytes); hpz's secondary partition over `hpz_ranks` (0: a node).
    gather_bytes: bytes per gathered element unquantised (4: fp32 on CPU, as bench comm runs; the planner
    passes 2 for bf16 gathers on GPUs); gradients are reduced in fp32 either way."""
    world, total, parts = nodes * ranks, [0, 0, 0], PARTS[mode]
    g, k = (ranks, 1) if mode == "co2" else (world, nodes)  # co2: each replica is one node's FSDP group
    copies = nodes if mode == "co2" else 1
    level = hpz_ranks or ranks
    for u in units:
        n = u.node_elements if mode == "co2" else u.elements
        plain = 4 * n * (g - 1)
        gather = int8_blocks(n, block) * (g - 1) if "qwz" in parts else gather_bytes * n * (g - 1)
        _add(total, _ring(g, k, gather, group), copies * (1 if u.root or "hpz" in parts else 2))
        if "hpz" in parts and not u.root:  # backward's gather within the secondary partition, unquantised
            hpz_sent = gather_bytes * (u.hpz_elements or u.node_elements) * (level - 1)
            _add(total, _ring(level, 1, hpz_sent, group), world // level)
        if "qgz" in parts:
            _add(total, _qgz(n, nodes, ranks, block, group))
        else:
            _add(total, _ring(g, k, plain, group), copies)
    _add(total, _ring(world, nodes, 2 * 8 * (world - 1) // world, group))  # the loss, summed over every rank
    if mode == "co2":
        _add(total, _ring(nodes, nodes, 2 * 4 * (nodes - 1) // nodes), ranks)  # the replicas' largest grad norm
        # each rank's share of its replica's weights, the outer all-reduce's (over the N replicas), H-th per step
        shards = [4 * sum(u.local_elements[r] if u.local_elements else u.node_elements for u in units)
                  for r in range(ranks)]
        _add(total, _ring(nodes, nodes, sum(2 * shard * (nodes - 1) // nodes for shard in shards)), 1 / local_steps)
    return {"inter_node_bytes": total[0], "intra_node_bytes": total[1] + total[2], "intra_group_bytes": total[2]}


def _qgz(n: int, nodes: int, ranks: int, block: int, group: int) -> tuple[int, int, int]:
    """qgZ's two all-to-alls for a unit whose reduce-scatter output is n elements per rank: within the
    node each rank sends ranks - 1 rows of nodes x n values (group - 1 of them inside its group);
    across nodes, nodes - 1 rows of n."""
    row = int8_blocks(nodes * n, block)
    inside = (group - 1) if group else 0
    return (nodes * ranks * (nodes - 1) * int8_blocks(n, block),
            nodes * ranks * (ranks - 1 - inside) * row, nodes * ranks * inside * row)


def _loss_bytes(world: int, nodes: int, group: int) -> tuple[int, int, int]:
    """The step's loss all-reduce (one float64 over every rank)."""
    return _ring(world, nodes, 2 * 8 * (world - 1) // world, group)


def layout_bytes(mode: str, units: list[Unit], nodes: int, ranks: int, replicas: int, block: int = 512,
                 local_steps: int = 4, group: int = 0, hpz_ranks: int = 0,
                 gather_bytes: int = 4) -> dict[str, int] | None:
    """step_bytes for `replicas` FSDP groups of n = world / replicas consecutive ranks each (`units`: the
    shards of one group's ranks, `elements`), composed by the same ring rule: each group's own FSDP step
    (`mode`'s, fsdp's under co2), the loss over every rank once, and the replicas' rings (stride n):
    under sync each unit's gradient shard all-reduced (fp32), under co2 the largest gradient norm and
    1 / local_steps of the outer all-reduce of the rank's shard. Equals step_bytes where both apply
    (one group; co2 with a replica per node). None where groups and nodes do not nest (n neither a
    multiple nor a divisor of a node), ZeRO++ within part of a node, or, on three levels, replica rings
    whose stride is under a group."""
    world = nodes * ranks
    n = world // replicas
    if (n % ranks and ranks % n) or (mode != "fsdp" and mode != "co2" and n < ranks) or (group and n < group
                                                                                      and replicas > 1):
        return None
    group_nodes = max(1, n // ranks)
    inner = step_bytes("fsdp" if mode == "co2" else mode, units, group_nodes, min(n, ranks), block,
                       group=group, hpz_ranks=hpz_ranks, gather_bytes=gather_bytes)
    total = [0, 0, 0]
    loss = _loss_bytes(n, group_nodes, group)
    _add(total, [inner["inter_node_bytes"] - loss[0], inner["intra_node_bytes"] - inner["intra_group_bytes"]
                 - loss[1], inner["intra_group_bytes"] - loss[2]], replicas)
    _add(total, _loss_bytes(world, nodes, group))
    if replicas > 1:
        # the nodes a replica ring (stride n) spans: one per replica when a group fills nodes, else the
        # replicas' share of them; on three levels the stride is at least a group: no hop stays in one
        spanned = replicas if n >= ranks else max(1, replicas * n // ranks)
        crossing = spanned if spanned > 1 else 0

        def ring(sent: int) -> tuple[int, int, int]:
            return crossing * sent, (replicas - crossing) * sent, 0

        if mode == "co2":
            _add(total, ring(2 * 4 * (replicas - 1) // replicas), n)  # the replicas' largest grad norm
            # the outer all-reduce of each rank's unpadded shard (local_elements; as step_bytes)
            shards = [4 * sum(u.local_elements[r] if u.local_elements else u.elements for u in units) for r in range(n)]
            _add(total, ring(sum(2 * shard * (replicas - 1) // replicas for shard in shards)), 1 / local_steps)
        else:
            for u in units:  # HSDP: each unit's reduce-scattered gradient shard all-reduced over the replicas
                _add(total, ring(2 * 4 * u.elements * (replicas - 1) // replicas), n)
    return {"inter_node_bytes": total[0], "intra_node_bytes": total[1] + total[2], "intra_group_bytes": total[2]}
