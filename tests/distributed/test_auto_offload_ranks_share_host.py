"""memory.offload_fraction = auto on several ranks of one machine: each rank's host budget is its share of
the machine's memory. Ranks started without LOCAL_WORLD_SIZE (job/spawn.py, as the planner's validation and
`bench memory` start them) are all on this machine, as the host preflight counts them (job/checks.py
ranks_per_node); auto took LOCAL_WORLD_SIZE's absence for one rank per machine and gave every rank all of it."""

import os

from longctx.job.spawn import run_spawned

GIB = 2**30


def _auto_line(memory_bytes):
    import torch

    from longctx.config import load_config
    from longctx.job.runtime import Runtime
    from longctx.memory import auto
    from longctx.train.model import auto_offload_fraction

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    auto.host_memory_available = lambda: memory_bytes
    auto.host_link_bandwidth = lambda device: 1e15
    auto.measured_block_forward_seconds = lambda *a, **k: 1.0
    cfg = load_config(overrides=["--model.preset=debug", "--train.seq_len=128", "--train.global_batch=2",
                                 "--parallel.dp_shard=2", "--memory.recompute=selective",
                                 "--memory.offload_fraction=auto", "--train.dtype=fp32"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lines = []
    auto_offload_fraction(cfg, torch.device("cpu"), Runtime.create(cfg, rank, world, "cpu"), lines.append)
    return lines[0]


def test_each_spawned_rank_gets_its_share_of_host_memory():
    lines = run_spawned(2, _auto_line, 8 * GIB)
    assert all("4.0 GiB of host memory per rank" in line for line in lines), lines
