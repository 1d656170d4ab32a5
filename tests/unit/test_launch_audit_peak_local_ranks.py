"""A CPU run's MFU peak is shared by the ranks on this machine as every other reader of the launcher's
variables counts them (job/checks.py launcher_node_ranks: LOCAL_WORLD_SIZE, else every rank): a launcher that
sets RANK and WORLD_SIZE without LOCAL_WORLD_SIZE (a Slurm script exporting its own) had the host budget and
offload_fraction auto count 2 ranks on the machine while the metrics gave each rank the whole machine's peak,
and the MFU read 2x low."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longctx.config import load_config
from longctx.costs import peaks
from longctx.job.checks import launcher_node_ranks
from longctx.models.llama import build_model
from longctx.train import metrics as metrics_mod
from longctx.train.metrics import MetricsLogger

PEAK = 1e12


@pytest.mark.parametrize("local_world_size", [None, "2"])
def test_each_rank_divides_the_machines_peak_by_the_ranks_on_it(local_world_size, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setattr(peaks, "machine_cpu_peak", lambda dtype: (PEAK, tmp_path / "cpu_peak.json", False))
    monkeypatch.setattr(peaks, "cpu_peak_source", lambda dtype: "measured here")
    for name, value in (("zero_pp_names", []), ("node_size", 0), ("hpz_group", 0), ("fsdp_bytes_per_step", {})):
        monkeypatch.setattr(metrics_mod, name, lambda *a, value=value, **k: value)  # (no mesh in this test)
    cfg = load_config(overrides=["--model.layers=1", "--train.device=cpu", f"--train.run_dir={tmp_path}"])
    rt = SimpleNamespace(world=2, is_main=True, broadcast=lambda x: x, comm_bytes=lambda: [], dims=None)
    logger = MetricsLogger(cfg, rt, torch.device("cpu"), build_model(cfg.model), tmp_path)
    assert launcher_node_ranks(2) == 2  # (the host budget's and auto offload's count of this machine's ranks)
    assert logger.peak == pytest.approx(PEAK / 2), logger.peak_source
    assert "shared by 2 ranks" in logger.peak_source
