"""Review of 2026-12-01's commits.

A metrics line after a rollback (train.on_nonfinite = rollback): its interval starts at the rollback, as
the router figures' does (train/moe_hooks.py: the interval forgotten), so loss_mean and interval_steps are
those of the steps run since; the discarded window's losses, the bad step's among them, are in no mean. Once
a spike's loss (1000 x, faults.py) rejected by the rollback was averaged into the next line's loss_mean.

An --infllm-* size with --task ppl: the advice is to drop it, not to add --mode generate, which ppl refuses."""

import json
import math

import pytest
from test_rollback import _trainer


def _lines(trainer) -> dict[int, dict]:
    records = map(json.loads, (trainer.run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in records if r.get("kind") == "train"}


def test_a_spike_rolled_back_is_in_no_loss_mean(tmp_path, monkeypatch):
    extra = ["--train.steps=8", "--metrics.log_interval=1", "--train.spike_factor=3", "--train.spike_window=3"]
    trainer = _trainer(tmp_path, "spike", extra, monkeypatch, "spike@7")
    result = trainer.run()
    assert trainer.rollbacks == 1 and result.losses[6] > 100 * result.losses[5]  # step 7's spike, kept in losses
    line = _lines(trainer)[8]
    assert line["interval_steps"] == 1
    assert line["loss_mean"] == pytest.approx(result.losses[7]) and line["loss_mean"] < 10


def test_the_first_line_after_a_rollback_covers_the_steps_since(tmp_path, monkeypatch):
    """NaN at step 5, read at step 6's line (log interval 3): the line at 6 covers step 6 alone (not 4, the
    NaN 5 and 6); the next line its own 3 steps. Step 4, kept by the rollback to its checkpoint, has a line of its
    own, written at the rollback (leftovers110: it was in no line's interval)."""
    trainer = _trainer(tmp_path, "nan", ["--train.steps=9", "--metrics.log_interval=3"], monkeypatch, "nonfinite@5")
    result = trainer.run()
    assert trainer.rollbacks == 1 and math.isnan(result.losses[4])
    lines = _lines(trainer)
    assert [(s, r["interval_steps"]) for s, r in sorted(lines.items())] == [(1, 1), (3, 2), (4, 1), (6, 1), (9, 3)]
    assert lines[4]["loss_mean"] == pytest.approx(result.losses[3])
    assert lines[6]["loss_mean"] == pytest.approx(result.losses[5])
    assert lines[9]["loss_mean"] == pytest.approx(sum(result.losses[6:9]) / 3)


@pytest.mark.parametrize("task, advice", [("ppl", "does not use: drop it."),
                                          ("passkey", "add --mode generate --context-memory infllm, or drop it.")])
def test_an_infllm_size_without_the_memory_gives_advice_the_task_takes(tmp_path, task, advice):
    """(the flags are checked before the checkpoint is read: none is needed)"""
    from longctx.cli import build_parser
    from longctx.errors import ConfigError
    from longctx.eval.request import prepare

    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", str(tmp_path / "none"), "--task", task, "--lengths", "64", "--infllm-block", "32"])
    with pytest.raises(ConfigError) as e:
        prepare(args, rest, 1)
    assert advice in " ".join(str(e.value).split())
