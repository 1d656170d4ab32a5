"""Checkpoints: save under one layout, resume under another; atomic commit; verify; export."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longctx.checkpoint.manager import latest_checkpoint
from longctx.checkpoint.manifest import CheckpointError, verify
from longctx.config import load_config
from longctx.parallel.spawn import run_spawned
from longctx.train import train

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--train.steps=10", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=300", "--train.seq_len=256"]
LAYOUTS = {
    "single": (1, []),
    "dp2-ctx2": (4, ["--parallel.ctx=2"]),
    "head2-ctx2": (4, ["--parallel.head=2", "--parallel.ctx=2"]),
    "ctx4-window2": (4, ["--parallel.ctx=4", "--parallel.window=2"]),
    "dp4": (4, []),
    "dp2-ctx2-ctxfirst": (4, ["--parallel.ctx=2", "--parallel.placement=ctx-first"]),
}


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    res = train(cfg, log=lambda *a, **k: None)
    return res.first_step, res.losses


def run_layout(layout, args, run_dir):
    world, layout_args = LAYOUTS[layout]
    if world == 1:
        return _train([*layout_args, *args], run_dir)
    return run_spawned(world, _train, [*layout_args, *args], str(run_dir))[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_layout("single", [], tmp_path_factory.mktemp("full"))[1]


@pytest.mark.parametrize("a, b", [("dp2-ctx2", "head2-ctx2"), ("head2-ctx2", "single"),
                                  ("single", "ctx4-window2"), ("dp4", "dp2-ctx2-ctxfirst")])
def test_resume_under_another_layout(a, b, uninterrupted, tmp_path):
    # layout A: train to step 10 saving at step 5 (keep both checkpoints), then resume at 5 under B
    run_layout(a, ["--checkpoint.interval=5", "--checkpoint.keep=2"], tmp_path)
    ckpts = tmp_path / "checkpoints"
    five = ckpts / "step-00000005"
    assert verify(five)["layout"]["world"] == LAYOUTS[a][0]
    first, losses = run_layout(b, [f"--checkpoint.resume={five}", "--checkpoint.dir=" + str(tmp_path / "b")],
                               tmp_path)
    assert first == 6 and len(losses) == 5
    diff = max(abs(x - y) for x, y in zip(losses, uninterrupted[5:]))
    print(f"{a} -> {b}: steps 6-10 max |loss - uninterrupted| = {diff:.2e}")
    assert diff <= 1e-5


def test_async_saves_commit_atomically_and_prune(tmp_path):
    first, losses = run_layout("dp2-ctx2", ["--checkpoint.interval=2", "--checkpoint.keep=2",
                                            "--checkpoint.async=true"], tmp_path)
    ckpts = tmp_path / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["latest", "step-00000008", "step-00000010"], names
    assert latest_checkpoint(ckpts).name == "step-00000010"
    m = verify(ckpts / "step-00000010")
    assert m["step"] == 10 and m["layout"]["ctx"] == 2 and all(f["sha256"] for f in m["files"])


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    _train(["--checkpoint.interval=10", "--train.steps=10"], tmp_path)
    ck = tmp_path / "checkpoints" / "step-00000010"
    # another model shape
    with pytest.raises(CheckpointError, match="another model .*dim 128 in the checkpoint vs 64 configured"):
        _train([f"--checkpoint.resume={ck}", "--model.dim=64", "--checkpoint.dir=" + str(tmp_path / "x")],
               tmp_path / "other")
    # truncated shard
    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        verify(ck)
    # missing shard
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        _train([f"--checkpoint.resume={ck}", "--checkpoint.dir=" + str(tmp_path / "y")], tmp_path / "other2")
    # an interrupted save (no manifest) is not a checkpoint
    (ck / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete longctx checkpoint"):
        verify(ck)


def test_export_to_hf_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, losses = _train(["--checkpoint.interval=4", "--train.steps=4"], tmp_path)
    r = subprocess.run([sys.executable, "-m", "longctx", "checkpoint", "export", str(tmp_path / "checkpoints"),
                        str(tmp_path / "hf"), "--to", "hf"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "longctx", "checkpoint", "verify", str(tmp_path / "checkpoints")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "checksums match" in r.stdout, r.stderr
    from longctx.checkpoint.manager import load_model_weights
    from longctx.models.hf import load_hf
    from longctx.models.llama import build_model

    ours = build_model(load_config("configs/debug.toml").model, seed=None)
    load_model_weights(tmp_path / "checkpoints" / "step-00000004", ours)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 258, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4
    # import back: the imported model gives identical losses, and training starts from it
    back = load_hf(tmp_path / "hf")
    labels = tokens.roll(-1, 1)
    assert back(tokens, labels=labels).item() == ours(tokens, labels=labels).item()
    _, from_hf = _train([f"--model.init_from=hf:{tmp_path / 'hf'}", "--train.steps=3"], tmp_path / "imported")
    _, from_scratch = _train(["--train.steps=3"], tmp_path / "scratch")
    assert from_hf[0] < from_scratch[0] - 0.5  # it really starts from the trained weights


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "longctx", "train", "--config", "configs/debug.toml", "--nproc", "2",
           "--parallel.ctx=2", *BASE, "--train.steps=1000", "--checkpoint.interval=5", "--checkpoint.async=true",
           "--checkpoint.keep=5", f"--train.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 180
        ckpts = run_dir / "checkpoints"
        # wait until step 5 is committed, then kill while a later save is being written
        while time.time() < deadline and not (ckpts / "step-00000005" / "manifest.json").is_file():
            time.sleep(0.05)
        assert (ckpts / "step-00000005" / "manifest.json").is_file(), "no checkpoint was committed"
        while time.time() < deadline and not list(ckpts.glob(".tmp-step-0000001*")):
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    interrupted = [p.name for p in ckpts.glob(".tmp-step-*")]
    print(f"killed with latest={latest_checkpoint(ckpts).name}, interrupted saves left behind: {interrupted}")
    latest = latest_checkpoint(ckpts)
    assert latest is not None
    step = verify(latest)["step"]  # intact: every file present with its checksum
    assert step % 5 == 0 and step >= 5
    # resume auto continues from it; the losses match the uninterrupted run
    first, losses = run_layout("single", ["--checkpoint.resume=auto", "--train.steps=10" if step < 10 else
                                          f"--train.steps={step + 2}"], run_dir)
    assert first == step + 1
    if step < 10:
        assert max(abs(x - y) for x, y in zip(losses, uninterrupted[step:])) <= 1e-5
