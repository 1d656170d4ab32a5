"""The job floor (src/longctx/job/) against bad input and silent failures, found by the job audit:
- the hang watchdog sees a rank blocked in the wait of a transfer comm.py started (the ring's p2p
  `Pending`, `PendingTransfer`): the C++ Work.wait() leaves no torch.distributed frame, so a rank
  stuck there never fired, and only the process group's backstop timeout ended the job;
- a world size below 1 (`longctx train --nproc -2`) is refused; it inferred dp_shard = -2 and the
  run went on silently as one process;
- parallel.ranks_per_node must divide the world (a negative count made the host-memory preflight's
  per-node total negative: any budget passed);
- a rank whose LOCAL_RANK is not one of the GPUs it sees is told how many ranks the node can run,
  instead of CUDA's "invalid device ordinal".
"""

import json
import time

import pytest
import torch.distributed as dist

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job import comm, launch, watchdog
from longctx.job.checks import check_layout, ranks_per_node
from longctx.job.watchdog import Watchdog


class _BlockedWork:
    """A transfer whose peer never comes: its wait() blocks (as gloo's / NCCL's Work.wait() does in C++)
    until the active watchdog fires, or `seconds` pass (no wall-time race: on a loaded machine the
    watchdog's thread may look late, and a fixed sleep could end before it did)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        watched = watchdog._ACTIVE
        watched.fired.wait(self.seconds)


def _watched(tmp_path, body, timeout=0.5):
    w = Watchdog(timeout, rank=1, folder=tmp_path, exit_process=False).start()
    try:
        watchdog.phase(5, "forward")
        body()
    finally:
        w.stop()
    return w


@pytest.mark.parametrize("kind", ["ring p2p (Pending)", "async all-to-all / all-reduce (PendingTransfer)"])
def test_the_watchdog_fires_on_a_rank_blocked_in_a_comm_transfer_wait(kind, tmp_path):
    work = _BlockedWork(30.0)  # 60x the timeout: a peer that never sends
    if kind.startswith("ring"):
        body = comm.Pending([work]).wait
    else:
        body = comm.PendingTransfer(None, work, None, None).wait
    assert _watched(tmp_path, body).fired.is_set()
    record = json.loads((tmp_path / "hang1.json").read_text())
    # the hang report counts this rank as waiting for a peer, not as the hung one
    assert record["collective"] == "wait (comm.py)" and (record["step"], record["phase"]) == (5, "forward")
    assert 0.5 <= record["idle_s"] < 30.0


def test_a_long_computation_paced_through_comm_is_not_a_wait(tmp_path):
    # comm.paced runs compute from a comm.py frame: it waits for nobody, so nothing fires
    assert not _watched(tmp_path, lambda: comm.paced(time.sleep, 1.5, 0.0)).fired.is_set()
    assert not (tmp_path / "hang1.json").exists()


@pytest.mark.parametrize("world", [-2, 0])
def test_a_world_below_one_process_is_refused(world):
    cfg = load_config("configs/debug.toml", [])
    with pytest.raises(ConfigError, match=rf"world size is {world}.*--nproc N takes N >= 1"):
        check_layout(cfg, world)


def test_a_positive_world_still_infers_dp_shard():
    cfg = load_config("configs/debug.toml", ["--parallel.head=2", "--parallel.ctx=2"])
    dims = check_layout(cfg, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.head, dims.ctx) == (1, 8 // (2 * 2), 2, 2)


@pytest.mark.parametrize("given", [-4, 3, 16])
def test_ranks_per_node_must_divide_the_world(given, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config("configs/debug.toml", [f"--parallel.ranks_per_node={given}", "--parallel.head=2",
                                             "--parallel.ctx=2"])  # (dp 2 splits the global batch)
    with pytest.raises(ConfigError, match=rf"ranks_per_node = {given} must divide the 8 ranks.*\[1, 2, 4, 8\]"):
        ranks_per_node(cfg, 8)  # (what the host-memory preflight multiplies a rank's bytes by)
    with pytest.raises(ConfigError, match=rf"ranks_per_node = {given} must divide"):
        check_layout(cfg, 8)  # (every layout check: the launcher's, a rank's, the planner's)


@pytest.mark.parametrize("given, env, expected", [(4, None, 4), (0, None, 8), (0, "2", 2)])
def test_ranks_per_node_given_or_the_launchers(given, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:  # (a launched rank's: the launching shell's own is not this job's, test_stray_local_world_size.py)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = load_config("configs/debug.toml", [f"--parallel.ranks_per_node={given}"])
    assert ranks_per_node(cfg, 8) == expected


def _fake_launched_rank(monkeypatch, local_rank, devices):
    """A torchrun rank on a node whose process sees `devices` GPUs; records the device it picks."""
    picked = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(launch.torch.cuda, "set_device", picked.append)

    def no_group(*a, **kw):
        raise RuntimeError("the test stops before the process group")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setattr(launch.watchdog, "set_group_timeout", lambda s: None)
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(devices))))
    return picked


def test_a_rank_beyond_the_visible_gpus_is_told_the_fix(monkeypatch):
    picked = _fake_launched_rank(monkeypatch, local_rank=5, devices=4)  # --nproc 8 on 4 GPUs
    with pytest.raises(ConfigError, match=r"LOCAL_RANK is 5, but it sees 4 CUDA devices \(CUDA_VISIBLE_DEVICES="
                                          r"0,1,2,3\).*start at most 4 ranks on this node \(--nproc 4"):
        launch.init_distributed("cuda", 60.0)
    assert picked == []  # refused before CUDA is asked for a device that is not there


def test_a_rank_within_the_visible_gpus_takes_its_local_rank(monkeypatch):
    picked = _fake_launched_rank(monkeypatch, local_rank=3, devices=4)
    with pytest.raises(RuntimeError, match="stops before the process group"):
        launch.init_distributed("cuda", 60.0)
    assert picked == [3]


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_train_refuses_nproc_below_one(nproc, capsys, monkeypatch, tmp_path):
    """`longctx train --nproc 0` was read as --nproc not given and started the default 4 ranks."""
    from longctx import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--nproc", nproc]) == 2
    assert f"--nproc must be >= 1 (1 = this process), got {nproc}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # (refused before any work: no run directory)


@pytest.mark.parametrize("env, said", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),  # (waited on the rendezvous)
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer, got 'two'"),  # (int()'s traceback)
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not set"),  # (torch's traceback, late)
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK must be an integer"),
])
def test_a_launchers_bad_variables_are_one_clear_error_before_any_wait(env, said, monkeypatch):
    from longctx.job.launch import check_launcher_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=said):
        check_launcher_env()


def test_a_rendezvous_that_times_out_is_one_clear_error(monkeypatch):
    """A peer that never came: torch's DistStoreError traceback became the run's error naming what to check."""
    import torch.distributed as dist

    from longctx.errors import UserError
    from longctx.job import launch

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)

    def never(*a, **k):
        raise dist.DistStoreError("Timed out after 43 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(launch.dist, "init_process_group", never)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)  # (an earlier test's group may be up)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(watchdog, "_GROUP_TIMEOUT_S", watchdog._GROUP_TIMEOUT_S)  # (restored after: it sets it)
    with pytest.raises(UserError, match=r"the 2 ranks did not all meet at 127.0.0.1:29999.*DistStoreError"):
        launch.init_distributed("cpu", 10.0)
