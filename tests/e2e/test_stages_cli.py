"""train.stages end to end: the length (and batch) switch at the boundary, and a resume from before, at
or after it continues exactly, under another layout too. One-process runs are in this process
(test_newcomer.longctx_here: the tests read the runs' metrics and what they say, and a new interpreter's
imports cost seconds a run); the refusal and the 2-rank resumes are real subprocesses."""

import json
import shutil

import pytest
from test_newcomer import longctx, longctx_here

STAGED = ["--train.stages=128:3:4,256:3:2", "--data.max_docs=100", "--train.eval_interval=0",
          "--metrics.log_interval=1", "--model.layers=1", "--checkpoint.interval=1", "--checkpoint.keep=10",
          "--metrics.plots=false", "--metrics.progress=false", "--data.synthetic=passkey:0.5"]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["seq_len"], r["tokens"]) for r in records if r.get("kind") == "train"}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("staged")
    r = longctx_here("train", "--nproc", "1", *STAGED, f"--train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    assert "stage 1/2: steps 1-3 at 128 tokens" in r.stdout and "stage 2/2: steps 4-6 at 256 tokens" in r.stdout
    return run


def test_lengths_and_batches_switch_at_the_boundary(full_run):
    losses = _losses(full_run)
    assert [losses[s][1] for s in range(1, 7)] == [128, 128, 128, 256, 256, 256]
    assert losses[6][2] == 3 * 128 * 4 + 3 * 256 * 2  # tokens trained, per stage batch


def test_a_stage_too_short_for_the_mixture_is_refused_before_work(tmp_path):
    r = longctx("train", "--nproc", "1", *STAGED, "--train.stages=64:2,128:2", f"--train.run_dir={tmp_path / 'r'}")
    assert r.returncode == 2, r.stderr
    assert "train.stages length = 64" in " ".join(r.stderr.split()) and "no room for filler" in r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("resume_at, nproc", [(2, 1), (3, 2), (4, 2)])
def test_resume_across_the_boundary_continues_exactly(full_run, tmp_path, resume_at, nproc):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    ckpts = run / "checkpoints"
    for later in range(resume_at + 1, 7):
        shutil.rmtree(ckpts / f"step-{later:08d}")
    (ckpts / "latest").write_text(f"step-{resume_at:08d}\n")
    r = (longctx_here if nproc == 1 else longctx)("train", "--nproc", str(nproc), *STAGED, f"--train.run_dir={run}",
                                                  "--checkpoint.resume=auto")
    assert r.returncode == 0, r.stderr
    assert f"resumed step {resume_at}" in r.stdout
    want, got = _losses(full_run), _losses(run)
    for step in range(resume_at + 1, 7):
        assert got[step][1:] == want[step][1:]
        assert abs(got[step][0] - want[step][0]) < 1e-4, (step, got[step], want[step])
