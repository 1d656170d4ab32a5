"""The planner and the preflight count a rank's host memory the same way (plan114). The preflight of `longctx train
--nproc N` counts, for each rank it has yet to start, an interpreter with torch and longctx imported ("process": the
launcher's own RSS, capped) and on CUDA the rank's CUDA context and libraries ("cuda_runtime"); the planner's
host/node counted the runtime but not the interpreter, so a plan sized near the host limit was feasible in `longctx
plan` and refused by `longctx train`. Now both count "process" (costs/rank_process.py), and the preflight's is never
more than the planner's.

The launcher's RSS is set here (the preflight measures it; a test worker holds more than a launcher): 282.8 MiB is
what `longctx train --nproc 2`'s launcher held at its check on this repository's CPU machine (2026-12-06), 4 GiB a
launcher holding more than its imports (a notebook, a test worker)."""

import json

import pytest

import longctx.train.host_budget as host_budget
from longctx.cli import main
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, rank_host_bytes

GIB = 2**30
GPUS = 8  # one node of 8 GPUs (the plan's --gpus-per-node default)
TOLERANCE = 0.01  # the plan's host/node may fall short of the preflight's need by at most 1%
LAUNCHER_RSS = int(282.8 * 2**20)
DEBUG = ("--model", "debug", "--seq-len", "4096")
HOST_STATES = ("--model", "llama3-1b", "--seq-len", "128K", "--model-states", "host")  # 2.3 GiB of states per rank


def plan_args(model: tuple[str, ...]) -> list[str]:
    return ["plan", *model, "--gpus", str(GPUS), "--hardware", "h100"]


def planned(tmp_path, capsys, model: tuple[str, ...], *more: str) -> tuple[dict, object]:
    """(the best plan as `longctx plan --json` prints it, the config it writes)."""
    out = tmp_path / "plan.toml"
    assert main([*plan_args(model), "--json", "--out", str(out), *more]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert best["feasible"]
    return best, load_config(out, [])


@pytest.mark.parametrize("rss", [LAUNCHER_RSS, 4 * GIB], ids=["launcher", "larger"])
@pytest.mark.parametrize("model", [DEBUG, HOST_STATES], ids=["debug", "host_states"])
def test_the_preflight_takes_a_written_plan_at_its_host_per_node(tmp_path, capsys, monkeypatch, rss, model):
    monkeypatch.setattr(host_budget, "current_rss_bytes", lambda: rss)
    best, cfg = planned(tmp_path, capsys, model)
    per_node = best["host_per_node_gib"] * GIB
    dims = check_layout(cfg, GPUS)
    # a node with the plan's host/node (and the tolerance) holds what the preflight counts for the ranks it starts
    monkeypatch.setenv(BUDGET_ENV, str(int(per_node * (1 + TOLERANCE))))
    check_host_memory(cfg, dims, GPUS, "cuda", new_processes=True)
    # ... and the tolerance is tight: 10% less is refused, its parts named
    monkeypatch.setenv(BUDGET_ENV, str(int(per_node * 0.9)))
    with pytest.raises(ConfigError, match=r"8 ranks x ") as refused:
        check_host_memory(cfg, dims, GPUS, "cuda", new_processes=True)
    assert "process" in str(refused.value) and "cuda runtime" in str(refused.value)


def test_a_plan_over_the_host_only_by_its_processes_is_infeasible_naming_them(tmp_path, capsys):
    _, cfg = planned(tmp_path, capsys, DEBUG, "--model-states", "device", "--offload", "none")
    # the run's bytes and CUDA runtimes of the node's ranks, as the preflight counts them for running ranks
    run = GPUS * rank_host_bytes(cfg, check_layout(cfg, GPUS), "cuda", GPUS, 1e12)["total"]
    processes = GPUS * 0.3 * GIB  # 0.3 GiB per rank (the launcher's 0.276 GiB measured, rounded up)
    host_gib = (run + processes / 2) / 0.8 / GIB  # usable (0.8 of it) holds the run, not its processes
    code = main([*plan_args(DEBUG), "--no-write", "--model-states", "device", "--offload", "none", "--hw",
                 f"host_memory_gib={host_gib}"])
    out, err = capsys.readouterr()
    assert code != 0, out
    text = " ".join(err.split())
    assert f"needs {(run + processes) / GIB:.1f} GiB of host memory per node (" in text, text
    assert f"process {processes / GIB:.1f}, cuda runtime" in text and f"usable of {host_gib:g}" in text, text
