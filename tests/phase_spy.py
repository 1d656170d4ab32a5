"""A progress.Phase that keeps every value its count is given, for tests of counts that move inside long work
(what any heartbeat line could have read, without sleeping for a line)."""

from longctx import progress

_Phase = progress.Phase  # (the class itself: record_phases puts RecordedPhase in its place in the module)


class RecordedPhase(_Phase):
    """A Phase recording each value its count takes (`values`), every one made appended to `made` (the list
    `record_phases` returns)."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.values: list[float] = []
        super().__init__(*args, **kwargs)
        RecordedPhase.made.append(self)

    @property
    def done(self):
        return _Phase.done.fget(self)  # (a followed count's too: Phase.done)

    @done.setter
    def done(self, value):
        _Phase.done.fset(self, value)
        self.values.append(value)


def record_phases(set_attr=None) -> list:
    """progress.Phase replaced by RecordedPhase (by `set_attr(obj, name, value)`, a monkeypatch's setattr; None:
    assigned, for a spawned rank's own process); the list the phases made from now on are appended to."""
    RecordedPhase.made = []
    if set_attr is None:
        progress.Phase = RecordedPhase
    else:
        set_attr(progress, "Phase", RecordedPhase)
    return RecordedPhase.made


def running_phases() -> list:
    """The phases running in this process now, outermost first (what a heartbeat line would name)."""
    with progress._HEARTBEAT.lock:
        return list(progress._HEARTBEAT.phases)


def record_speaking(monkeypatch) -> list:
    """record_phases for a test of rank 0's counts: lines on (none due within a test), no injected fault."""
    made = record_phases(monkeypatch.setattr)
    monkeypatch.setenv(progress.INTERVAL_ENV, "1000")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LONGCTX_FAULT", "")
    return made


def train_quietly(overrides: list[str], before_run=None):
    """A Trainer of these overrides, `before_run(trainer)` called first, run with its log silenced; returned."""
    from longctx.config import load_config
    from longctx.job.launch import end_one_rank_group
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), log=lambda *a, **k: None)
    if before_run is not None:
        before_run(trainer)
    try:
        trainer.run()
    finally:
        end_one_rank_group()  # (as train() does: a host run at world 1 ends the one-rank group it made)
    return trainer


def training_values(made) -> list[float]:
    """Every value the training phase's count took (the one "training" phase among `made`)."""
    (training,) = [p for p in made if p.what == "training"]
    return training.values
