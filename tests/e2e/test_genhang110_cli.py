"""`longctx generate --nproc 2` whose reader closes early (helper task genhang110).

Failed before:
- `longctx generate --nproc 2 ... | head -c 1`, and `--output FIFO` read by `head -c 1 FIFO`: the job hung, nothing on
  stderr, until killed (`timeout 300`: rc 124), where `--nproc 1` ends at once with one line and exit 141. Rank 0
  raised ReaderGone (only it writes), and generate's `finally: finish_distributed()` then waited in a barrier for
  rank 1, which waited in the next prompt's collective for rank 0. A failed run now leaves the groups to the
  process's exit (launch.py end_one_rank_group, as train does): rank 0 hands its error to the launcher and exits
  141, torchrun stops rank 1, and the launcher says the error once, exit 141 (torchrun's own "failed (exitcode:
  141) local_rank: 0 (pid ...)" line, which the summary repeats, left out).
- SIGTERM to the launcher of a generate (or eval) job said it stopped "before the ranks saved a checkpoint", with
  checkpoint.on_signal and `--checkpoint.resume auto`: train's words, for a command that saves none. It now names the
  job's command and what that command keeps; a signal passed on to generate's ranks no longer speaks of training; and
  generate's ranks note a whole run, so a signal after it stops nothing (as train's do).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from live_processes import processes_naming

ENDS_WITHIN_S = 60  # (the run itself: about 10 s on a 2-core CPU; before the fix it never ended)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("reader", ["stdout", "fifo"])
def test_two_ranks_whose_reader_closes_end_at_once_as_one_process_does(tmp_path, reader):
    """`longctx generate --nproc 2 ... | head -c 1` (and `--output FIFO` with `head -c 1 FIFO`): within seconds,
    exit 141 and one error line (as --nproc 1), no traceback, no rank left running, no file beside the pipe."""
    pytest.importorskip("transformers")  # (test_hf writes the model with it)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import test_hf

    model, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama", vocab_size=300, initializer_range=0.1))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "hello " * (i + 1)}) + "\n" for i in range(6)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "longctx", "generate", "--checkpoint", f"hf:{model}", "--tokenizer", "byte",
               "--prompts", str(prompts), "--max-new-tokens", "4", "--batch", "1", "--nproc", "2",
               # (every token's 300 logprobs, 6.6 KB: 6 lines of 27 KB outgrow the pipe's 64 KiB, so the job cannot
               # finish writing before `head` reads and closes, however late it is scheduled: with 2 new tokens and
               # no logprobs, under the full suite's load, all six lines fitted the pipe first and the run ended 0)
               "--logprobs", "300"]
    pipe = tmp_path / "pipe"
    if reader == "fifo":
        os.mkfifo(pipe)
        command += ["--output", str(pipe)]
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_out:
        # (a session of its own: a run that hangs is killed whole, launcher and ranks, below)
        run = subprocess.Popen(command, stdout=subprocess.PIPE if reader == "stdout" else subprocess.DEVNULL,
                               stderr=err_out, env=env, start_new_session=True)
        # (GENHANG_HEAD_LATE_S=8 starts the reader late, as a loaded machine may: the race the logprobs rule out)
        late = os.environ.get("GENHANG_HEAD_LATE_S", "0")
        head = subprocess.Popen(["sh", "-c", f'sleep {late}; exec head -c 1 "$@"', "sh"]
                                + ([str(pipe)] if reader == "fifo" else []),
                                stdin=run.stdout if reader == "stdout" else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
        if run.stdout is not None:
            run.stdout.close()  # (head holds the pipe's only reader, as in a shell)
        start = time.monotonic()
        try:
            code = run.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            code = None
        finally:
            head.kill()
            head.wait()
    seconds = time.monotonic() - start
    err = err_file.read_text()
    assert code is not None, f"still running after {ENDS_WITHIN_S} s (killed); stderr:\n{err}"
    flat = " ".join(err.split())
    said = "stdout" if reader == "stdout" else f"--output {pipe}"
    assert code == 141, err
    assert f"longctx generate: error: rank 0 of 2: {said} was closed by its reader" in flat, err
    assert flat.count("was closed by its reader") == 1 and flat.count("error:") == 1, err
    assert "Traceback" not in err and "exitcode" not in err and "[rank" not in err, err
    # (no rank left behind: the launcher's children, which name the model directory)
    assert not processes_naming(str(model)), processes_naming(str(model))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pipe")) == (["pipe"] * (reader == "fifo"))
    print(f"{reader}: ended in {seconds:.1f} s, exit {code}")


def _stopped_launch(tmp_path, monkeypatch, command: str) -> None:
    """The launcher of `longctx COMMAND --nproc 2`, got SIGTERM while its ranks ran (torchrun's agent raises);
    `kept` as each command's own launch passes it (eval names its --output's .incomplete file; generate nothing)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from longctx.eval.stopped import kept_where
    from longctx.job import relaunch

    def run(_args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (share_cores would set it for the ranks)
    kept = kept_where(str(tmp_path / "out.json")) if command == "eval" else ""
    relaunch._relaunch(2, [command, "--checkpoint", "hf:x"], 0.5, tmp_path, kept=kept)


@pytest.mark.parametrize("command, kept", [("generate", "FILE.partial"), ("eval", ".incomplete")])
def test_sigterm_to_a_generate_or_eval_launcher_names_its_command_not_training_checkpoints(tmp_path, monkeypatch,
                                                                                             command, kept):
    from longctx.job import relaunch

    with pytest.raises(relaunch.RankError) as stopped:
        _stopped_launch(tmp_path, monkeypatch, command)
    said = " ".join(str(stopped.value).split())
    assert stopped.value.exit_code == 128 + int(signal.SIGTERM)
    assert f"stopped by SIGTERM before `longctx {command}` finished" in said and kept in said, said
    assert "checkpoint.on_signal" not in said and "resume" not in said and "trained" not in said, said


def test_sigterm_to_a_train_launcher_still_speaks_of_its_checkpoints(tmp_path, monkeypatch):
    from longctx.job import relaunch

    with pytest.raises(relaunch.RankError, match="before the ranks saved a checkpoint"):
        _stopped_launch(tmp_path, monkeypatch, "train")


def test_a_signal_passed_on_to_generates_ranks_is_not_said_in_trainings_words():
    from types import SimpleNamespace

    from longctx.job import relaunch

    failures = {r: SimpleNamespace(exitcode=-int(signal.SIGUSR1), timestamp=100 + r) for r in range(2)}
    said = str(relaunch._first_failure(failures, 2, [signal.SIGUSR1], command="generate"))
    assert "passed it on to the ranks" in said and "`longctx generate` does not act on it" in said, said
    assert "training" not in said and "checkpoint" not in said, said


def test_a_failed_generate_rank_waits_for_no_peer_and_a_whole_one_notes_it_finished(tmp_path, monkeypatch):
    """generate's run: an error (rank 0's ReaderGone) ends no group with a barrier (finish_distributed waited there
    for peers still in a collective); a whole run notes it finished for the launcher, then ends its groups."""
    from longctx.generate import cli, output
    from longctx.job import launch, relaunch

    calls = []
    monkeypatch.setattr(launch, "finish_distributed", lambda: calls.append("finish"))
    monkeypatch.setattr(launch, "end_one_rank_group", lambda: calls.append("end one-rank group"))
    monkeypatch.setenv(relaunch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")

    def gone(request, args):
        raise output.ReaderGone("stdout was closed by its reader")

    monkeypatch.setattr(cli, "_run", gone)
    with pytest.raises(output.ReaderGone):
        cli.run(None, None)
    assert calls == ["end one-rank group"] and not relaunch._all_finished(tmp_path, 1)
    calls.clear()
    monkeypatch.setattr(cli, "_run", lambda request, args: 0)
    assert cli.run(None, None) == 0
    assert calls == ["finish"] and relaunch._all_finished(tmp_path, 1)
