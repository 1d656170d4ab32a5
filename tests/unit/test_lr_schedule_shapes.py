"""train.lr_schedule (cosine, linear, 1-sqrt, constant) and train.lr_decay_fraction (warmup-stable-decay)
in step/schedule.py lr_at, against closed forms written here; the default is the cosine over the whole run
that lr_at computed before the options existed, bit for bit; the optimizer steps with them; and a WSD run
lengthened from a stable-phase checkpoint trains as the longer run would have from the start."""

import json
import math

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.step.schedule import decay_start, lr_at, schedule_note, schedule_words

LR, FLOOR_RATIO = 3e-3, 0.1


def _cfg(*overrides):
    return load_config(None, [f"--train.lr={LR}", f"--train.min_lr_ratio={FLOOR_RATIO}", *overrides])


def _cosine_before(step, steps, warmup):
    """lr_at as it was before train.lr_schedule (2026-12-01): warmup, then cosine from the warmup's end."""
    if warmup and step < warmup:
        return LR * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - 1))
    floor = LR * FLOOR_RATIO
    return floor + 0.5 * (LR - floor) * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("steps,warmup", [(300, 20), (10, 0), (7, 3), (2, 0), (5, 20)])
def test_the_default_is_the_cosine_over_the_whole_run_bit_for_bit(steps, warmup):
    cfg = _cfg(f"--train.steps={steps}", f"--train.warmup_steps={warmup}")
    assert [lr_at(s, cfg) for s in range(steps)] == [_cosine_before(s, steps, warmup) for s in range(steps)]
    assert schedule_words(cfg) == ""


SHAPES = {"cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)), "linear": lambda p: 1 - p,
          "1-sqrt": lambda p: 1 - p ** 0.5}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fraction,start", [(1.0, 20), (0.2, 239), (0.5, 149), (0.01, 296)])
def test_each_shape_holds_then_decays_to_the_floor_at_the_last_step(shape, fraction, start):
    """300 steps, warmup 20: the decay starts at 0-based step 299 - round(fraction x 300) (the warmup's end at
    most), at lr, and reaches the floor exactly at step 299; between, lr x the shape of the progress."""
    cfg = _cfg("--train.steps=300", "--train.warmup_steps=20", f"--train.lr_schedule={shape}",
               f"--train.lr_decay_fraction={fraction}")
    assert decay_start(cfg) == start
    floor = LR * FLOOR_RATIO
    rates = [lr_at(s, cfg) for s in range(300)]
    assert rates[:20] == pytest.approx([LR * (s + 1) / 20 for s in range(20)], rel=1e-12)
    assert all(r == LR for r in rates[20:start + 1])  # the stable phase: train.lr itself
    assert rates[299] == pytest.approx(floor, rel=1e-12)
    for s in range(start, 300):
        want = floor + (LR - floor) * SHAPES[shape]((s - start) / (299 - start))
        assert rates[s] == pytest.approx(want, rel=1e-12)
    assert all(a >= b for a, b in zip(rates[20:], rates[21:]))
    assert schedule_note(cfg) is None
    if fraction < 1:
        assert schedule_words(cfg) == (f"schedule {shape} over the last {299 - start} steps (WSD: train.lr held to "
                                       f"step {start + 1})")


@pytest.mark.parametrize("fraction,length", [(0.25, 3), (0.35, 4), (0.15, 2), (0.05, 1), (0.01, 1)])
def test_the_decay_length_rounds_halves_up_and_is_at_least_one_update(fraction, length):
    """round(fraction x steps) with halves up (Python's round takes 2.5 to 2, and 0.15 x 10 is 1.4999...)."""
    cfg = _cfg("--train.steps=10", "--train.warmup_steps=0", f"--train.lr_decay_fraction={fraction}")
    assert 9 - decay_start(cfg) == length


def test_a_fraction_the_warmup_overlaps_is_said_to_leave_no_stable_phase():
    cfg = _cfg("--train.steps=10", "--train.warmup_steps=3", "--train.lr_decay_fraction=0.9")
    assert decay_start(cfg) == 3 and "leaves no stable phase" in schedule_words(cfg)


def test_constant_holds_the_peak_after_the_warmup():
    cfg = _cfg("--train.steps=50", "--train.warmup_steps=5", "--train.lr_schedule=constant")
    assert [lr_at(s, cfg) for s in range(50)] == [LR * (s + 1) / 5 for s in range(5)] + [LR] * 45
    assert schedule_words(cfg) == "schedule constant"
    # constant misses no decay, only the peak: a warmup as long as the run never reaches train.lr (the default
    # warmup of 20 in a 10-step run), one step shorter reaches it at the last step
    note = schedule_note(_cfg("--train.steps=10", "--train.lr_schedule=constant"))
    assert "never reaches train.lr" in note and "below 10" in note
    assert schedule_note(_cfg("--train.steps=10", "--train.warmup_steps=9", "--train.lr_schedule=constant")) is None
    assert "never decays to the floor" in schedule_note(_cfg("--train.steps=10", "--train.lr_schedule=linear"))


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_a_decay_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ConfigError, match=r"train.lr_decay_fraction must be in \(0, 1\]"):
        _cfg(f"--train.lr_decay_fraction={fraction}")


def test_an_unknown_shape_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="1-sqrt"):
        _cfg("--train.lr_schedule=exponential")


def test_the_decay_settings_under_constant_are_a_setup_note():
    from longctx.config.inert_options import inert_option_notes

    notes = inert_option_notes(_cfg("--train.lr_schedule=constant", "--train.lr_decay_fraction=0.2"))
    assert any("train.lr_decay_fraction = 0.2 is ignored: train.lr_schedule = constant" in n for n in notes)
    assert not any("lr_decay_fraction" in n for n in inert_option_notes(_cfg("--train.lr_decay_fraction=0.2")))


BASE = ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=60",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--metrics.log_interval=1", "--train.warmup_steps=2", "--train.lr=1e-2"]


def _run(run_dir, *overrides):
    from longctx.train.trainer import train

    cfg = load_config(None, [*BASE, f"--train.run_dir={run_dir}", *overrides])
    result = train(cfg, log=lambda *a, **k: None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, result.losses, {r["step"]: r["lr"] for r in records if r.get("kind", "train") == "train"}


def test_the_optimizer_steps_with_the_schedule_and_a_lengthened_wsd_run_trains_as_the_longer_one(tmp_path):
    """A WSD run of 12 steps (decay over the last 3) saved at step 6, in its stable phase, resumed with
    train.steps 20 and a decay over the last 3 of those: its steps 7-20 are, bit for bit, those of a
    20-step run configured so from the start (the stable phase does not depend on the run's length);
    each step's logged lr is lr_at's."""
    short = ["--train.steps=12", "--train.lr_schedule=1-sqrt", "--train.lr_decay_fraction=0.25",
             "--checkpoint.interval=6"]
    long = ["--train.steps=20", "--train.lr_schedule=1-sqrt", "--train.lr_decay_fraction=0.15"]
    cfg, _, logged = _run(tmp_path / "short", *short)
    assert decay_start(cfg) == 8 and logged == {s: pytest.approx(lr_at(s - 1, cfg), rel=1e-6) for s in range(1, 13)}
    whole_cfg, whole, whole_lr = _run(tmp_path / "long", *long)
    assert decay_start(whole_cfg) == 16 and whole_lr[20] == pytest.approx(1e-2 * 0.1, rel=1e-6)
    _, resumed, _ = _run(tmp_path / "lengthened", *long,
                         f"--checkpoint.resume={tmp_path / 'short' / 'checkpoints' / 'step-00000006'}")
    assert len(resumed) == 14 and resumed == whole[6:]
