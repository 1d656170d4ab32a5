"""What a benchmark's JSON says about its own run, for a reader comparing two of them: bench attention, train
and comm and `plan --validate` wrote no date (bench moe, memory, decode and generate do; docs/benchmarks.md:
every figure names the machine and the date), bench comm no machine, and bench train neither the --steps
nor the --global-batch its rates are of (two files of other batches read as one setting at two speeds),
nor which memory its memory_gib_max is (peak RSS on a CPU, the allocator's peak on a GPU)."""

import argparse
import json
from datetime import date
from pathlib import Path
from types import SimpleNamespace

from longctx.bench import attention_common, comm_cluster
from longctx.bench import train as bench_train


def _today(said: str) -> bool:
    """`said` is today's date (or yesterday's, for a test that ran across midnight: CI's run at 00:0x did)."""
    return said in {date.today().isoformat(), date.fromordinal(date.today().toordinal() - 1).isoformat()}


def test_bench_attention_says_the_date_beside_the_machine():
    machine = attention_common.machine_summary({"loadavg_1m": 0.0, "pytest_processes": 0})
    assert _today(machine["date"]) and machine["torch"]


def test_bench_train_says_the_date_the_steps_and_the_batch_its_rates_are_of(monkeypatch, capsys):
    real_run = bench_train.subprocess.run

    def run(cmd, **kw):  # the `longctx train` subprocess: three steps of metrics (others, uname and git, run)
        if not any(str(a).startswith("--train.run_dir=") for a in cmd):
            return real_run(cmd, **kw)
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--train.run_dir="))
        (Path(run_dir) / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "train", "step": s, "loss": 1.0, "tokens_per_s": 100.0, "mfu": 0.1,
                        "memory_gib": 0.5, "memory_kind": "peak RSS"}) + "\n" for s in (1, 2, 3)))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(bench_train.subprocess, "run", run)
    args = SimpleNamespace(presets="debug", seq_len="64", layouts="single", steps=3, global_batch=4)
    assert bench_train.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert _today(doc["date"])
    assert doc["config"] == {"presets": "debug", "seq_len": "64", "layouts": "single", "steps": 3,
                             "global_batch": 4}
    assert doc["rows"][0]["memory_kind"] == "peak RSS"


def test_bench_comm_says_the_date_and_the_machine(monkeypatch, capsys):
    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    args = p.parse_args(["--cluster", "2x2", "--modes", "fsdp", "--timed", "1"])
    monkeypatch.setattr(comm_cluster, "run_spawned", lambda *_a, **_k: [{"profile": {}, "modes": {}}])
    assert comm_cluster.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert _today(doc["date"]) and doc["machine"]["cpus"] and doc["machine"]["torch"]


def test_plan_validate_says_the_date(monkeypatch, capsys):
    from longctx.costs.hardware import PRESETS
    from longctx.planner import validate

    monkeypatch.setattr(validate, "calibrate", lambda world: PRESETS["h100"])
    assert validate.main(cases=[], ranking_cases=[]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert _today(doc["date"]) and doc["machine"]["torch"]


def test_a_benchmarks_record_names_the_commit_that_measured_it(tmp_path, monkeypatch):
    """docs/benchmarks.md's figures name a machine and a date but not the code: two JSONs of different commits
    could not be told apart. From a git checkout the record has the commit and whether the package differed from it;
    an installed copy (no git) says None, not a guess."""
    import subprocess

    from longctx.job import devices

    record = devices.machine_record()["code"]
    head = subprocess.run(["git", "-C", str(devices.Path(devices.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        assert record["commit"] == head.stdout.strip() and isinstance(record["dirty"], bool)

    def no_git(*_a, **_k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(devices.subprocess, "run", no_git)
    assert devices.code_record() == {"version": record["version"], "commit": None, "dirty": None}


def test_an_installed_copy_inside_another_repository_records_no_commit_of_it(tmp_path, monkeypatch):
    """A longctx installed into a venv that lies in the user's own repository (ignored there): `git rev-parse HEAD`
    from the package answers that repository's commit, which is not the code that measured the figure."""
    import subprocess

    from longctx.job import devices

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    git("add", ".gitignore")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "theirs")
    package = tmp_path / ".venv" / "site-packages" / "longctx"
    (package / "job").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(devices, "__file__", str(package / "job" / "devices.py"))
    monkeypatch.delenv("LONGCTX_COMMIT", raising=False)
    assert devices.code_record()["commit"] is None
    monkeypatch.setenv("LONGCTX_COMMIT", "abc123")
    assert devices.code_record()["commit"] == "abc123"
