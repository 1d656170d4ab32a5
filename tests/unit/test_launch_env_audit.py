"""A launcher's environment, checked before any work (the launch audit):
- MASTER_PORT outside [1, 65535] ended in torch's ValueError traceback at the rendezvous;
- LOCAL_WORLD_SIZE that is not a number ended in int()'s ValueError traceback from the layout check, and
  one outside [1, WORLD_SIZE] or a LOCAL_RANK at or past it was accepted silently;
- a MASTER_ADDR that does not resolve (a mistyped host name) waited out the rendezvous's timeout and its
  retries (about 2.4x parallel.timeout_s) before torch's error: now refused at once;
- `srun -n N longctx train` (Slurm's variables, no RANK / WORLD_SIZE) ran N whole jobs, one per task, in
  the same run directory: now one error naming the commands that work.
"""

import pytest

from longctx.errors import ConfigError
from longctx.job.launch import check_launcher_env

_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def _env(monkeypatch, **env):
    for name in _NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


_LAUNCHED = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.mark.parametrize("env, said", [
    ({"LOCAL_WORLD_SIZE": "four"}, "LOCAL_WORLD_SIZE must be an integer, got 'four'"),
    ({"LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE=0 \(the ranks on this node\) must be in \[1, WORLD_SIZE=4\]"),
    ({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "1"}, r"LOCAL_WORLD_SIZE=8 .* must be in \[1, WORLD_SIZE=4\]"),
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 must be in \[0, LOCAL_WORLD_SIZE=2\)"),
    ({"LOCAL_RANK": "-1"}, r"LOCAL_RANK=-1 must be in \[0, WORLD_SIZE=4\)"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port: it must be in \[1, 65535\]"),
    ({"MASTER_PORT": "0"}, r"MASTER_PORT=0 is not a TCP port"),
    ({"MASTER_ADDR": "no-such-node.invalid"}, r"MASTER_ADDR='no-such-node.invalid' does not resolve on this"),
    ({"MASTER_ADDR": "[::1]"}, r"MASTER_ADDR='\[::1\]' is an IPv6 address in brackets.*set MASTER_ADDR=::1\."),
])
def test_a_launchers_bad_node_variables_are_one_clear_error(env, said, monkeypatch):
    _env(monkeypatch, **{**_LAUNCHED, **env})
    with pytest.raises(ConfigError, match=said):
        check_launcher_env()


@pytest.mark.parametrize("env", [{}, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"},
                                 {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, {"LOCAL_RANK": "1"}])
def test_consistent_node_variables_pass(env, monkeypatch):
    _env(monkeypatch, **_LAUNCHED, **env)
    assert check_launcher_env() == (1, 4)


@pytest.mark.parametrize("command", [
    ["train", "--train.steps=1"], ["eval", "--checkpoint", "x", "--task", "ppl", "--lengths", "64", "--nproc", "2"],
    ["generate", "--checkpoint", "x"]])
def test_srun_tasks_without_a_launcher_are_refused_before_any_work(command, monkeypatch, tmp_path, capsys):
    from longctx import cli

    _env(monkeypatch, SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="1")
    started = []
    monkeypatch.setattr(cli, "_train", lambda *a: started.append(a) or 0)  # (the whole job of one task)
    monkeypatch.chdir(tmp_path)
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "task 1 of 2 that srun started (SLURM_STEP_NUM_TASKS=2)" in err and "torchrun" in err
    assert started == [] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("env", [{"SLURM_NTASKS": "8", "SLURM_PROCID": "0"},
                                 {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},
                                 {}, {"WORLD_SIZE": "1"}, {"RANK": "0"}])
def test_a_batch_script_alone_or_one_srun_task_still_launches(env, monkeypatch, tmp_path):
    """The batch script (SLURM_NTASKS of the allocation, no step) and `srun -n 1` run the job as usual; so does no
    launcher at all, and the one-process remnant of torchrun's pair (WORLD_SIZE=1 or RANK=0 alone: one job, not
    half a launch, tests/unit/test_launch_config_audit92.py)."""
    from longctx import cli

    _env(monkeypatch, **env)
    started = []
    monkeypatch.setattr(cli, "_train", lambda args, overrides, cfg, nproc, *a: started.append(nproc) or 0)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--nproc", "2"]) == 0
    assert started == [2]


def test_a_torchrun_rank_inside_an_srun_step_is_not_refused(monkeypatch, tmp_path):
    """`srun --ntasks-per-node 1 torchrun ...`: torchrun's ranks inherit SLURM_STEP_NUM_TASKS > 1 but have RANK."""
    from longctx import cli

    _env(monkeypatch, **_LAUNCHED, LOCAL_WORLD_SIZE="2", LOCAL_RANK="1", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0")
    started = []
    monkeypatch.setattr(cli, "_train", lambda args, overrides, cfg, nproc, *a: started.append(nproc) or 0)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"]) == 0
    assert started == [4]  # (the rank's world: torchrun's WORLD_SIZE)


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_launcher_stopped_by_a_signal_exits_with_the_signals_code(sig, code, monkeypatch):
    """Ctrl-C on `longctx train --nproc N` exited 1, a failure's code (one process exits 130): a script could
    not tell an interrupted run from a failed one."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from longctx.errors import UserError
    from longctx.job import relaunch

    def stopped(args):
        raise SignalException(f"Process got signal: {sig}", sigval=getattr(signal, sig))

    monkeypatch.setattr(relaunch, "run", stopped)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (share_cores leaves a given count alone)
    with pytest.raises(UserError, match=f"stopped by {sig} before the ranks saved") as e:
        relaunch.relaunch(2, ["train"])
    assert e.value.exit_code == code
