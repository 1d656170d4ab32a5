"""`longctx eval` ended by SIGTERM (a scheduler's time limit, or torchrun stopping rank 0 after another rank
failed) lost every finished length: the signal's default action ended the process before eval/stopped.py could
keep them, as it does for an error or Ctrl-C. SIGTERM now raises in the main thread while the tasks run: the
lengths done are kept in out.incomplete.json, said to be stopped by SIGTERM, and the process exits 143."""

import json
import signal

import pytest
from test_evalcmd108 import _eval, folder  # noqa: F401 (the module's tiny model, a fixture)

from longctx.eval import runner


def _terminate_at(monkeypatch, call: int):
    """runner.score delivering SIGTERM to this process at its `call`-th call (a real signal, once eval's handler is
    there; without one it would end the test process, so that case fails here instead)."""
    plain, calls = runner.score, []

    def score(*a, **k):
        calls.append(1)
        if len(calls) == call:
            assert callable(signal.getsignal(signal.SIGTERM)), "eval runs with SIGTERM's default action"
            signal.raise_signal(signal.SIGTERM)
        return plain(*a, **k)
    monkeypatch.setattr(runner, "score", score)


@pytest.fixture
def default_sigterm():
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (as a CLI process starts)
    yield
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (put back after the run)
    signal.signal(signal.SIGTERM, before)


def test_sigterm_keeps_the_lengths_done_and_exits_143(folder, tmp_path, monkeypatch, default_sigterm, capsys):  # noqa: F811
    out = tmp_path / "out.json"
    _terminate_at(monkeypatch, 2)
    with pytest.raises(SystemExit) as stopped:
        _eval(folder, "ppl", "--output", str(out))
    assert stopped.value.code == 143
    assert not out.exists()
    kept = json.loads((tmp_path / "out.incomplete.json").read_text())
    assert kept["incomplete"] == {"stopped_by": "terminated (SIGTERM)", "lengths_done": [256],
                                  "lengths_not_run": [512]}
    assert "eval: stopped (terminated (SIGTERM)): the lengths done are kept in" in capsys.readouterr().err


def test_a_program_with_its_own_sigterm_handler_keeps_it(folder, tmp_path, default_sigterm):  # noqa: F811
    seen = []
    signal.signal(signal.SIGTERM, lambda *a: seen.append(a))
    try:
        assert _eval(folder, "ppl", "--output", str(tmp_path / "o.json")) == 0
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL and not seen
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
