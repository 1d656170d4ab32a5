"""Two attempts in one checkpoint directory: an explicit `--checkpoint.resume` of an older checkpoint leaves the
abandoned attempt's checkpoints there, newer than the one resumed or, with another interval, interleaved with
the new attempt's, and a rollback record of a step the new attempt saves again. Each checkpoint's manifest
names its parent (the checkpoint its run saved or loaded last before it), and keep, resume auto and rollbacks
follow that trajectory. Before, an audit found: keep counted the other attempt's interleaved checkpoint and
deleted this attempt's own, so a damaged newest one made resume auto fall back onto the other attempt's
weights; and a rollback record of the first attempt was applied to the second attempt's checkpoint of the
same step, skipping data it never skipped."""

import json
import shutil

from longctx.config import load_config
from longctx.config.checkpoint_paths import trajectory
from longctx.train.trainer import train

BASE = ["--model.layers=1", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=40", "--train.seq_len=64", "--train.global_batch=2", "--train.warmup_steps=2"]


def _run(args, run_dir, monkeypatch, fault=None):
    if fault:
        monkeypatch.setenv("LONGCTX_FAULT", fault)
    else:
        monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    return train(load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"]),
                 log=lambda *a, **k: None)


def _names(ck):
    return sorted(p.name for p in ck.glob("step-*"))


def test_keep_and_resume_auto_follow_this_attempts_checkpoints(tmp_path, monkeypatch):
    ck = tmp_path / "checkpoints"
    first = _run(["--train.steps=8", "--checkpoint.interval=2", "--checkpoint.keep=10", "--train.on_nonfinite=skip"],
                 tmp_path, monkeypatch, fault="nonfinite@3")
    # the second attempt: from step 2 again, no fault, saves every 3 steps and keeps 2
    args = ["--train.steps=6", "--checkpoint.interval=3", "--checkpoint.keep=2", "--train.on_nonfinite=skip"]
    second = _run([*args, f"--checkpoint.resume={ck / 'step-00000002'}"], tmp_path, monkeypatch)
    # its step-3 kept (the first attempt's step-4, between its two, is not counted, nor deleted)
    assert _names(ck) == ["step-00000003", "step-00000004", "step-00000006", "step-00000008"]
    assert [p.name for p in trajectory(ck, ck / "step-00000006")] == ["step-00000006", "step-00000003"]
    shard = sorted((ck / "step-00000006").glob("*.distcp"))[0]  # the newest damaged: back to step 3, not 4
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = _run([*args, "--checkpoint.resume=auto"], tmp_path, monkeypatch)
    assert resumed.first_step == 4 and resumed.losses == second.losses[1:]
    assert second.losses[1:] != first.losses[3:6]  # (the two attempts differ: the case this is about)


def test_a_rollback_record_is_of_the_checkpoint_rolled_back_to_not_of_its_step(tmp_path, monkeypatch):
    args = ["--train.steps=8", "--checkpoint.interval=2", "--checkpoint.keep=10", "--train.on_nonfinite=rollback"]
    ck = tmp_path / "a" / "checkpoints"
    _run(args, tmp_path / "a", monkeypatch, fault="nonfinite@5")  # rolls back to step 4 at step 5
    second = _run([*args, f"--checkpoint.resume={ck / 'step-00000002'}"], tmp_path / "a", monkeypatch)
    # interrupted after its own step-4: what resume auto finds
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for p in (tmp_path / "b" / "checkpoints").glob("step-*"):
        if int(p.name[5:]) > 4:
            shutil.rmtree(p)
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step-00000004\n")
    record = (tmp_path / "b" / "checkpoints" / "rollbacks.jsonl").read_text()
    records = [json.loads(line) for line in record.splitlines()]
    assert [r["rolled_back_to"] for r in records] == [4]  # (the first attempt's, of its own step-4)
    resumed = _run([*args, "--checkpoint.resume=auto"], tmp_path / "b", monkeypatch)
    assert resumed.first_step == 5 and resumed.losses == second.losses[2:]
