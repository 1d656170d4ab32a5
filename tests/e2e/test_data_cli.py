"""`longctx data build` and training from its store, as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from test_newcomer import longctx_here

ROOT = Path(__file__).resolve().parents[2]


def longctx(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=300)


def test_build_then_train_from_the_store(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(60):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n\n" * (1 + i % 7))
    (src / "dup.py").write_text((src / "m5.py").read_text())
    (src / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    out = tmp_path / "store"
    r = longctx("data", "build", "--input", str(src), "--seq-len", "128", "--out", str(out), "--workers", "2",
                "--eval-fraction", "0.3", "--no-progress")
    assert r.returncode == 0, r.stderr
    for stage in ("scan", "dedup", "embed", "cluster", "pack"):
        assert f"  {stage}" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["duplicates_removed"] == 1 and m["totals"]["files_skipped"] == 1
    run = tmp_path / "run"
    r = longctx("train", "--nproc", "1", f"--data.path={out}", "--train.seq_len=128", "--train.steps=4",
                "--train.eval_interval=2", "--train.eval_batches=1", "--train.global_batch=2", "--model.layers=1",
                f"--train.run_dir={run}", "--metrics.plots=false")
    assert r.returncode == 0, r.stderr
    assert "datasculpt, fill" in r.stdout and "eval loss" in r.stdout


def test_bad_build_input_is_one_paragraph(tmp_path):
    (tmp_path / "empty").mkdir()
    # refusals before any work, in this process (test_build_then_train_from_the_store runs both commands)
    r = longctx_here("data", "build", "--input", str(tmp_path / "empty"), "--seq-len", "64", "--out",
                     str(tmp_path / "s"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "holds no usable file" in " ".join(r.stderr.split())
    assert not (tmp_path / "s" / "manifest.json").exists()
    r = longctx_here("train", "--nproc", "1", f"--data.path={tmp_path / 'missing'}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "not a longctx data store" in " ".join(r.stderr.split())


def test_a_data_build_never_imports_torch(tmp_path):
    """`longctx data build` runs where torch is not wanted (a data machine, a bounded-memory build):
    nothing it imports may pull torch in."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.py").write_text("def f():\n    return 1\n\n" * 40)
    args = ["data", "build", "--input", str(tmp_path / "in"), "--seq-len", "64", "--out", str(tmp_path / "s"),
            "--no-progress"]
    code = (f"import sys\nfrom longctx.cli import main\ntry:\n    main({args!r})\nexcept SystemExit as e:\n"
            f"    assert not e.code, e.code\nprint('torch imported:', 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s" / "manifest.json").is_file()
    assert "torch imported: False" in r.stdout, r.stdout
