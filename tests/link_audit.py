"""An independent count of the bytes a rank puts on each link level: a TorchDispatchMode that sees every
c10d operator (whoever issued it: job/comm.py, FSDP2, DTensor), sizes it from its tensors and its process
group, and books each transfer on the hop it takes. Ring collectives (all-gather, reduce-scatter,
all-reduce) send from each rank to its successor in the group's rank order: an all-gather its input
n - 1 times, a reduce-scatter n - 1 output-sized chunks, an all-reduce 2 (n - 1) / n of the tensor (the
bandwidth-optimal ring, the convention of costs/link_bytes.py); an all-to-all sends each row to its
peer, a send its tensor. A hop is across nodes when the two ranks' nodes differ (ranks placed
`ranks_per_node` to a node), inside a group (`group_ranks`, 0: none) when their groups are equal,
else inside the node. The count reads neither job/comm.py's counters nor the closed forms (the workers below
return comm's counters beside it, to be checked against it)."""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_CONTROL = {"barrier", "monitored_barrier_"}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(i) for i in x)
    return 0


class RawLinks(TorchDispatchMode):
    """hops: {"inter" | "intra" | "group": bytes this rank sent on such hops}; ops: {(op, group size): bytes}."""

    def __init__(self, ranks_per_node: int, group_ranks: int = 0):
        super().__init__()
        self.node, self.group = ranks_per_node, group_ranks
        self.hops: dict[str, Fraction] = defaultdict(Fraction)
        self.ops: dict[tuple[str, int], Fraction] = defaultdict(Fraction)
        self.unknown: list[str] = []

    def level(self, a: int, b: int) -> str:
        if a // self.node != b // self.node:
            return "inter"
        return "group" if self.group and a // self.group == b // self.group else "intra"

    def _book(self, name: str, pg, sends: dict[int, Fraction]) -> None:
        ranks = dist.get_process_group_ranks(pg)
        me = ranks[pg.rank()]
        for peer, sent in sends.items():
            if sent:
                self.hops[self.level(me, ranks[peer])] += sent
                self.ops[(name, pg.size())] += sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._opname not in _CONTROL:
            self._record(func._opname, args)
        return out

    def _record(self, name: str, args) -> None:
        pos = {"send": 1, "recv_": 1, "allreduce_": 1, "allreduce_coalesced_": 1, "broadcast_": 1}.get(name, 2)
        pg = dist.ProcessGroup.unbox(args[pos])
        n, me = pg.size(), pg.rank()
        succ = (me + 1) % n
        if n == 1 or name == "recv_":
            return
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_"):
            self._book("all_gather", pg, {succ: Fraction(_bytes(args[1]) * (n - 1))})
        elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            self._book("reduce_scatter", pg, {succ: Fraction(_bytes(args[0]) * (n - 1))})
        elif name in ("allreduce_", "allreduce_coalesced_"):
            self._book("all_reduce", pg, {succ: Fraction(2 * _bytes(args[0]) * (n - 1), n)})
        elif name == "alltoall_base_":
            x, splits = args[1], list(args[4]) or [args[1].shape[0] // n] * n
            row = Fraction(_bytes(x), x.shape[0]) if x.shape[0] else Fraction(0)
            self._book("all_to_all", pg, {j: row * s for j, s in enumerate(splits) if j != me})
        elif name == "alltoall_":
            self._book("all_to_all", pg, {j: Fraction(_bytes(t)) for j, t in enumerate(args[1]) if j != me})
        elif name == "send":
            self._book("send", pg, {int(args[2]): Fraction(_bytes(args[0]))})
        elif name == "broadcast_":
            if int(args[2]) == me:  # the root sends the tensor to each other rank (a control message)
                self._book("broadcast", pg, {j: Fraction(_bytes(args[0])) for j in range(n) if j != me})
        else:
            self.unknown.append(name)

    def summary(self) -> dict:
        return {"hops": {k: float(v) for k, v in self.hops.items()},
                "ops": {f"{op}/{n}": float(v) for (op, n), v in sorted(self.ops.items())},
                "unknown": sorted(set(self.unknown))}


def planner_bytes(raw: dict) -> dict:
    """planner/cost.py estimate's comm_bytes ({dim: {label: bytes per rank and step}}) of a layout_config."""
    from longctx.costs.hardware import PRESETS
    from longctx.costs.shape import MeshShape
    from longctx.memory.policy import MemoryPolicy
    from longctx.planner.cost import estimate
    from longctx.planner.validate import build_config

    cfg = build_config(raw)
    p = cfg.parallel
    shape = MeshShape(p.dp_replicate, p.dp_shard, p.head, p.ctx, p.window, expert=p.expert, zero_pp=p.zero_pp,
                      node=p.ranks_per_node if p.zero_pp else 0, quant_block=p.zero_pp_block)
    hw = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")  # fp32 gathers, as on the CPU
    est = estimate(cfg.model, hw, shape, MemoryPolicy(cfg.memory.recompute), seq_len=cfg.train.seq_len,
                   global_batch=cfg.train.global_batch, micro_batch=1, gpus_per_node=4, doc_mask=False)
    return est.comm_bytes


def collective_bytes(comm: dict) -> float:
    """The planner's bytes (planner_bytes) of what a rank sends in ring collectives: FSDP's all-gathers,
    reduce-scatters and HSDP's all-reduce, and a MoE model's router statistics' all-reduce (since 2026-12-07 in
    the planner's figure, dim "router": the audits compare it whole with the all_gather, reduce_scatter and
    all_reduce operators' bytes, where until then they took it off what the ranks sent)."""
    return comm.get("fsdp", {}).get("fsdp", 0.0) + comm.get("router", {}).get("router", 0.0)


def by_op(summary: dict) -> dict[str, float]:
    """{op: bytes} of a RawLinks summary, over every group size."""
    out: dict[str, float] = {}
    for key, value in summary["ops"].items():
        op = key.split("/")[0]
        out[op] = out.get(op, 0.0) + value
    return out


# ------------------------------------------------------------------------------------------------
# Workers (module-level: spawned ranks import them by name)


def layout_config(preset: str, seq_len: int, *, rep: int = 1, shard: int = 1, head: int = 1, ctx: int = 1,
                  expert: int = 1, zero_pp: str = "", node: int = 0, window: int = 0, recompute: str = "none") -> dict:
    """A raw config of one optimizer step of one sequence per data-parallel rank, fp32 on the CPU."""
    from longctx.config import to_dict
    from longctx.planner.validate import build_config

    raw = {"model": {"preset": preset},
           "parallel": {"dp_replicate": rep, "dp_shard": shard, "head": head, "ctx": ctx, "expert": expert,
                        "window": window, "zero_pp": zero_pp, **({"ranks_per_node": node} if node else {})},
           "memory": {"recompute": recompute},
           "train": {"seq_len": seq_len, "global_batch": rep * shard, "device": "cpu", "dtype": "fp32", "seed": 0,
                     "eval_interval": 0},
           "data": {"doc_mask": False}}
    return to_dict(build_config(raw))


def layout_traffic(raws: list[dict]) -> list[dict]:
    """Per layout, what this rank sent in its second optimizer step (planner/validate_ranks.py's step: every
    micro-batch's forward and backward, AdamW), as RawLinks counts it, beside job/comm.py's counters and
    job/traffic.py's library_traffic (the counters the training loop and the planner's validation read)."""
    from longctx.job import comm
    from longctx.job.traffic import library_traffic
    from longctx.planner.validate_ranks import setup_case, train_step

    out = []
    for raw in raws:
        job = setup_case(raw)
        train_step(*job)  # warm-up: FSDP's lazy set-up, the optimizer's state
        links = RawLinks(ranks_per_node=1)
        comm.reset_counters()
        with library_traffic() as library, links:
            train_step(*job)
        out.append({"raw": links.summary(), "comm": comm.counters(), "library": dict(library)})
        del job
        comm.barrier()
    return out


def trainer_links(nodes: int, ranks: int, runs: list[tuple[str, int]], work: str, group: int = 0) -> dict:
    """bench comm's step (the Trainer's, its config from bench/comm_cluster.py mode_overrides) of each
    (mode, dp_replicate) of `runs` on `nodes` x `ranks`, counted by RawLinks over its timed window: the job's
    bytes per step by link level (every rank's, summed) and the FSDP units' shards (units_of, from the
    parameters' shapes) the closed forms take. dp_replicate > 1: HSDP replicas under the mode fsdp."""
    import torch
    import torch.distributed as dist

    from longctx.bench import comm_cluster as cc
    from longctx.config import load_config
    from longctx.train.trainer import Trainer

    out = {}
    for mode, replicas in runs:
        spec = dict(model="debug", seq_len=256, steps=0, timed=2, local_steps=2, overlap_steps=0, kernels="eager",
                    group_ranks=group)
        extra = [f"--parallel.dp_replicate={replicas}"] if replicas > 1 else []
        name = f"{mode}-{replicas}"
        overrides = cc.mode_overrides(mode, nodes, ranks, spec) + extra + [f"--train.run_dir={work}/{name}"]
        cfg = load_config(None, overrides)
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        window = cc.timed_steps(mode, spec)
        for step in range(1, window[0]):
            trainer.step(step)
        links = RawLinks(ranks, group)
        with links:
            for step in window:
                trainer.step(step)
        if trainer.co2 is not None:
            trainer.co2.run_end()
        levels = torch.tensor([float(links.hops[k]) for k in ("inter", "intra", "group")], dtype=torch.float64)
        dist.all_reduce(levels)  # (outside the count)
        per_step = (levels / len(window)).tolist()
        n = nodes * ranks // (replicas if mode != "co2" else nodes)
        units = cc.units_of(trainer.model, n, min(n, ranks), group if mode == "three_level" else 0)
        out[name] = {"inter_node_bytes": per_step[0], "intra_node_bytes": per_step[1] + per_step[2],
                     "intra_group_bytes": per_step[2], "units": units, "block": cfg.parallel.zero_pp_block,
                     "unknown": links.summary()["unknown"],
                     # this rank's bytes in all but the loss's all-reduce over every rank, beside the metrics line's
                     "rank_fsdp": float(sum(v for (op, size), v in links.ops.items()
                                            if (op, size) != ("all_reduce", nodes * ranks))) / len(window),
                     "metrics_fsdp": trainer.metrics.fsdp_bytes.get("fsdp", 0.0)}
        del trainer
    return out
