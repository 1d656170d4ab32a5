"""`longctx bench train` with one run failing: the other rows keep their figures (as before), the failed row says
why even when its run was killed without a word (the OOM killer's SIGKILL left "error": ""), and the command
exits 1 after printing the JSON, naming the failed runs on stderr (rc 0 read as every row measured)."""

import json
from pathlib import Path
from types import SimpleNamespace

from longctx.bench import train as bench_train
from longctx.cli import main


def _fake_runs(monkeypatch, killed_layout: str):
    real = bench_train.subprocess.run

    def run(cmd, **kw):
        if "longctx" not in cmd:  # (code_record's git)
            return real(cmd, **kw)
        if "--parallel.ctx=4" in cmd and killed_layout == "ctx4":
            return SimpleNamespace(returncode=-9, stderr="")
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--train.run_dir="))
        records = [{"kind": "train", "step": s, "loss": 1.0, "tokens_per_s": 100.0, "mfu": 0.1, "memory_gib": 0.5}
                   for s in (1, 2, 3)]
        (Path(run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(bench_train.subprocess, "run", run)


def test_a_killed_run_is_said_and_the_others_kept(monkeypatch, capsys):
    _fake_runs(monkeypatch, "ctx4")
    assert main(["bench", "train", "--presets", "debug", "--seq-len", "64", "--layouts", "single,ctx4"]) == 1
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    assert rows[0]["layout"] == "single" and rows[0]["tokens_per_s"] == 100.0
    assert rows[1]["error"] == "longctx train ended with killed by signal 9 and printed nothing"
    assert "1 of 2 runs failed" in captured.err and "debug at 64 tokens, layout ctx4" in captured.err


def test_every_run_measured_is_rc_0(monkeypatch, capsys):
    _fake_runs(monkeypatch, "")
    assert main(["bench", "train", "--presets", "debug", "--seq-len", "64", "--layouts", "single,ctx4"]) == 0
    assert all("error" not in r for r in json.loads(capsys.readouterr().out)["rows"])
