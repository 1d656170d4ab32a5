"""`longctx eval --nproc 2` whose rank 0 alone stops part-way (helper task evalhang110).

Failed before: `longctx eval --mode generate --nproc 2` whose rank 0 alone stopped in the middle of the run (here
SIGTERM to that rank only; an out-of-memory error of its device would do the same) hung for good, nothing on stderr
after rank 0's "stopped" line, until killed. eval's evaluate_tasks, on the error, ended the process groups with
finish_distributed, whose barrier waited for rank 1, which waited in the next decode step's collective for rank 0.
A failed run now leaves the groups to the process's exit (launch.py end_one_rank_group, as generate and train do):
rank 0 keeps the lengths it finished and exits, torchrun stops rank 1, and the job ends within seconds.
--mode score (ppl here) ended its one-rank group without a barrier already: it is checked beside it, as a guard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from live_processes import processes_naming

ENDS_WITHIN_S = 90  # (after rank 0 is stopped: a few seconds on a 2-core CPU; before the fix it never ended)
STARTS_WITHIN_S = 240  # (until the first length's line: imports, the model loaded on both ranks)


def _rank_pid(marker: str, rank: int) -> int | None:
    """The PID of the rank `rank` whose command line holds `marker` (this test's model directory), from /proc."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (cmdline.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in args and f"RANK={rank}".encode() in env and b"LOCAL_WORLD_SIZE=2" in env:
            return int(cmdline.parent.name)
    return None


@pytest.mark.parametrize("mode", ["generate", "score"])
def test_two_ranks_whose_rank_0_alone_stops_end_at_once(tmp_path, mode):
    """SIGTERM to rank 0 only, once it said its first length: the job ends within seconds (not 0), rank 0's finished
    length kept in --output's .incomplete file, no rank left running."""
    pytest.importorskip("transformers")  # (test_hf writes the model with it)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import test_hf

    model, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama", vocab_size=300, initializer_range=0.1))
    root = Path(sysconfig.get_paths()["stdlib"])
    text = tmp_path / "long.py"
    text.write_text("".join((root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")))
    task = ["--task", "passkey", "--mode", "generate", "--depths", "0,1", "--samples", "2"] if mode == "generate" \
        else ["--task", "ppl", "--samples", "4"]
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "longctx", "eval", "--checkpoint", f"hf:{model}", "--tokenizer", "byte",
               "--data", str(text), "--lengths", "128,160,192,224,256", *task, "--output", str(out), "--nproc", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    # (a session of its own: a run that hangs is killed whole, launcher and ranks, below)
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    lines: list[str] = []
    first_length = threading.Event()

    def read():
        for line in run.stderr:
            lines.append(line)
            if " at 128 tokens: " in line:
                first_length.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = None
    try:
        assert first_length.wait(STARTS_WITHIN_S), "".join(lines)
        pid = _rank_pid(str(model), 0)
        assert pid is not None and _rank_pid(str(model), 1) is not None, "".join(lines)
        os.kill(pid, signal.SIGTERM)  # (rank 0 alone: rank 1 goes on to the next length)
        start = time.monotonic()
        code = run.wait(timeout=ENDS_WITHIN_S)
        seconds = time.monotonic() - start
    except subprocess.TimeoutExpired:
        pass
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        reader.join(timeout=10)
    err = "".join(lines)
    assert code is not None, f"still running {ENDS_WITHIN_S} s after rank 0 was stopped (killed); stderr:\n{err}"
    assert code != 0, err
    assert "eval: stopped (terminated (SIGTERM))" in err, err
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert 128 in kept["incomplete"]["lengths_done"] and 256 in kept["incomplete"]["lengths_not_run"], kept
    assert not out.exists()
    assert not processes_naming(str(model)), processes_naming(str(model))
    print(f"{mode}: ended {seconds:.1f} s after rank 0's SIGTERM, exit {code}; stderr:\n{err}")
