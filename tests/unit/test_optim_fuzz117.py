"""Randomized audit of the optimizer step as a whole against an independent float64 reference
(tests/optim_fuzz117_reference.py: the schedule, the loss weighting, clipping and AdamW written from the docs'
words and the papers).

Each seeded case draws every train.* key the update reads (steps 1-7; warmup 0, steps - 1, steps, past it or
random; every lr_schedule; lr_decay_fraction 1, 0.01 or random; min_lr_ratio 0, 1 or random; weight_decay 0 or up
to 0.3; beta1 (0 too), beta2, eps up to 1e-3; grad_clip 0, large, or 0.1% above or below the first step's norm;
grad_accum 1-3; loss_weighting token or sequence), a model with or without biases and tied embeddings, the tier of
the states (memory.model_states device: the foreach AdamW; host: the fused CPU AdamW over a one-rank FSDP;
host_optimizer: step/host_optimizer.py's host AdamW), memory.grad_sync, and in one case of four a non-finite step
(LONGCTX_FAULT), and trains a tiny model by longctx's Trainer in this process (tests/optim_fuzz117_runs.py records
each step). Each step then:

- the logged lr and the optimizer's rate are the reference schedule's (rel 1e-9);
- the summed raw gradients equal the float64 reference's at the step's weights (1e-5 x (1 + its largest)), the
  logged loss its loss (2e-6) and the logged norm the norm of the recorded gradients (1e-5);
- the reference AdamW, fed those recorded gradients (its own clip) and carrying its own float64 weights, moments and
  count from step 1, gives the weights (1e-6 x (1 + the largest)), both moments (1e-4 of each tensor's largest) and
  the step count (exact) the trainer has after the update: each parameter decayed by the docs' rule (matrices, a
  tied embedding once; no norm, no bias), every step, under every tier; a non-finite step changes nothing (its
  rate still logged as the schedule's, the count not advanced).

Resume cases stop a run at a random checkpoint (a skipped step before it in one of three) and resume it with
changed train.steps, lr, lr_schedule, lr_decay_fraction, warmup_steps, min_lr_ratio, AdamW hyper-parameters,
grad_accum, global_batch, loss_weighting and tier: the reference goes on from its state at the checkpoint (t
continues) with the new settings, its schedule recomputed over them from step 1 (step/schedule.py's resume_note
semantics), and the resumed run must match it step by step, and say the note exactly when the reference's rate of the
resumed step differs from the saved settings', quoting both rates.

Over 104 fresh and 72 resume seeds beyond these the audit passed; nine deliberate breaks of a scratch src (the
warmup one step off, decay on norms and biases, clipping before the accumulation's 1 / labels, AdamW's count one
ahead after a load, the tied embedding listed twice, the resume note against the step before, sequence weighting
over labels, the WSD decay one step late, eps not passed) each fail some of these cases.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from optim_fuzz117_reference import (
    ReferenceAdamW,
    clipped,
    decays,
    expected_note,
    float64_model,
    global_norm,
    reference_gradients,
    reference_lr,
)
from optim_fuzz117_runs import case_flags, train_recorded

SCHEDULE = ("lr", "steps", "warmup_steps", "lr_schedule", "lr_decay_fraction", "min_lr_ratio")


def draw_case(seed: int) -> dict:
    """Every optimizer and schedule key drawn, edges often."""
    rng = random.Random(seed)
    steps = rng.choice([1, 2, 3, 4, 5, 7])
    accum = rng.choice([1, 1, 2, 3])
    case = {"seed": seed, "steps": steps, "grad_accum": accum, "global_batch": accum * rng.choice([1, 2]),
            "lr": round(10 ** rng.uniform(-3, -1.5), 6),
            "warmup_steps": rng.choice([0, 0, steps - 1, steps, steps + 1, rng.randint(0, steps)]),
            "lr_schedule": rng.choice(["cosine", "linear", "1-sqrt", "constant"]),
            "lr_decay_fraction": rng.choice([1.0, 0.01, round(rng.uniform(0.05, 1.0), 3)]),
            "min_lr_ratio": rng.choice([0.0, 1.0, round(rng.uniform(0, 1), 3)]),
            "weight_decay": rng.choice([0.0, round(rng.uniform(0.01, 0.3), 3)]),
            "beta1": rng.choice([0.9, 0.0, round(rng.uniform(0.5, 0.95), 3)]),
            "beta2": rng.choice([0.95, 0.999, round(rng.uniform(0.8, 0.99), 3)]),
            "eps": rng.choice([1e-8, 1e-6, 1e-3]),
            "clip": rng.choice(["off", "large", "above", "below"]),
            "loss_weighting": rng.choice(["token", "sequence"]),
            "tied": rng.random() < 0.5, "bias": rng.random() < 0.5,
            "states": rng.choice(["device", "host_optimizer", "host"])}
    case["warmup_steps"] = max(0, case["warmup_steps"])
    case["fault"] = rng.choice([None, None, None, rng.randint(1, steps)])  # a non-finite step, not applied
    case["grad_sync"] = rng.choice(["step", "micro_batch"])
    return case


def _settings(cfg) -> SimpleNamespace:
    return SimpleNamespace(**{k: getattr(cfg.train, k) for k in SCHEDULE})


def _hyper(cfg) -> dict:
    t = cfg.train
    return {"wd": t.weight_decay, "b1": t.beta1, "b2": t.beta2, "eps": t.eps}


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    err = float((actual - expected).abs().max()) if actual.numel() else 0.0
    assert err <= atol, f"{what}: off by {err:.3g} (allowed {atol:.3g})"


def check_groups(run) -> None:
    """Every trained parameter in exactly one group, with decay exactly where the docs say."""
    names = [n for _, members in run.groups for n in members]
    assert sorted(names) == sorted(run.steps[min(run.steps)].before) and len(set(names)) == len(names)
    for wd, members in run.groups:
        for n in members:
            assert wd == (run.cfg.train.weight_decay if decays(n) else 0.0), f"{n}: weight decay {wd}"


def check_step(run, s: int, ref: ReferenceAdamW, model, where: str) -> None:
    """Step s of `run` against the reference, which it then advances."""
    rec, t, log = run.steps[s], run.cfg.train, run.logged[s]
    lr = reference_lr(s, _settings(run.cfg))
    assert log["lr"] == pytest.approx(lr, rel=1e-9, abs=1e-300), f"{where} step {s}: logged lr"
    assert rec.lr == pytest.approx(lr, rel=1e-9, abs=1e-300), f"{where} step {s}: the optimizer's lr"
    for n, w in ref.w.items():  # the run's weights are the reference's going into the step
        _close(rec.before[n], w, 1e-6 * (1 + float(w.abs().max())), f"{where} step {s} {n} before")
    if s == run.fault:  # a non-finite step: no update, no AdamW step counted, the rate still the schedule's
        assert log["loss"] is None and not rec.applied, f"{where} step {s}: the fault's step was applied"
    else:
        loss, grads = reference_gradients(model, rec.before, rec.micros, t.loss_weighting)
        assert log["loss"] == pytest.approx(loss, rel=2e-6), f"{where} step {s}: loss"
        for n, g in grads.items():
            _close(rec.grads[n], g, 1e-5 * (1 + float(g.abs().max())), f"{where} step {s} {n} gradient")
        assert log["grad_norm"] == pytest.approx(global_norm(rec.grads), rel=1e-5), f"{where} step {s}: norm"
        ref.step(clipped(rec.grads, t.grad_clip), lr, **_hyper(run.cfg))
    for n, w in ref.w.items():
        _close(rec.after[n], w, 1e-6 * (1 + float(w.abs().max())), f"{where} step {s} {n} after")
        if n not in rec.state:  # (no AdamW state yet: only before any update)
            assert ref.t == 0, f"{where} step {s} {n}: no AdamW state after {ref.t} updates"
            continue
        m, v, count = rec.state[n]
        _close(m, ref.m[n], 1e-4 * float(ref.m[n].abs().max()) + 1e-12, f"{where} step {s} {n} exp_avg")
        _close(v, ref.v[n], 1e-4 * float(ref.v[n].abs().max()) + 1e-18, f"{where} step {s} {n} exp_avg_sq")
        assert count == ref.t, f"{where} step {s} {n}: AdamW's step count {count}, the reference's {ref.t}"


def check_run(run, ref: ReferenceAdamW | None = None, where: str = "run") -> ReferenceAdamW:
    """Every step of `run` against the reference (a fresh one from the first step's weights, or `ref`)."""
    check_groups(run)
    first = min(run.steps)
    ref = ref or ReferenceAdamW(run.steps[first].before)
    model = float64_model(run.cfg)
    for s in sorted(run.steps):
        check_step(run, s, ref, model, where)
    return ref


def _with_clip(case: dict, tmp_path) -> dict:
    """The case's grad_clip: 0, 1e3, or 0.1% above or below its first step's gradient norm (one step run
    unclipped to read it)."""
    if case["clip"] in ("off", "large"):
        return {**case, "grad_clip": 0.0 if case["clip"] == "off" else 1e3}
    probe = train_recorded(tmp_path / "probe", case_flags({**case, "steps": 1, "grad_clip": 0.0}))
    norm = global_norm(probe.steps[1].grads)
    return {**case, "grad_clip": norm * (1.001 if case["clip"] == "above" else 0.999)}


SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_step_is_the_reference_s(seed, tmp_path):
    case = _with_clip(draw_case(seed), tmp_path)
    run = train_recorded(tmp_path / "run", case_flags(case), case["fault"])
    assert sorted(run.steps) == list(range(1, case["steps"] + 1))
    check_run(run, where=f"case {case}")
    if case["clip"] in ("above", "below") and case["fault"] != 1:  # the first step on the intended side of the clip
        clipped_first = global_norm(run.steps[1].grads) > case["grad_clip"]
        assert clipped_first == (case["clip"] == "below")


def draw_resume(seed: int) -> tuple[dict, int, dict]:
    """A first run, the checkpoint step it is resumed from, and the changed settings of the resumed run."""
    rng = random.Random(1000 + seed)
    first = {**draw_case(1000 + seed), "steps": rng.randint(3, 6), "clip": "large"}
    first["warmup_steps"] = min(first["warmup_steps"], first["steps"] + 1)
    stop = rng.randint(1, first["steps"] - 1)
    first["fault"] = rng.choice([None, None, rng.randint(1, stop)])  # (a skipped update before the checkpoint)
    changed = {k: first[k] for k in ("lr", "warmup_steps", "lr_schedule", "lr_decay_fraction", "min_lr_ratio")}
    for key, values in (("steps", [stop + 1, first["steps"], first["steps"] + rng.randint(1, 4)]),
                        ("lr", [first["lr"], round(first["lr"] * rng.uniform(0.3, 3), 6)]),
                        ("warmup_steps", [first["warmup_steps"], 0, stop, stop + 2]),
                        ("lr_schedule", ["cosine", "linear", "1-sqrt", "constant"]),
                        ("lr_decay_fraction", [first["lr_decay_fraction"], 1.0, 0.01, 0.3]),
                        ("min_lr_ratio", [first["min_lr_ratio"], 0.0, 1.0, 0.2]),
                        ("weight_decay", [first["weight_decay"], 0.0, 0.2]),
                        ("beta1", [first["beta1"], 0.8]), ("beta2", [first["beta2"], 0.99]),
                        ("eps", [first["eps"], 1e-6]), ("states", ["device", "host_optimizer", "host"]),
                        ("grad_accum", [first["grad_accum"], 1, 2]), ("loss_weighting", ["token", "sequence"])):
        changed[key] = rng.choice(values)
    changed["global_batch"] = changed["grad_accum"] * rng.choice([1, 2])
    return first, stop, changed


RESUME_SEEDS = range(8)


@pytest.mark.parametrize("seed", RESUME_SEEDS)
def test_a_resume_with_changed_settings_goes_on_as_the_reference_recomputed_from_step_1(seed, tmp_path):
    first, stop, changed = draw_resume(seed)
    first = {**first, "grad_clip": 1e3}
    saves = [f"--checkpoint.interval={stop}", "--checkpoint.keep=100"]
    run1 = train_recorded(tmp_path / "run", [*case_flags(first), *saves], first["fault"])
    ref = ReferenceAdamW(run1.steps[1].before)
    model = float64_model(run1.cfg)
    for s in range(1, stop + 1):
        check_step(run1, s, ref, model, f"first run {first}")
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{stop:08d}"
    resumed = {**first, **changed}
    fault = random.Random(seed).choice([None, None, resumed["steps"]])  # (and one after the resume)
    run2 = train_recorded(tmp_path / "run", [*case_flags(resumed), f"--checkpoint.resume={checkpoint}",
                                             "--checkpoint.interval=0"], fault)
    assert sorted(run2.steps) == list(range(stop + 1, resumed["steps"] + 1))
    check_run(run2, ref, where=f"resumed at {stop} with {changed} from {first}")
    _check_note(run2.lines, _settings(run1.cfg), _settings(run2.cfg), stop)


def _check_note(lines: list[str], saved, now, stop: int) -> None:
    said = [line for line in lines if "learning-rate schedule:" in line]
    due = expected_note(saved, now, stop)
    if due is None:
        assert not said, f"a note where the rate is the same: {said}"
        return
    new, was = due
    assert len(said) == 1, f"no note where the rate moves {was:.3g} -> {new:.3g}: {lines}"
    moved = f"{new / was - 1:+.0%}" if was else "from 0"
    assert (f"step {stop + 1} trains at {new:.3g}, where the checkpoint's settings give {was:.3g} ({moved};"
            in said[0]), said[0]
    assert "recomputed over this run's settings from step 1" in said[0]


def test_the_reference_schedule_is_the_docs_worked_examples():
    """The reference itself against docs/running.md's figures: 1-sqrt over the last 60 of 300 steps holds the
    peak to step 240; a cosine of 100 steps resumed at 50 with 200 trains step 51 at 2.82e-3, not 2.15e-3."""
    wsd = SimpleNamespace(lr=1.0, steps=300, warmup_steps=20, lr_schedule="1-sqrt", lr_decay_fraction=0.2,
                          min_lr_ratio=0.1)
    assert [reference_lr(s, wsd) for s in (20, 21, 240)] == [1.0, 1.0, 1.0] and reference_lr(241, wsd) < 1.0
    assert reference_lr(300, wsd) == pytest.approx(0.1, abs=1e-15) and reference_lr(1, wsd) == 1 / 20
    cosine = SimpleNamespace(lr=3e-3, steps=100, warmup_steps=20, lr_schedule="cosine", lr_decay_fraction=1.0,
                             min_lr_ratio=0.1)
    longer = SimpleNamespace(**{**vars(cosine), "steps": 200})
    assert f"{reference_lr(51, cosine):.3g} {reference_lr(51, longer):.3g}" == "0.00215 0.00282"
    assert math.isclose(reference_lr(100, cosine), 3e-4)


MODELS = {"llama, tied": ["--model.tie_embeddings=true"],
          "qwen3 (q/k norms), biases": ["--model.family=qwen3", "--model.qk_norm=true", "--model.qkv_bias=true",
                                  "--model.out_bias=true"],
          "moe, shared gated experts, sigmoid router": ["--model.preset=debug-moe", "--model.moe.shared_experts=1",
                                                        "--model.moe.shared_gate=true", "--model.moe.router=sigmoid"]}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("states", ["device", "host_optimizer"])
def test_weight_decay_falls_on_matrices_only_in_every_family(model, states):
    """train.weight_decay's help: "on matrices only (embeddings, projections, routers, experts): not on norms or
    biases": each parameter once, in the group the docs' rule puts it in (names, not shapes, decide here)."""
    from longctx.config import load_config
    from longctx.models.llama import build_model
    from longctx.step.optimizer import make_optimizer

    cfg = load_config(None, ["--model.dim=16", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=32",
                             "--train.weight_decay=0.25", f"--memory.model_states={states}", *MODELS[model]])
    net = build_model(cfg.model, "cpu")
    names = {id(p): n for n, p in net.named_parameters()}
    groups = [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in make_optimizer(net, cfg).param_groups]
    listed = [n for _, members in groups for n in members]
    assert sorted(listed) == sorted(names.values()) and len(set(listed)) == len(listed)
    assert {n: wd for wd, members in groups for n in members} == {n: 0.25 if decays(n) else 0.0 for n in listed}
    assert any("router" in n for n in listed) or "moe" not in model
