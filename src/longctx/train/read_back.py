"""What the training loop (trainer.py) does when it reads its steps' figures back to the host: the one read of the
losses, gradient norms and spike flags of the steps since the last (once per log line or save: a step waits for
nothing on the device), a bad step's handling (train.on_nonfinite: skipped and counted, the run stopped, or rolled
back to the newest checkpoint: rollback.py), and the stop on a signal or the time limit, which reads back before
it saves. Each takes the Trainer and the loop's TrainResult."""

from __future__ import annotations

import torch

from ..errors import REQUEUE_EXIT_CODE, Preempted
from ..job import watchdog
from ..step.schedule import lr_at
from .guard import bad_step_reason, skip_limit_error, stopped_run_error
from .rollback import BadStep, roll_back
from .step_state import restore_step_state


def read_back(trainer, unread: list, result) -> tuple[float, float]:
    """Read the losses, gradient norms and spike flags of the steps since the last read in one
    transfer, record them, and act on a bad step (train.on_nonfinite): count it (and stop once train.skip_limit
    were skipped in a row), stop, or raise BadStep for a rollback; returns the newest (loss, grad norm)."""
    entries = list(unread)
    unread.clear()
    values = torch.stack([torch.stack([lo.double(), g.double(), torch.zeros_like(lo, dtype=torch.float64)
                                       if sp is None else sp.double()])
                          for _, lo, g, sp, _ in entries]).tolist()
    t = trainer.cfg.train
    for (step, *_, position), (loss, grad_norm, spike) in zip(entries, values):
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        what = bad_step_reason(loss, grad_norm, spike, t.spike_factor, t.spike_window)
        if what is None:
            trainer.skipped_in_a_row = 0
            continue
        if t.on_nonfinite == "stop":
            raise stopped_run_error(what, step, lr_at(step - 1, trainer.cfg))
        if t.on_nonfinite == "rollback":
            raise BadStep(step, what, position)  # the steps read after it are run again
        trainer.skipped_steps += 1
        if not trainer.skipped_in_a_row:  # (recorded, not computed back from the count: see skip_limit_error)
            trainer.first_skipped_in_a_row = step
        trainer.skipped_in_a_row += 1
        trainer.skipped_at.add(len(result.losses) - 1)
        trainer.log(f"step {step}: {what}: not applied (train.on_nonfinite = skip; {trainer.skipped_steps} skipped "
                    f"so far)")
        # train.skip_limit: a read precedes every save, so the run stops before any checkpoint holds this step;
        # the steps after it in this read are neither recorded nor saved (every rank reads the same figures)
        if t.skip_limit and trainer.skipped_in_a_row >= t.skip_limit:
            raise skip_limit_error(trainer.skipped_in_a_row, t.skip_limit, step, loss, grad_norm,
                                   trainer.first_skipped_in_a_row)
    return values[-1][0], values[-1][1]


def roll_back_trainer(trainer, bad: BadStep, result) -> int:
    """Go back to the newest checkpoint before a bad step (rollback.py); returns the step the run
    goes on after (the bad one)."""
    watchdog.phase(bad.step, "save")  # the save in flight first, timed as a save (stuck in I/O: a hang; "load" is not)
    trainer.saves.wait()
    watchdog.phase(bad.step, "load")
    last = trainer.cfg.train.steps
    note = roll_back(bad, trainer.ckpt, trainer.model, trainer.optimizer, trainer.sampler, trainer.rt.is_main,
                     trainer.rollback_repeats, last)
    # the reloaded weights' own trained positions, not the later stage's the run had reached (a stop on a signal
    # saves them before the next step's stage is entered)
    trainer._record_trained(trainer.sampler.stage_of(int(trainer.ckpt.resumed_from[1]["step"])).index)
    restore_step_state(trainer)  # the checkpoint's spike window (no blind steps) and placements
    trainer.hooks.rolled_back()
    del result.losses[bad.step - result.first_step + 1:]  # the steps after it run again
    del result.grad_norms[len(result.losses):]
    trainer.skipped_at = {i for i in trainer.skipped_at if i < len(result.losses)}  # (indices of steps kept)
    trainer.rollbacks += 1
    # a bad last step: nothing trains after it, the run ends with the checkpoint's weights (the done line says so)
    result.ended_at = int(trainer.ckpt.resumed_from[1]["step"]) if bad.step >= last else None
    trainer.log(note)
    return bad.step


def stop_on_signal(trainer, step: int, name: str, unread: list, result, log_uncovered=lambda step: None) -> None:
    """Save `step` (unless the interval just did), wait for every save in flight, and stop. `log_uncovered(at)`:
    the steps through `at` that no metrics line covers yet logged (the trainer's _log_uncovered): `step`, or after a
    rollback here the checkpoint's it went back to (the steps after it were discarded)."""
    saved = trainer.saves.saved(step)
    trained_through = step
    if unread:
        try:
            read_back(trainer, unread, result)  # (no checkpoint holds a non-finite step)
        except BadStep as bad:  # rolled back: the state to save is the one the run goes on from
            step, saved = roll_back_trainer(trainer, bad, result), False
            trained_through = int(trainer.ckpt.resumed_from[1]["step"])
    log_uncovered(trained_through)
    watchdog.phase(step, "save")
    # (committed when it returns)
    trainer.saves.save_for_stop(step, saved, trainer.model, trainer.optimizer, trainer.sampler)
    trainer.log(f"saved step {step} on {name}")
    raise Preempted(f"saved step {step} on {name}; `--checkpoint.resume auto` continues the run from there "
                    f"(exit code {REQUEUE_EXIT_CODE}: a batch script requeues on it, docs/checkpoints.md).")
