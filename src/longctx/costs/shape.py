"""MeshShape: the parallel degrees of one candidate plan, and which of its groups share a node.

The planner's view of the [parallel] table (job/dims.py builds the real DeviceMesh from the
same degrees): dp_replicate x dp_shard x head x ctx ranks, the Double-Ring `window` and the
`placement` that decides which sequence group gets adjacent ranks; for a MoE model the `expert`
degree, whose groups of adjacent ranks the MoE layers fold over those ranks (parallel/expert/install.py);
and `zero_pp`, how FSDP's transfers cross nodes (parallel.zero_pp: ZeRO++'s hpz, qwz, qgz; `hpz_ranks`, hpz's
secondary partition on a group smaller than the node: Frontier's third level); `data_parallel`, how the
replicas agree (train.data_parallel: sync, or co2's rounds of `local_steps` local steps).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int = 1
    dp_shard: int = 1
    head: int = 1
    ctx: int = 1
    window: int = 0
    placement: str = "head-first"
    expert: int = 1
    zero_pp: str = ""  # parallel.zero_pp: ZeRO++'s hpz / qwz / qgz for an FSDP group that spans nodes
    node: int = 0      # parallel.ranks_per_node under zero_pp (the FSDP group's ranks in one node)
    hpz_ranks: int = 0  # parallel.hpz_ranks: hpz's secondary partition over this many ranks (0: the node)
    data_parallel: str = "sync"  # train.data_parallel: sync | co2 (each replica its own FSDP group)
    local_steps: int = 0  # train.co2_local_steps under co2 (H: local steps per round)
    quant_block: int = 512  # parallel.zero_pp_block: elements per int8 block (one fp32 scale) under qwz / qgz
    # parallel.expert_replicas under expert > 1: FlexMoE's copy slots per rank, whose weights a MoE call keeps
    # for backward (memory/moe_counts.py copy_slot_bytes); the planner tries them under --expert-replicas and times
    # them in planner/expert_copies.py
    expert_replicas: int = 0
    # parallel.expert_ranks_per_node under expert > 1: hierarchical dispatch over nodes of this many ranks of the
    # expert group (0, or the whole group: the flat exchange); its bytes per link level and its saved tensors are
    # costs/hier_bytes.py's and memory/hier_counts.py's
    expert_ranks_per_node: int = 0

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.head * self.ctx

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Size of the FSDP shard group: dp_shard x head x ctx (contiguous ranks)."""
        return self.dp_shard * self.head * self.ctx

    @property
    def reduces_alone(self) -> bool:
        """Whether the FSDP group a gradient is reduced over is this rank alone (world 1, or co2 replicas of
        one rank each): step/gradients.py then reduces after every micro-batch (nothing to defer)."""
        return self.world == 1 or (self.data_parallel == "co2" and self.fsdp == 1)

    @property
    def sequence_degree(self) -> int:
        return self.head * self.ctx

    @property
    def expert_data(self) -> int:
        """Ranks holding the same experts (their weights FSDP-sharded over them): world / expert."""
        return self.world // self.expert

    def describe(self) -> str:
        """Short form for tables: 'rep2xdp2xhead2xctx8/w4 hf'."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"dp{self.dp_shard}")
        if self.head > 1:
            parts.append(f"head{self.head}")
        if self.ctx > 1:
            parts.append(f"ctx{self.ctx}" + (f"/w{self.window}" if self.window and self.window < self.ctx else ""))
        text = "x".join(parts) or "single"
        if self.head > 1 and self.ctx > 1:
            text += " " + ("hf" if self.placement == "head-first" else "cf")
        if self.expert > 1:
            text += f" ep{self.expert}" + (f" copies{self.expert_replicas}" if self.expert_replicas else "")
            text += f" hier{self.expert_ranks_per_node}" if 0 < self.expert_ranks_per_node < self.expert else ""
        if self.zero_pp:
            text += " " + self.zero_pp.replace(",", "+") + (f"/g{self.hpz_ranks}" if self.hpz_ranks else "")
        if self.data_parallel == "co2":
            text += f" co2/H{self.local_steps}"
        return text


def group_is_intra_node(shape: MeshShape, group: str, gpus_per_node: int) -> bool:
    """Whether every rank of one `group` ("head", "ctx", "window", "fsdp", "replicate", "expert",
    "expert_data") is in one node.

    A group of `size` ranks with `stride` between them spans stride x size consecutive ranks; with
    power-of-two-style divisibility it stays in one node iff that span is at most gpus_per_node."""
    h, c, w = shape.head, shape.ctx, (shape.window or shape.ctx)
    if shape.placement == "head-first":
        stride_size = {"head": (1, h), "ctx": (h, c), "window": (h, w)}
    else:
        stride_size = {"head": (c, h), "ctx": (1, c), "window": (1, w)}
    stride_size["fsdp"] = (1, shape.fsdp)
    stride_size["expert"] = (1, shape.expert)  # an expert group: `expert` adjacent ranks
    stride_size["expert_data"] = (shape.expert, shape.expert_data)  # the ranks holding the same experts
    stride_size["replicate"] = (shape.fsdp, shape.dp_replicate)
    stride, size = stride_size[group]
    return size == 1 or stride * size <= gpus_per_node
