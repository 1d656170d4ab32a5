"""checkpoint.on_signal given to a run that saves nothing (checkpoint.interval 0, checkpoint.final false) was accepted
and ignored: the stop on a signal saves the step it stops at, so such a run installs no handler (train/watch.py), and
the very signal it was told to catch ended it with nothing saved. It is refused before any work, as
checkpoint.exit_after_minutes is in such a run; the default signals, '' and none, say nothing."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError


def test_signals_in_a_run_that_saves_nothing_are_refused():
    with pytest.raises(ConfigError, match=r"checkpoint.on_signal = 'SIGUSR1' would be ignored: .* saves no checkpoint "
                                          r".*set --checkpoint.final true \(or an interval\), or drop it"):
        load_config(None, ["--checkpoint.on_signal=SIGUSR1", "--checkpoint.final=false"])


@pytest.mark.parametrize("args", [
    ["--checkpoint.on_signal=SIGUSR1"],  # (checkpoint.final, the default, saves)
    ["--checkpoint.on_signal=SIGUSR1", "--checkpoint.final=false", "--checkpoint.interval=5"],
    ["--checkpoint.on_signal=", "--checkpoint.final=false"],
    ["--checkpoint.on_signal=none", "--checkpoint.final=false"],
    ["--checkpoint.final=false"],  # (the default signals: not given)
])
def test_signals_that_apply_or_are_not_given_are_accepted(args):
    load_config(None, args)
