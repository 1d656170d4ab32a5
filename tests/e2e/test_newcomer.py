"""The newcomer's path, as a user meets it: errors found before launch and printed once, a used run
directory never overwritten, logs without progress-bar frames when output is not a terminal."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--train.seq_len=128", "--data.max_docs=100", "--train.eval_interval=0", "--metrics.log_interval=1",
        "--metrics.plots=true", "--model.layers=1"]


def longctx(*args, cwd=None, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def longctx_here(*args, cwd=None):
    """`longctx ARGS` run in this process, as `longctx` runs it in a new one: the same returncode, stdout
    and stderr. For commands refused before any work, where a new interpreter and its torch import
    (seconds each) buy nothing; every command keeps tests of the real subprocess too. File descriptors
    1 and 2 are captured as well, so that a process the command starts (a rank launched by mistake)
    still shows in the output checked. What main changes in the process is put back: environment,
    working directory, torch's threads and default dtype. An exception main lets through fails the
    test here (a subprocess would print a Traceback, which these tests refuse as well)."""
    import contextlib
    import tempfile

    import torch

    from longctx.cli import main

    env, here = dict(os.environ), os.getcwd()
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.chdir(cwd or ROOT)
            os.dup2(fd_out.fileno(), 1)
            os.dup2(fd_err.fileno(), 2)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main([str(a) for a in args])
                except SystemExit as e:  # argparse's errors, and sys.exit
                    code = e.code
                    if code is not None and not isinstance(code, int):
                        print(code, file=sys.stderr)
                        code = 1
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            os.chdir(here)
            for key in set(os.environ) - set(env):
                del os.environ[key]
            os.environ.update(env)
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
        fd_out.seek(0)
        fd_err.seek(0)
        stdout = out.getvalue() + fd_out.read().decode(errors="replace")
        stderr = err.getvalue() + fd_err.read().decode(errors="replace")
    return subprocess.CompletedProcess(["longctx", *args], code or 0, stdout, stderr)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def store_256(tmp_path_factory):
    """A small data store of 256-token samples."""
    tmp = tmp_path_factory.mktemp("store")
    src = tmp / "texts"
    src.mkdir()
    for i in range(40):
        (src / f"t{i}.txt").write_text(f"document {i} " + "lorem ipsum dolor sit amet " * (20 + i))
    r = longctx("data", "build", "--input", str(src), "--seq-len", "256", "--out", str(tmp / "s"), "--no-progress")
    assert r.returncode == 0, r.stderr
    return tmp / "s"


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """A tokenizer.json of 1000 tokens (more than the debug model's 320) and a corpus for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(998)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"d{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 998}" for j in range(400)))
    return tmp / "tokenizer.json", corpus


def _error_cases(store_256, big_tokenizer, tmp):
    tokenizer, corpus = big_tokenizer
    return {
        "tokenizer vs vocab": (["--data.corpus", str(corpus), "--data.tokenizer", str(tokenizer)],
                               "has 1000 tokens but model.vocab_size is 320"),
        "store length vs seq_len": (["--data.path", str(store_256), "--train.seq_len", "512"],
                                    "holds samples of 256 tokens but train.seq_len is 512"),
        "missing store": (["--data.path", str(tmp / "no-store")], "is not a longctx data store"),
        "missing resume path": (["--checkpoint.resume", str(tmp / "no-ckpt")], "no complete checkpoint there"),
        "resume auto without a run": (["--checkpoint.resume", "auto"], "needs the run to continue"),
        "missing HF model": (["--model.init_from", f"hf:{tmp / 'no-model'}"], "no-model"),
    }


@pytest.mark.parametrize("case", ["tokenizer vs vocab", "store length vs seq_len", "missing store",
                                  "missing resume path", "resume auto without a run", "missing HF model"])
def test_each_error_is_found_before_launch_and_printed_once(case, store_256, big_tokenizer, tmp_path):
    args, needle = _error_cases(store_256, big_tokenizer, tmp_path)[case]
    r = longctx_here("train", "--nproc", "4", *args, cwd=tmp_path)
    assert r.returncode != 0
    err = flat(r.stderr)
    assert err.count(needle) == 1, r.stderr
    assert err.count("error:") == 1, r.stderr
    # before any rank started: no rank's output, no launcher lines, no traceback
    for sign in ("Traceback", "torch.distributed", "SIGTERM", "[rank", "model:", "setup:"):
        assert sign not in r.stderr + r.stdout, (sign, r.stderr, r.stdout)
    assert not (tmp_path / "runs").exists()  # nor a run directory


def test_an_error_found_by_the_ranks_is_printed_once_naming_them(tmp_path):
    """With the launcher's checks skipped, every rank meets the missing store itself: the launcher
    prints the message once for all of them, without the launcher's own lines."""
    code = ("import sys, longctx.train.preflight as p; p.preflight = lambda *a, **k: None; "
            "from longctx.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "train", "--nproc", "2", "--parallel.ctx", "2",
                        "--data.path", str(tmp_path / "no-store")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode != 0
    err = flat(r.stderr)
    assert err.count("is not a longctx data store") == 1, r.stderr
    # both ranks meet it; one may be stopped by the launcher before it reports
    assert re.search(r"(all 2 ranks|rank [01] of 2): ", err), r.stderr
    assert "SIGTERM" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_error_on_one_rank_is_printed_once_by_that_rank(tmp_path):
    """Rank 1 alone fails after launch (here: a planted error in its data setup); rank 0, waiting for
    it in a collective, fails only as a consequence. The launcher prints rank 1's message, once."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import longctx.train.setup as rs\n"
        "    from longctx.errors import DataError\n"
        "    def broken(*a, **k):\n"
        "        raise DataError('the disk of rank 1 is full')\n"
        "    rs.build_data = broken\n"
        "    import longctx.train.trainer as t\n"
        "    t.build_data = broken\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--nproc", "2", "--parallel.ctx", "2", *TINY,
                        "--train.steps", "2"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 1
    err = flat(r.stderr)
    assert err.count("the disk of rank 1 is full") == 1, r.stderr
    assert "rank 1 of 2: the disk of rank 1 is full" in err, r.stderr
    assert "Traceback" not in r.stderr and "SIGTERM" not in r.stderr, r.stderr


def test_errors_of_some_ranks_are_grouped_by_message(tmp_path):
    from longctx.job.relaunch import _rank_errors, _ranks_label

    for rank, msg in ((2, "disk full"), (0, "bad"), (3, "disk full")):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"message": msg, "exit_code": 1}))
    found = _rank_errors(tmp_path)
    assert found == {"bad": ([0], 1), "disk full": ([2, 3], 1)}
    assert _ranks_label([2], 4) == "rank 2 of 4" and _ranks_label([2, 3], 4) == "ranks 2, 3 of 4"
    assert _ranks_label([0, 1, 2, 3], 4) == "all 4 ranks"


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def test_a_used_run_directory_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    # (no checkpoint: a resume of it has nothing to continue from; the run to protect, made in this process)
    first = longctx_here("train", "--nproc", "1", *TINY, "--train.steps", "3", "--train.run_dir", str(run),
                         "--checkpoint.final", "false")
    assert first.returncode == 0, first.stderr
    before = _snapshot(run)
    assert {"config.toml", "metrics.jsonl", "loss.png", "throughput.png"} <= set(before)
    for extra in ([], ["--checkpoint.resume", "auto"], ["--nproc", "2", "--parallel.ctx", "2"]):
        r = longctx_here("train", "--nproc", "1", *TINY, "--train.steps", "5", "--train.run_dir", str(run), *extra)
        assert r.returncode != 0, (extra, r.stdout)
        err = flat(r.stderr)
        assert "already holds a run" in err and "another --train.run_dir" in err, r.stderr
        assert err.count("error:") == 1 and "Traceback" not in r.stderr
        assert _snapshot(run) == before, extra


def test_resuming_continues_the_run_and_keeps_what_it_replaces(tmp_path):
    run = tmp_path / "run"
    common = ["--nproc", "1", *TINY, "--train.run_dir", str(run), "--checkpoint.interval", "2"]
    # (in this process: the test reads the files and what the runs say, not how their processes end)
    first = longctx_here("train", *common, "--train.steps", "5")
    assert first.returncode == 0, first.stderr
    assert "checkpoint: saved step 4" in first.stdout and "checkpoint: saved step 5" in first.stdout  # the last
    old = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # back to step 4 (as after a crash between two saves): step 5's record is replaced
    r = longctx_here("train", *common, "--train.steps", "6", "--checkpoint.resume",
                     str(run / "checkpoints/step-00000004"))
    assert r.returncode == 0, r.stderr
    assert "resumed step 4" in r.stdout
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # one record per step: the plots read as one run
    moved = [json.loads(x) for x in (run / "metrics.after-step4.jsonl").read_text().splitlines()]
    assert moved == [x for x in old if x["step"] == 5]  # the replaced attempt is kept, not lost
    # the config changed (train.steps): the earlier one is kept beside the new one
    assert "steps = 5" in (run / "config.before-step4.toml").read_text()
    assert "steps = 6" in (run / "config.toml").read_text()


def test_the_plainest_run_saves_its_last_step_and_generate_reads_it(tmp_path):
    """checkpoint.final (default true): a run with no periodic saves still keeps its end, the done line
    says where, and `longctx generate` reads it; turned off, the done line says nothing was saved."""
    run = tmp_path / "run"
    r = longctx("train", "--nproc", "1", *TINY, "--train.steps", "3", "--train.run_dir", str(run))
    assert r.returncode == 0, r.stderr
    done = flat(r.stdout.splitlines()[-1])
    step_dir = run / "checkpoints" / "step-00000003"
    assert done.startswith("done:") and f"the last step's weights in {step_dir}/" in done, done
    assert "config, metrics and plots are in" in done
    assert (step_dir / "manifest.json").is_file() and not (run / "checkpoints" / "step-00000002").exists()
    g = longctx("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "4")
    assert g.returncode == 0, g.stderr
    assert len(json.loads(g.stdout.splitlines()[-1])["tokens"]) == 4
    # resumed as it is, the finished run says so before building data or model, in a done line
    r = longctx_here("train", "--train.run_dir", str(run), "--checkpoint.resume", "auto")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("done: nothing to train") and "step 3" in lines[-1], r.stdout
    assert not any(line.startswith(("data:", "model:")) for line in lines), r.stdout
    off = tmp_path / "off"
    r = longctx("train", "--nproc", "1", *TINY, "--train.steps", "2", "--train.run_dir", str(off),
                "--checkpoint.final", "false", "--metrics.plots", "false")
    assert r.returncode == 0, r.stderr
    done = flat(r.stdout.splitlines()[-1])
    assert "nothing saved" in done and "plots" not in done.split("nothing saved")[0], done
    assert not (off / "checkpoints").exists()


def test_logs_sent_to_a_file_have_no_progress_bar_frames(tmp_path):
    r = longctx("train", "--nproc", "1", *TINY, "--train.steps", "4", "--metrics.progress", "true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr + r.stdout
    assert not re.search(r"\d+/\d+ \[", r.stderr), r.stderr  # tqdm's "3/4 [" frames
    lines = r.stdout.splitlines()
    assert sum(line.startswith("step") for line in lines) == 4 and lines[-1].startswith("done:")


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_a_progress_bar_is_shown_only_on_a_terminal(monkeypatch):
    from longctx import progress

    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stderr", _Stream(tty=False))
    assert progress.progress_bar(10, "train", "step") is None
    monkeypatch.setattr(sys, "stderr", _Stream(tty=True))
    bar = progress.progress_bar(10, "train", "step")
    assert bar is not None
    bar.update(1)
    bar.close()
    assert "train" in sys.stderr.getvalue()
    assert progress.progress_bar(10, "train", "step", enabled=False) is None
    monkeypatch.setenv("TERM", "dumb")
    assert progress.progress_bar(10, "train", "step") is None
