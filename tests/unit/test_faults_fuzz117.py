"""A randomized audit of how a training run survives bad steps and preemption (LONGCTX_FAULT nonfinite@k and
spike@k, train.on_nonfinite skip / rollback / stop, train.spike_factor, SIGTERM mid-step and resume), against a
reference written here from docs/running.md and docs/checkpoints.md, not from the trainer's code.

The reference (Ref) trains the same tiny model on the clean run's batch of each step (the data of a step is
the one an unfaulted run trains on there: skip goes on with the next batch, rollback "steps B+1.. see the data
they would have seen") with its own loop: the documented schedule (linear warmup, then the decay to
lr x min_lr_ratio at the last step, a function of the step number, so it goes on past a skipped step), the
step's loss over its global batch, clipping, AdamW whose step is simply not called for a bad step (parameters,
moments and step count untouched), and the spike check as documented: a loss over spike_factor x the median of
the last spike_window GOOD steps' losses, once that window is full. Losses are read every metrics.log_interval
steps, at step 1, at the last step and before every save; a bad step read under `stop` ends the run naming it,
under `rollback` reloads the newest checkpoint C < B (weights, AdamW, the spike window) and goes on at B + 1.
Each fault fires once (a step run again after a rollback is clean). Where the docs are silent the reference
takes what a demanding user would: the median of an even count is the mean of the middle two.
"""

import copy
import math
import os
import random
import signal
import statistics

import pytest
import torch

from longctx.config import load_config
from longctx.errors import Preempted, TrainingError
from longctx.step.loss import forward_loss_sum
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer


def _quiet(*_a, **_k):
    pass


class RefStop(Exception):
    """The reference run stops (train.on_nonfinite = stop, skip_limit, a rollback with nowhere to go): its text is
    what the run's error must say of the step."""


def draw_case(seed: int, policy: str) -> dict:
    """A small run and a fault schedule drawn from `seed`, with the schedule's corner cases favoured: the first
    step, the last, a warmup step, consecutive bad steps, the step right after a checkpoint (a rollback target)."""
    rng = random.Random(seed)
    steps = rng.randint(4, 12)
    save_every = rng.randint(1, 4)
    case = {"steps": steps, "accum": rng.randint(1, 3), "rows": rng.randint(1, 2), "save_every": save_every,
            "log_every": rng.choice([1, 1, 2, 3]), "warmup": rng.randint(0, min(3, steps - 2)),
            "schedule": rng.choice(["cosine", "linear", "1-sqrt", "constant"]), "seed": rng.randint(0, 3),
            "factor": rng.choice([0.0, 3.0, 3.0, 2.0]), "window": rng.randint(2, 3), "policy": policy,
            "skip_limit": rng.choice([0, 2, 3, 10])}
    corners = [1, steps, max(1, case["warmup"]), save_every + 1, save_every * 2 + 1]
    faults: dict[int, str] = {}
    for _ in range(rng.randint(1, 3)):
        at = min(steps, rng.choice(corners) if rng.random() < 0.6 else rng.randint(1, steps))
        kind = "spike" if case["factor"] and rng.random() < 0.5 else "nonfinite"
        faults[at] = kind
        if rng.random() < 0.3 and at < steps:  # consecutive bad steps
            faults[at + 1] = rng.choice(["nonfinite", "spike"] if case["factor"] else ["nonfinite"])
    case["faults"] = dict(sorted(faults.items()))
    return case


def fault_env(faults: dict) -> str:
    return ",".join(f"{kind}@{at}" for at, kind in sorted(faults.items()))


def case_args(case: dict, run_dir, extra=()) -> list[str]:
    return ["--train.seq_len=32", f"--train.global_batch={case['accum'] * case['rows']}",
            f"--train.grad_accum={case['accum']}", f"--train.steps={case['steps']}", "--data.max_docs=20",
            "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
            "--model.layers=1", "--model.dim=64", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=128",
            f"--train.seed={case['seed']}", f"--train.warmup_steps={case['warmup']}",
            f"--train.lr_schedule={case['schedule']}", f"--checkpoint.interval={case['save_every']}",
            f"--metrics.log_interval={case['log_every']}", f"--train.on_nonfinite={case['policy']}",
            f"--train.spike_factor={case['factor']}", f"--train.spike_window={case['window']}",
            f"--train.skip_limit={case.get('skip_limit', 10)}", "--train.lr=0.01", "--train.grad_clip=1.0",
            f"--train.run_dir={run_dir}", *extra]


def documented_lr(i: int, case: dict, lr: float = 0.01, floor_ratio: float = 0.1) -> float:
    """docs: linear warmup to train.lr, then the decay's shape down to lr x min_lr_ratio at the last step
    (0-based step i; the decay spans the steps after the warmup: lr_decay_fraction 1)."""
    warm, steps = case["warmup"], case["steps"]
    if warm and i < warm:
        return lr * (i + 1) / warm
    if case["schedule"] == "constant":
        return lr
    progress = min(1.0, max(0.0, (i - warm) / max(1, steps - 1 - warm)))
    shape = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress,
             "1-sqrt": 1 - math.sqrt(progress)}[case["schedule"]]
    floor = lr * floor_ratio
    return floor + (lr - floor) * shape


class Ref:
    """The documented run, trained here (see the module's docstring)."""

    def __init__(self, case: dict, run_dir):
        self.case = case
        os.environ.pop("LONGCTX_FAULT", None)
        plain = ["--checkpoint.final=false", "--train.on_nonfinite=skip", "--checkpoint.interval=0"]
        base = Trainer(load_config(None, case_args(case, run_dir, plain)), log=_quiet)
        self.model, self.opt = base.model, base.optimizer
        self.batches = {s: base.sampler.step_batches(s) for s in range(1, case["steps"] + 1)}
        base.sampler.close(), base.run_lock.release()
        self.pending = dict(case["faults"])  # each fires once
        self.good: list[float] = []  # the spike check's window: the last good steps' losses
        self.losses: dict[int, float] = {}
        self.snapshots: dict[int, tuple] = {}
        self.skipped = self.rollbacks = 0
        self.repeats: list = [None, 0]
        self.stopped: str | None = None
        # each metrics line's (step, loss, skipped_steps, rollbacks, loss_mean, interval_steps), as documented
        self.lines: list[tuple] = []
        self.covered, self.interval, self.skipped_at, self.streak = 0, [], set(), 0

    def line(self, s: int, upto: int | None = None) -> None:
        """A metrics line of step `s` over the interval's steps (through `upto`): loss_mean leaves out a skipped
        step's and a non-finite loss."""
        steps = [x for x in self.interval if upto is None or x <= upto]
        kept = [self.losses[x] for x in steps if math.isfinite(self.losses[x]) and x not in self.skipped_at]
        mean = sum(kept) / len(kept) if kept else None
        self.lines.append((s, self.losses[s], self.skipped, self.rollbacks, mean, len(steps)))
        self.covered, self.interval = s, []

    def spike(self, loss: float) -> bool:
        c = self.case
        return bool(c["factor"]) and len(self.good) >= c["window"] and loss > c["factor"] * statistics.median(
            self.good[-c["window"]:])

    def step(self, s: int) -> tuple[float, bool]:
        lr = documented_lr(s - 1, self.case)
        for group in self.opt.param_groups:
            group["lr"] = lr
        shares = self.batches[s]
        valid = sum(v for _, v in shares)
        kind = self.pending.pop(s, None)
        total = torch.zeros((), dtype=torch.float64)
        for batch, _ in shares:
            part = forward_loss_sum(self.model, batch, None)
            if kind == "nonfinite":
                part = part * float("nan")
            elif kind == "spike":
                part = part * 1000.0
            (part * (1.0 / valid)).backward()
            total += part.detach()
        loss = float(total / valid)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))
        good = math.isfinite(loss) and math.isfinite(norm) and not self.spike(loss)
        if good:
            self.opt.step()
            self.good.append(loss)
        self.opt.zero_grad(set_to_none=True)
        return loss, good

    def snapshot(self, s: int) -> None:
        self.snapshots[s] = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()),
                             list(self.good))

    def roll_back(self, bad: int) -> None:
        before = [c for c in self.snapshots if c < bad]
        if not before:
            raise RefStop(f"at step {bad}, and train.on_nonfinite = rollback, but no checkpoint")
        back = max(before)
        self.repeats = [back, self.repeats[1] + 1] if self.repeats[0] == back else [back, 1]
        if self.repeats[1] > 3:  # the fourth rollback in a row to one checkpoint stops the run (docs)
            raise RefStop(f"at step {bad}, and train.on_nonfinite = rollback, but the run already rolled back")
        weights, opt, good = self.snapshots[back]
        self.model.load_state_dict(weights)
        self.opt.load_state_dict(copy.deepcopy(opt))
        self.good = list(good)
        self.rollbacks += 1
        if self.covered < back:  # the kept steps no line covered yet: a line of the checkpoint's step
            self.line(back, upto=back)
        self.covered, self.interval = back, []  # (the discarded window's steps in no mean)

    def run(self, signal_at: int | None = None) -> "Ref":
        """The documented run; `signal_at`: a SIGTERM during that step, which stops the run at the first step
        boundary the loop reaches after it (a rollback's goes on to its next step first), reading back the
        steps not yet read and saving that step (after a rollback there: the state the run goes on from, as
        the bad step's), and the run resumed from it (the joined run: self.stop_step is where it stopped)."""
        c, s, unread, self.stop_step = self.case, 0, [], None
        try:
            while s < c["steps"]:
                s += 1
                loss, good = self.step(s)
                self.losses[s] = loss
                self.interval.append(s)
                unread.append((s, good))
                log = s % c["log_every"] == 0 or s in (1, c["steps"])
                save = s % c["save_every"] == 0 or s == c["steps"]
                if (log or save) and self.read(unread, s):
                    s = self.back_at
                    continue
                if save:
                    self.save(s)
                if log:
                    self.line(s)
                if signal_at is not None and s >= signal_at and s < c["steps"] and self.stop_step is None:
                    if unread and self.read(unread, s):
                        s = self.back_at
                    elif self.covered < s:  # the steps since the last line: a line of the step saved
                        self.line(s)
                    if s not in self.snapshots or s != max(self.snapshots):
                        self.save(s)
                    self.stop_step = s
        except RefStop as e:
            self.stopped = str(e)
        return self

    def read(self, unread: list, s: int) -> bool:
        """The read of the steps since the last; True when it rolled back (the run goes on at self.back_at + 1)."""
        bad = [b for b, ok in unread if not ok]
        entries = list(unread)
        unread.clear()
        if bad and self.case["policy"] == "stop":
            raise RefStop(f"at step {bad[0]} ")
        if bad and self.case["policy"] == "rollback":
            self.roll_back(bad[0])
            self.back_at = bad[0]
            return True
        limit = self.case.get("skip_limit", 10)
        for b, ok in entries:  # train.skip_limit: the limit-th bad step in a row read stops the run
            self.streak = 0 if ok else self.streak + 1
            if not ok:
                self.skipped += 1
                self.skipped_at.add(b)
            if limit and self.streak >= limit:
                raise RefStop(f"the last, step {b}:")
        return False

    def save(self, s: int) -> None:
        self.snapshot(s)
        self.repeats = [None, 0]


def run_real(case: dict, run_dir, faults: dict | None = None, extra=(), signal_at=None):
    """The run under test: (trainer, loss of each step as last run, the error that ended it or None)."""
    os.environ["LONGCTX_FAULT"] = fault_env(case["faults"] if faults is None else faults)
    try:
        trainer = Trainer(load_config(None, case_args(case, run_dir, extra)), log=_quiet)
        losses, real_step = {}, trainer.step

        def stepping(s):
            out = real_step(s)
            losses[s] = float(out[0])
            return out

        trainer.step = stepping
        if signal_at is not None:
            _signal_in(trainer, *signal_at)
        error = None
        try:
            trainer.run()
        except (TrainingError, Preempted) as e:
            error = e
    finally:
        os.environ.pop("LONGCTX_FAULT", None)
    return trainer, losses, error


def _signal_in(trainer, step: int, micro: int) -> None:
    """SIGTERM to this process in `step`'s micro-batch `micro` (0-based): in the middle of accumulation."""
    calls = {"step": 0, "micro": 0}
    real_step = trainer.step

    def stepping(s):
        calls["step"], calls["micro"] = s, 0
        return real_step(s)

    def hook(*_):
        if calls["step"] == step and calls["micro"] == micro:
            os.kill(os.getpid(), signal.SIGTERM)
        calls["micro"] += 1

    trainer.step = stepping
    trainer.model.register_forward_pre_hook(hook)


def same_number(a, b) -> bool:  # (NaN, or None: metrics.jsonl's NaN, equal to NaN)
    a, b = (float("nan") if x is None else x for x in (a, b))
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_states_equal(trainer, ref: Ref, what: str) -> None:
    """Weights and AdamW state bitwise (a state never made equals one of step 0 and zero moments)."""
    got, want = trainer.model.state_dict(), ref.model.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: weight {name} differs"
    mine, theirs = trainer.optimizer.state_dict()["state"], ref.opt.state_dict()["state"]
    for key in set(mine) | set(theirs):
        a, b = mine.get(key, {}), theirs.get(key, {})
        assert float(a.get("step", 0)) == float(b.get("step", 0)), f"{what}: AdamW step count of param {key}"
        for moment in [m for m in ("exp_avg", "exp_avg_sq") if m in a or m in b]:
            x = a.get(moment, torch.zeros_like(b.get(moment, a.get(moment))))
            assert torch.equal(x, b.get(moment, torch.zeros_like(x))), f"{what}: AdamW {moment} of param {key}"
    if ref.case["factor"]:  # the spike check's window: the last good steps' losses (saved with each checkpoint)
        window = ref.good[len(ref.good) - min(len(ref.good), ref.case["window"]):]
        assert trainer.guard.state_dict()["losses"] == window, f"{what}: spike window"


def check_lines(trainer, ref: Ref, what: str) -> None:
    """metrics.jsonl: a line for each documented read of a logged step, in order, with its loss, the counts of
    skipped steps and rollbacks so far, and the mean of its interval's kept steps."""
    lines = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    got = [(r["step"], r["loss"], r.get("skipped_steps", 0), r.get("rollbacks", 0), r.get("loss_mean"),
            r.get("interval_steps")) for r in lines]
    assert [x[0] for x in got] == [x[0] for x in ref.lines], f"{what}: metrics lines' steps"
    for a, b in zip(got, ref.lines):
        assert same_number(a[1], b[1]) and a[2:4] == b[2:4], f"{what}: metrics line {a} vs documented {b}"
        assert (a[4] is None) == (b[4] is None) and (b[4] is None or a[4] == pytest.approx(b[4], rel=1e-12)), (
            f"{what}: loss_mean of {a} vs documented {b}")
        assert a[5] == b[5], f"{what}: interval_steps of {a} vs documented {b}"


def audit(case: dict, tmp_path) -> None:
    ref = Ref(case, tmp_path / "ref").run()
    trainer, losses, error = run_real(case, tmp_path / "real")
    what = f"case {case}"
    if ref.stopped:
        assert isinstance(error, TrainingError), f"{what}: ran on past '{ref.stopped}' ({error})"
        assert ref.stopped in str(error), f"{what}: '{ref.stopped}' not in: {error}"
        saved = sorted(int(p.name[5:]) for p in (trainer.run_dir / "checkpoints").glob("step-*"))
        # (older ones pruned by checkpoint.keep): the newest is the documented run's last save, none holds a later step
        assert set(saved) <= set(ref.snapshots) and saved[-1:] == sorted(ref.snapshots)[-1:], f"{what}: {saved}"
        return
    assert error is None, f"{what}: {error}"
    assert set(losses) == set(ref.losses), f"{what}: steps {sorted(losses)}"
    for s in ref.losses:
        assert same_number(losses[s], ref.losses[s]), f"{what}: loss of step {s}: {losses[s]} vs {ref.losses[s]}"
    assert trainer.skipped_steps == ref.skipped and trainer.rollbacks == ref.rollbacks, what
    assert_states_equal(trainer, ref, what)
    check_lines(trainer, ref, what)


_PLAIN = {"steps": 7, "accum": 2, "rows": 1, "save_every": 2, "log_every": 1, "warmup": 0, "schedule": "constant",
          "seed": 0, "factor": 3.0, "window": 2}
PINNED = [  # found by the draws: a spike after spike_window bad steps in a row; a spike before the window is full
    *({**_PLAIN, "faults": {3: "nonfinite", 4: "nonfinite", 5: "spike"}, "policy": p} for p in ("skip", "rollback")),
    *({**_PLAIN, "faults": {1: "nonfinite", 3: "spike"}, "policy": p} for p in ("skip", "rollback")),
    # rollbacks in a row to one checkpoint, the fourth refused; a spike right after a rollback and a bad last step
    {**_PLAIN, "steps": 9, "save_every": 4, "faults": {5: "nonfinite", 6: "spike", 7: "nonfinite", 8: "spike"},
     "policy": "rollback"},
    {**_PLAIN, "steps": 8, "save_every": 4, "log_every": 2, "faults": {5: "nonfinite", 6: "spike", 8: "spike"},
     "policy": "rollback"},
]


@pytest.mark.parametrize("pinned", range(len(PINNED)))
def test_pinned_schedules_match_the_documented_run(pinned, tmp_path):
    audit(PINNED[pinned], tmp_path)


def test_a_spike_after_a_streak_of_bad_steps_is_caught():
    """docs: the median of the last spike_window GOOD steps' losses. The guard kept a slot per step, a bad one's
    empty: spike_window non-finite steps in a row left no loss in it, and the 1000x step after them was applied
    (a NaN median compares False); a resume's window is the good losses too."""
    from longctx.train.guard import StepGuard

    guard = StepGuard(3.0, 3, torch.device("cpu"))
    for loss in (4.0, 4.1, 3.9, *[float("nan")] * 3):
        guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
    assert guard.state_dict() == {"losses": [4.0, 4.1, 3.9]}
    apply, spike = guard.check(torch.tensor(4000.0, dtype=torch.float64), torch.tensor(1.0))
    assert (bool(apply), bool(spike)) == (False, True)


SEEDS = range(12)
POLICIES = ("skip", "rollback", "stop")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", SEEDS[:4])
def test_fault_schedules_match_the_documented_run(seed, policy, tmp_path):
    audit(draw_case(seed, policy), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", SEEDS[4:])
def test_more_fault_schedules_match_the_documented_run(seed, policy, tmp_path):
    audit(draw_case(seed, policy), tmp_path)


def draw_signal(case: dict, seed: int) -> tuple[int, int]:
    """A SIGTERM's step (before the last) and micro-batch: often in the middle of accumulation, on a bad
    step or right after one (a skip), or on a checkpoint's step."""
    rng = random.Random(seed + 1000)
    bad = [s for s in case["faults"] if s < case["steps"]]
    near = [*bad, *(s + 1 for s in bad), case["save_every"]]
    at = rng.choice([s for s in near if s < case["steps"]] or [1]) if rng.random() < 0.7 else rng.randint(
        1, case["steps"] - 1)
    return at, rng.randint(0, case["accum"] - 1)


def audit_preemption(case: dict, tmp_path) -> None:
    """SIGTERM in a step, saved, resumed with --checkpoint.resume auto (the faults left are the steps after the
    signal's: each fires once, and the first job ran every step up to it): the joined run is the documented run
    with the stop's read and save."""
    at, micro = draw_signal(case, case["seed"] * 7 + case["steps"])
    what = f"case {case}, SIGTERM in step {at} micro-batch {micro}"
    ref = Ref(case, tmp_path / "ref").run(signal_at=at)
    first, losses, error = run_real(case, tmp_path / "real", signal_at=(at, micro))
    if ref.stopped:
        assert isinstance(error, TrainingError) and ref.stopped in str(error), f"{what}: {ref.stopped} vs {error}"
        return
    last, more = first, {}
    if ref.stop_step is None:  # the signal came in the last step's rollback window: the run ends as it would
        assert error is None, f"{what}: {error}"
    else:
        assert isinstance(error, Preempted), f"{what}: {error}"
        last, more = resume(case, tmp_path, at, what, ref, error)
    losses.update(more)
    assert set(losses) == set(ref.losses), f"{what}: steps {sorted(losses)}"
    for s in ref.losses:
        assert same_number(losses[s], ref.losses[s]), f"{what}: loss of step {s}: {losses[s]} vs {ref.losses[s]}"
    assert (last.skipped_steps, last.rollbacks) == (ref.skipped, ref.rollbacks), what
    assert_states_equal(last, ref, what)
    check_lines(last, ref, what)  # (the resumed job's lines continue the first's file)


def resume(case: dict, tmp_path, at: int, what: str, ref: Ref, error) -> tuple:
    """The second job of a preempted run: (its trainer, its losses)."""
    assert f"saved step {ref.stop_step} on SIGTERM" in str(error), f"{what}: {error}"
    later = {s: k for s, k in case["faults"].items() if s > at}
    resumed, more, error = run_real(case, tmp_path / "real", later, ["--checkpoint.resume=auto"])
    assert error is None and resumed.start_step == ref.stop_step, f"{what}: {error}"
    return resumed, more


@pytest.mark.parametrize("policy", ["skip", "rollback"])
@pytest.mark.parametrize("seed", (1, 2, 4))  # (4: a signal right after a skip, the stop's read finds it)
def test_a_preempted_and_resumed_run_is_the_documented_run(seed, policy, tmp_path):
    audit_preemption(draw_case(seed, policy), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "rollback"])
@pytest.mark.parametrize("seed", [x for x in SEEDS if x not in (1, 2, 4)])
def test_more_preempted_runs_are_the_documented_run(seed, policy, tmp_path):
    audit_preemption(draw_case(seed, policy), tmp_path)
