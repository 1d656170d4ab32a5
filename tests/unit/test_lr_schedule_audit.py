"""An audit of the learning-rate schedule (step/schedule.py): a resume whose settings move the next step's rate
(a longer train.steps under a decay: lr_at is recomputed over the new length, so the rate jumps up at the
resumed step) says so, while a WSD run lengthened in its stable phase (the same rate) hears nothing; the
edges of the schedule over every shape and small step counts; the setup words docs/running.md quotes."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from longctx.config import load_config
from longctx.step.schedule import decay_start, lr_at, resume_note, schedule_state, schedule_words

LR = 3e-3


def _cfg(*overrides):
    return load_config(None, [f"--train.lr={LR}", *overrides])


def test_a_longer_cosine_run_is_told_its_rate_jumps_at_the_resume():
    """100 steps saved at step 50, resumed with 200: step 51 trains at 2.82e-3, not the 2.15e-3 the saved
    settings give (+31%), which only 'train.steps 100 -> 200' in the config's changes hinted at."""
    saved = schedule_state(_cfg("--train.steps=100"))
    longer = _cfg("--train.steps=200")
    assert lr_at(50, longer) / lr_at(50, _cfg("--train.steps=100")) - 1 == pytest.approx(0.31, abs=0.01)
    note = resume_note(json.loads(json.dumps(saved)), longer, 50)  # (as trainer_state.json keeps it)
    assert "step 51 trains at 0.00282" in note and "give 0.00215 (+31%; train.steps 100 -> 200)" in note


def test_a_run_resumed_inside_its_wsd_decay_with_more_steps_is_told_it_goes_back_to_the_peak():
    saved = schedule_state(_cfg("--train.steps=100", "--train.lr_decay_fraction=0.2"))
    note = resume_note(saved, _cfg("--train.steps=120", "--train.lr_decay_fraction=0.2"), 90)
    assert "step 91 trains at 0.003, where the checkpoint's settings give 0.00144 (+109%" in note


@pytest.mark.parametrize("step", [0, 10, 50])
def test_a_wsd_run_lengthened_in_its_stable_phase_or_an_unchanged_one_hears_nothing(step):
    short = ["--train.lr_schedule=1-sqrt", "--train.lr_decay_fraction=0.25"]
    saved = schedule_state(_cfg("--train.steps=80", *short))
    assert resume_note(saved, _cfg("--train.steps=80", *short), step) is None
    assert resume_note(saved, _cfg("--train.steps=400", *short), step) is None
    assert resume_note(None, _cfg("--train.steps=400"), step) is None  # a checkpoint from before: no settings
    assert resume_note(saved, _cfg("--train.steps=80", *short), 80) is None  # nothing left to train


def test_a_finished_run_lengthened_is_told_its_rate_leaves_the_floor_and_a_floor_of_0_divides_nothing():
    saved = schedule_state(_cfg("--train.steps=30", "--train.min_lr_ratio=0"))
    note = resume_note(saved, _cfg("--train.steps=60", "--train.min_lr_ratio=0"), 30)
    assert "step 31 trains at" in note and "give 0 (from 0; train.steps 30 -> 60)" in note


BASE = ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=60",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--metrics.log_interval=1", "--train.warmup_steps=2", "--train.lr=1e-2"]


def test_a_resume_with_a_longer_cosine_says_so_and_trains_at_the_new_schedule(tmp_path):
    """The checkpoint keeps its run's settings; the resumed run logs the jump and each step's lr is lr_at's."""
    from longctx.train.trainer import train

    lines = []
    first = load_config(None, [*BASE, "--train.steps=8", "--checkpoint.interval=4", f"--train.run_dir={tmp_path}"])
    train(first, log=lambda *a, **k: None)
    step4 = tmp_path / "checkpoints" / "step-00000004"
    assert json.loads((step4 / "trainer_state.json").read_text())["schedule"]["steps"] == 8
    longer = load_config(None, [*BASE, "--train.steps=12", f"--train.run_dir={tmp_path}",
                                f"--checkpoint.resume={step4}", "--checkpoint.interval=0"])
    train(longer, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    said = [line for line in lines if "learning-rate schedule: step 5 trains at" in line]
    assert len(said) == 1 and "train.steps 8 -> 12" in said[0], lines
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if r.get("kind", "train") == "train" and r["step"] > 4}
    assert logged == {s: pytest.approx(lr_at(s - 1, longer), rel=1e-9) for s in range(5, 13)}


SHAPES = ("cosine", "linear", "1-sqrt")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [0.0, 0.1, 1.0])
def test_every_small_run_starts_above_0_ends_at_the_floor_and_never_rises_after_the_warmup(shape, ratio):
    """Steps 1-25, warmups 0-26, fractions down to 0.01: step 1 (lr_at(0)) is lr / warmup, never 0; the last
    step is the floor exactly wherever the warmup leaves a decay (warmup <= steps - 2); no rate above lr or,
    after the warmup, below the floor; no division by zero at a decay rounded to nothing."""
    base = _cfg(f"--train.lr_schedule={shape}", f"--train.min_lr_ratio={ratio}")
    for steps in range(1, 26):
        for warmup in range(0, 27):
            for fraction in (1.0, 0.5, 0.2, 0.05, 0.01):
                # (the keys lr_at reads replaced: load_config 10,000 times would take minutes)
                cfg = dataclasses.replace(base, train=dataclasses.replace(
                    base.train, steps=steps, warmup_steps=warmup, lr_decay_fraction=fraction))
                rates = [lr_at(s, cfg) for s in range(steps)]
                assert rates[0] == (LR / warmup if warmup > 1 else LR)
                if warmup <= steps - 2:
                    assert rates[-1] == LR * ratio
                    assert steps - 1 - decay_start(cfg) >= 1  # at least one update below the peak
                after = rates[min(warmup, steps):]
                assert all(LR * ratio <= r <= LR for r in after)
                assert all(a >= b for a, b in zip(after, after[1:]))


def test_1_sqrt_is_hagele_et_al_s_cooldown_to_the_floor():
    """Hägele et al. 2024: lr(t) = lr_max (1 - sqrt((t - t_decay) / (T - t_decay))) in the cooldown, here
    with T the last step (0-based steps - 1) and the floor added (min_lr_ratio 0: the paper's, to 0)."""
    cfg = _cfg("--train.steps=101", "--train.warmup_steps=0", "--train.lr_schedule=1-sqrt",
               "--train.lr_decay_fraction=0.2", "--train.min_lr_ratio=0")
    start, end = decay_start(cfg), 100
    assert start == 100 - 20
    for t in range(start, end + 1):
        assert lr_at(t, cfg) == pytest.approx(LR * (1 - math.sqrt((t - start) / (end - start))), abs=1e-15)


def test_the_setup_words_docs_running_md_quotes_are_the_code_s():
    """docs/running.md quoted `over the last 20% of steps (WSD: from step 240)`, words the code never wrote."""
    text = (Path(__file__).parents[2] / "docs" / "running.md").read_text()
    example = re.search(r"`(--train\.lr_schedule 1-sqrt --train\.lr_decay_fraction 0\.2)` over (\d+) steps", text)
    flags = example.group(1).split()
    cfg = _cfg(f"--train.steps={example.group(2)}", *(f"{k}={v}" for k, v in zip(flags[::2], flags[1::2])))
    assert f"`{schedule_words(cfg)}`" in " ".join(text.split())


def test_the_host_optimizer_steps_with_the_schedule_s_rate():
    """memory.model_states = host_optimizer keeps its own AdamW per unit: the trainer's rate reaches them."""
    import torch

    from longctx.step.host_optimizer import HostOptimizer

    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    opt = HostOptimizer([{"params": params, "weight_decay": 0.0}], [(model, params)], lr=1.0)
    for lr in (0.5, 0.25):
        for group in opt.param_groups:
            group["lr"] = lr
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.finish_update()
        assert [g["lr"] for inner, _ in opt._inner if inner is not None for g in inner.param_groups] == [lr]
