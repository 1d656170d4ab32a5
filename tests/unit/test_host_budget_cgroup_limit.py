"""The host budget under a container's memory limit: MemAvailable is the machine's, so inside a cgroup
limited to less (a Kubernetes pod, a Slurm job, `docker run --memory`) a run sized by it passed the
preflight and was killed by the cgroup's OOM killer in its first step. The budget is what the cgroup
still allows where that is less (cgroup v2 memory.max / memory.current, v1 memory.limit_in_bytes /
memory.usage_in_bytes, reclaimable page cache counted as free)."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.memory import auto
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, host_budget

GIB = 2**30


def _cgroup(root, limit, usage, inactive, v1=False):
    directory = root / "memory" if v1 else root
    directory.mkdir(parents=True, exist_ok=True)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if v1 else \
        ("memory.max", "memory.current", "inactive_file")
    (directory / names[0]).write_text(f"{limit}\n")
    (directory / names[1]).write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(f"anon 123\n{names[2]} {inactive}\n")


@pytest.mark.parametrize("v1", [False, True])
def test_the_cgroup_limit_bounds_the_free_memory(tmp_path, monkeypatch, v1):
    _cgroup(tmp_path, limit=GIB, usage=GIB // 2, inactive=GIB // 8, v1=v1)
    monkeypatch.setattr(auto, "CGROUP_ROOT", str(tmp_path), raising=False)
    assert auto.cgroup_memory_available() == GIB // 2 + GIB // 8
    free, source = auto.host_memory_free()
    assert free == GIB // 2 + GIB // 8 and "cgroup" in source


def test_no_limit_leaves_memavailable(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    monkeypatch.setattr(auto, "CGROUP_ROOT", str(tmp_path), raising=False)
    assert auto.cgroup_memory_available() is None
    assert auto.host_memory_free()[1] == "free (MemAvailable)"


def test_a_run_over_the_container_limit_is_refused_before_work(tmp_path, monkeypatch):
    # small-100m at 512 tokens on CPU needs ~2 GiB: it fits this machine's MemAvailable, not a 1 GiB container
    cfg = load_config(None, ["--model.preset=small-100m", "--train.seq_len=512", "--train.device=cpu"])
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    _cgroup(tmp_path, limit=GIB, usage=GIB // 4, inactive=0)
    monkeypatch.setattr(auto, "CGROUP_ROOT", str(tmp_path), raising=False)
    assert host_budget()[0] == GIB - GIB // 4
    with pytest.raises(ConfigError, match=r"but free under this process's memory cgroup limit .* is 0\.75 GiB"):
        check_host_memory(cfg, check_layout(cfg, 1), 1, "cpu")


@pytest.mark.parametrize("v1", [False, True])
def test_active_page_cache_counts_as_free_as_in_memavailable(tmp_path, monkeypatch, v1):
    """A container that read its corpus holds it as page cache, much of it on the active list: the kernel reclaims
    it before the cgroup's OOM killer acts, and MemAvailable counts it free; counting only inactive_file refused
    runs that fit (a 64 GiB job with 40 GiB of active cache was told it had 4 GiB)."""
    _cgroup(tmp_path, limit=64 * GIB, usage=60 * GIB, inactive=0, v1=v1)
    stat = tmp_path / "memory" / "memory.stat" if v1 else tmp_path / "memory.stat"
    prefix = "total_" if v1 else ""
    stat.write_text(f"anon {20 * GIB}\n{prefix}inactive_file {2 * GIB}\n{prefix}active_file {38 * GIB}\n")
    monkeypatch.setattr(auto, "CGROUP_ROOT", str(tmp_path), raising=False)
    assert auto.cgroup_memory_available() == 44 * GIB
