"""`longctx train --nproc N` checks the node's host memory before it starts its N ranks (train/preflight.py): each
rank is an interpreter with torch and longctx imported (~0.3 GiB) before any of the run's bytes, which the free
memory does not yet hold, and the check counted the run's bytes alone: 4 debug ranks were predicted at 0.12 GiB
where they held 1.3-1.5 GiB, so a 1 GiB container passed and met the OOM killer. A rank running already (torchrun's,
an in-process run) holds its own, and is not counted again."""

import pytest

from longctx.config import load_config
from longctx.costs.rank_process import PROCESS_BYTES
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.memory.rss import current_rss_bytes
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, rank_host_bytes


def test_ranks_to_start_count_their_processes(monkeypatch):
    cfg = load_config("configs/debug.toml", [])
    dims = check_layout(cfg, 4)
    run = rank_host_bytes(cfg, dims, "cpu", 4, 1e12)["total"]
    process = min(current_rss_bytes(), PROCESS_BYTES)  # (a test worker may hold more than a rank's start)
    assert process > 50 * 2**20  # (this process has torch imported: what a rank starts with)
    monkeypatch.setenv(BUDGET_ENV, str(int(4 * (run + process / 2))))  # the run's bytes fit, the processes not
    check_host_memory(cfg, dims, 4, "cpu")  # (ranks that run already: their processes are held)
    with pytest.raises(ConfigError, match=r"4 ranks x .*process [\d.]+ GiB.*fewer ranks \(--nproc\)") as e:
        check_host_memory(cfg, dims, 4, "cpu", new_processes=True)
    assert "fewer ranks on this node" not in str(e.value)  # (said once)
    monkeypatch.setenv(BUDGET_ENV, str(int(4 * (run + process) * 1.05)))
    check_host_memory(cfg, dims, 4, "cpu", new_processes=True)  # fits
