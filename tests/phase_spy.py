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
