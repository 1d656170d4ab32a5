"""A run that dies inside a step, as a crash or a killed process would: the steps before it (their
saves and metrics lines included) are done, the step itself is not."""

import pytest


def run_until_crash(trainer, when) -> None:
    """Run `trainer` until it raises at the start of the step `when` names (a step number, or a test of
    the step number), then close its data reader."""
    step, crashes = trainer.step, (when if callable(when) else lambda s: s == when)

    def stepping(s):
        if crashes(s):
            raise RuntimeError("simulated crash")
        return step(s)

    trainer.step = stepping
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    trainer.sampler.close()
