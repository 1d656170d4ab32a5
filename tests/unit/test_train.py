"""The training loop on a small slice of the embedded corpus."""

import math

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError, TrainingError
from longctx.models.flops import train_flops_per_token
from longctx.step.schedule import lr_at, schedule_note
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import train


def cfg_for(tmp_path, *extra):
    return load_config(overrides=[
        f"--train.run_dir={tmp_path}", "--train.steps=12", "--train.seq_len=64", "--train.global_batch=4",
        "--train.warmup_steps=3", "--train.eval_interval=6", "--train.eval_batches=2", "--data.max_docs=120",
        "--data.eval_fraction=0.1", "--metrics.log_interval=4", "--metrics.progress=false", "--metrics.plots=false",
        "--model.layers=2", *extra,
    ])


def quiet(*_):
    pass


def test_loss_falls_and_run_dir_is_complete(tmp_path):
    res = train(cfg_for(tmp_path, "--train.steps=40", "--metrics.plots=true"), log=quiet)
    assert res.losses[-1] < res.losses[0] - 1.0
    assert set(res.eval_losses) == {6, 12, 18, 24, 30, 36, 40}
    records = read_jsonl(tmp_path / "metrics.jsonl")
    train_recs = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == [1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    for key in ("step", "loss", "tokens_per_s", "mfu", "grad_norm", "tflops", "memory_gib"):
        assert key in train_recs[0]
    assert 0 < train_recs[-1]["mfu"] < 1
    assert (tmp_path / "config.toml").is_file()
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "throughput.png").is_file()
    assert load_config(tmp_path / "config.toml").train.steps == 40


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    a = train(cfg_for(tmp_path / "a"), log=quiet).losses
    b = train(cfg_for(tmp_path / "b"), log=quiet).losses
    c = train(cfg_for(tmp_path / "c", "--train.seed=1"), log=quiet).losses
    assert a == b
    assert a != c


def test_gradient_accumulation_equals_the_large_batch(tmp_path):
    """global batch 4 as 1, 2 or 4 micro-batches (of 4, 2, 1 sequences), with uneven valid tokens per micro-batch."""
    runs = [train(cfg_for(tmp_path / f"r{accum}", "--train.global_batch=4", f"--train.grad_accum={accum}"),
                  log=quiet).losses for accum in (1, 2, 4)]
    for other in runs[1:]:
        assert max(abs(x - y) for x, y in zip(runs[0], other)) < 1e-5


def test_full_recompute_trains_identically(tmp_path):
    a = train(cfg_for(tmp_path / "a"), log=quiet).losses
    b = train(cfg_for(tmp_path / "b", "--memory.recompute=full"), log=quiet).losses
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6


def test_non_finite_loss_stops_naming_the_step(tmp_path, monkeypatch):
    import longctx.train.step_run as t  # (the step's forward: train/step_run.py)

    real = t.forward_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch, autocast_dtype):
        calls["n"] += 1
        out = real(model, batch, autocast_dtype)
        return out * float("nan") if calls["n"] == 5 else out

    monkeypatch.setattr(t, "forward_loss_sum", poisoned)
    with pytest.raises(TrainingError, match="at step 5"):  # (the default, skip: tests/unit/test_nonfinite.py)
        train(cfg_for(tmp_path, "--train.on_nonfinite=stop"), log=quiet)


def test_impossible_settings_are_refused_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="needs memory.recompute = selective"):
        train(cfg_for(tmp_path, "--memory.offload_fraction=0.5"), log=quiet)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        train(cfg_for(tmp_path, "--model.vocab_size=100"), log=quiet)


def test_lr_schedule_warmup_then_cosine_to_floor():
    # 101 steps (0-based 0..100): warmup 0..9, then the cosine over steps 10..100, halfway at 55
    cfg = load_config(overrides=["--train.steps=101", "--train.warmup_steps=10", "--train.lr=1.0",
                                 "--train.min_lr_ratio=0.1"])
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("steps, warmup", [(10, 0), (100, 10), (4, 2), (2, 0)])
def test_the_last_step_trains_at_the_floor(steps, warmup):
    """lr_at's contract: lr * min_lr_ratio at the last step (0-based steps - 1, what the trainer's step
    `steps` asks for), exactly; the first step after the warmup at the peak."""
    cfg = load_config(overrides=[f"--train.steps={steps}", f"--train.warmup_steps={warmup}", "--train.lr=1.0",
                                 "--train.min_lr_ratio=0.1"])
    assert lr_at(steps - 1, cfg) == 1.0 * 0.1
    assert lr_at(warmup, cfg) == 1.0
    rates = [lr_at(s, cfg) for s in range(warmup, steps)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)  # decays every step


@pytest.mark.parametrize("steps, warmup, said", [(10, 20, "rises for the whole run"), (21, 20, "at the last step"),
                                                 (22, 20, None), (4, 2, None), (1, 20, None)])
def test_a_warmup_that_leaves_no_decay_is_said(steps, warmup, said):
    """The schedule's note when the run ends at or below its peak (the last step's rate is not the floor)."""
    cfg = load_config(overrides=[f"--train.steps={steps}", f"--train.warmup_steps={warmup}", "--train.lr=1.0",
                                 "--train.min_lr_ratio=0.1"])
    note = schedule_note(cfg)
    last = lr_at(steps - 1, cfg)
    assert (note is None) == (said is None) == (steps == 1 or last == 0.1), (note, last)
    assert said is None or said in note and "--train.warmup_steps below" in note


def test_a_two_step_run_is_told_a_warmup_it_can_take():
    """Two steps have no room for a warmup and a decay: "below 1" (0) was said as "a warmup and a decay"."""
    note = schedule_note(load_config(overrides=["--train.steps=2"]))
    assert "set --train.warmup_steps 0 for a decay" in note and "below" not in note


def test_flops_formula_matches_a_hand_count():
    cfg = load_config(overrides=["--model.preset=llama3-8b"]).model
    s = 8192
    matmul = 32 * (4096 * (32 + 16) * 128 + 4096 * 4096 + 3 * 4096 * 14336)
    expected = 3 * (2 * matmul + 32 * 4 * s * 4096 / 2 + 2 * 4096 * 128256)
    assert train_flops_per_token(cfg, s) == pytest.approx(expected)
    assert math.isclose(train_flops_per_token(cfg, s, causal=False) - train_flops_per_token(cfg, s),
                        3 * 32 * 2 * s * 4096)
