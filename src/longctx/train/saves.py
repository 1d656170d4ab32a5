"""When a run saves its checkpoints, and what a failed save does.

checkpoint.interval saves every that many steps, and the run's last step is kept by a periodic
saver and by checkpoint.final alike; a run with neither has no checkpoint manager and saves
nothing. checkpoint.on_save_error: a failed save (already cleaned up by the manager, on every rank
alike) stops the run (`stop`), or is said and training goes on (`warn`). An async save's failure
surfaces only when the next save waits for it; that wait is handled on its own, so under `warn` the
next save is still made (handled inside it, the failure of step N's save cancelled step N+interval's
too, the run's last included, with no word about it), and a stop on a signal saves its step again when
the failed save was that step's. The run's last save has no later one: its failure stops the run under `warn`
too (a non-zero exit, and the checkpoint a resume goes on from), as a stop's own save does.
"""

from __future__ import annotations

import contextlib
import time

from ..config import Config
from ..config.checkpoint_paths import CheckpointError
from ..job import watchdog


class RunSaves:
    """The saves of one run through its checkpoint manager `ckpt` (None: the run saves nothing)."""

    def __init__(self, ckpt, cfg: Config, log=print):
        self.ckpt, self.cfg, self.log = ckpt, cfg, log
        self.failed: set[int] = set()  # steps whose due save failed under on_save_error = warn

    def saved(self, step: int) -> bool:
        """Whether `step` was saved when due (its save not failed: a stop on a signal saves it then)."""
        return self.due(step) and step not in self.failed

    def due(self, step: int) -> bool:
        ck = self.cfg.checkpoint
        if self.ckpt is None:
            return False
        if step == self.cfg.train.steps:  # the end is kept by a periodic saver and by checkpoint.final alike
            return bool(ck.interval or ck.final)
        return bool(ck.interval) and step % ck.interval == 0

    def save(self, step: int, model, optimizer, sampler) -> float:
        """Save `step` when it is due; returns the seconds the loop was blocked by it."""
        if not self.due(step):
            return 0.0
        start = time.perf_counter()
        with watchdog.in_phase(step, "save"):  # (the step's own phase again once it returns: the rank saves no more)
            self.wait()  # the save in flight first, apart: its failure is its own, not this step's (module docstring)
            with self.errors(step):
                self.ckpt.save(step, model, optimizer, sampler.state_dict())
        return time.perf_counter() - start

    def save_for_stop(self, step: int, saved: bool, model, optimizer, sampler) -> None:
        """The stop on a signal: `step` saved and committed before the run ends (`saved`: its save was made
        when due, and may still be in flight). A failure of the save in flight is handled as errors() says;
        under `warn` it may have been `step`'s own, so `step` is saved now. The stop's own save raises on
        failure whatever the policy: the run never says it saved a step that is not on disk."""
        try:
            self.ckpt.wait()
        except CheckpointError as e:
            if self.cfg.checkpoint.on_save_error == "stop":
                raise self.stopped(e) from e
            self.log(f"checkpoint: {e} Saving step {step} before the run stops (checkpoint.on_save_error = warn).")
            saved = False
        if not saved:
            try:
                self.ckpt.save(step, model, optimizer, sampler.state_dict())
                self.ckpt.wait()
            except CheckpointError as e:  # (whatever the policy: the run never says it saved a step not on disk)
                raise self.stopped(e, "the stop's own save failed") from e

    def wait(self, last: bool = False) -> None:
        """Until the saves in flight are complete and committed (a failure handled as errors() says; `last`: the
        wait at the run's end, whose save in flight is the run's last, which no later save retries)."""
        if self.ckpt is not None:
            with self.errors(self.cfg.train.steps if last else None):
                self.ckpt.wait()

    def finish_in_flight(self) -> None:
        """On the way out of a run that failed: the async save in flight (staged before the failure, from steps
        already read) completed and committed, not left half-written for the next start to sweep away; its own
        failure is said, not raised over the run's."""
        if self.ckpt is None:
            return
        try:
            self.ckpt.wait()
        except CheckpointError as e:
            self.log(f"checkpoint: {e}")

    @contextlib.contextmanager
    def errors(self, step: int | None = None):
        """checkpoint.on_save_error for a failed save inside the block (that of `step`, if given)."""
        try:
            yield
        except CheckpointError as e:
            if self.cfg.checkpoint.on_save_error == "stop":
                raise self.stopped(e) from e
            if step == self.cfg.train.steps:  # (under warn too: no save after it tries again, and a run that ended
                # with exit 0 and its last steps' weights nowhere on disk was taken for a finished one, never resumed)
                raise self.stopped(e, f"step {step} is its last: no later save tries again") from e
            if step is not None:
                self.failed.add(step)
            self.log(f"checkpoint: {e} Training goes on (checkpoint.on_save_error = warn).")

    def stopped(self, error: CheckpointError, why: str = "") -> CheckpointError:
        """A failed save's error as the run stops on it: that it stops, and why (`why`, or the policy: the error
        itself says the way out, checkpoint/failures.py save_failed: free space, another --checkpoint.dir, the
        checkpoint a resume goes on from); a run with no checkpoint to resume from starts again. `warn` is named
        only where it would have trained on (a stop's own save fails whatever the policy)."""
        kept = self.ckpt.own_newest()  # (not `latest`: another attempt's, or run's, until this run commits one)
        then = "" if kept is not None else (" Start the run again once it is fixed: no checkpoint was saved to "
                                            "resume from.")
        warn = ("" if why or self.cfg.checkpoint.on_save_error == "warn" else
                "; checkpoint.on_save_error = warn trains on past a failed save and tries again at the next save")
        why = why or "checkpoint.on_save_error = stop"
        return CheckpointError(f"{error} The run stops ({why}){warn}.{then}")
