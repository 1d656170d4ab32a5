"""The trainer's own state beside the step and the data position: saved in each checkpoint's
trainer_state.json (checkpoint/manager.py `extra_state`, one JSON object per name) and restored on a
resume and after a rollback, so the run goes on as the uninterrupted one would.

- "guard": the spike check's window (guard.py), the count of skipped steps (exact: a save reads
  every step before it), of those skipped in a row up to the saved step (train.skip_limit) and of rollbacks, so a
  resumed run checks its first steps, its metrics go on counting and a streak of skips stops it where the
  uninterrupted run would have stopped;
- "moe": the routers' last choices per expert and FlexMoE's placer (moe_hooks.py), so expert copies
  are placed where they would have been;
- "schedule": the learning-rate schedule's settings (step/schedule.py schedule_state), so a resume that
  changes the next step's rate (a longer train.steps under a decay) says so (resume_note);
- "tokens": the positions each step trained (the stage plan's, and what came before it), so the metrics'
  `tokens` go on counting what was trained when a resume changes train.global_batch, seq_len or stages
  (they counted the steps before the resume at the new sizes).

A checkpoint written before a name was saved restores it empty (the state a fresh run starts with).
"""

from __future__ import annotations

from ..step.schedule import resume_note, schedule_state
from .moe_hooks import MoEStepHook
from .stages import tokens_through


def keep_step_state(trainer) -> None:
    """Register the trainer's state with its checkpointing, and restore it from a resumed checkpoint."""
    ckpt = trainer.ckpt
    if ckpt is None:
        return
    ckpt.extra_state["guard"] = lambda: {**trainer.guard.state_dict(), "skipped_steps": trainer.skipped_steps,
                                         "skipped_in_a_row": trainer.skipped_in_a_row, "rollbacks": trainer.rollbacks,
                                         "first_skipped_in_a_row": trainer.first_skipped_in_a_row}
    if (moe := trainer.hooks.find(MoEStepHook)) is not None:
        ckpt.extra_state["moe"] = moe.state_dict
    ckpt.extra_state["schedule"] = lambda: schedule_state(trainer.cfg)
    ckpt.extra_state["tokens"] = lambda: _tokens_state(trainer)
    if ckpt.resumed_state is not None:
        guard = ckpt.resumed_state.get("guard") or {}
        trainer.skipped_steps = int(guard.get("skipped_steps", 0))
        trainer.skipped_in_a_row = int(guard.get("skipped_in_a_row", 0))  # (a resume mid-run goes on counting it)
        trainer.first_skipped_in_a_row = guard.get("first_skipped_in_a_row")  # (None in a checkpoint saved before it)
        trainer.rollbacks = int(guard.get("rollbacks", 0))  # (a rollback keeps the run's own count: restore_step_state)
        trainer.tokens_offset = _resumed_tokens_offset(ckpt.resumed_state, trainer.sampler.stages)
        restore_step_state(trainer)
        # (a resume only: a rollback keeps the run's own settings)
        if note := resume_note(ckpt.resumed_state.get("schedule"), trainer.cfg, int(ckpt.resumed_state["step"])):
            trainer.log(f"note: {note}")


def restore_step_state(trainer) -> None:
    """The loaded checkpoint's spike-check window and router state (a resume; a rollback, which keeps the
    count of skipped steps: those steps were read)."""
    saved = trainer.ckpt.resumed_state
    trainer.guard.load_state_dict(saved.get("guard"))
    if (moe := trainer.hooks.find(MoEStepHook)) is not None:
        moe.load_state_dict(saved.get("moe"))


def _tokens_state(trainer) -> dict:
    """The positions trained through any step of this run: the offset plus each stage's steps x batch x length."""
    return {"offset": trainer.tokens_offset,
            "stages": [[s.first_step, s.last_step, s.seq_len * s.global_batch] for s in trainer.sampler.stages]}


def _resumed_tokens_offset(state: dict, stages) -> int:
    """What to add to `tokens_through(stages, step)` so that the resumed step's count is the one its run trained
    (a checkpoint without the record: its steps counted under this run's stages, as before)."""
    saved, step = state.get("tokens"), int(state["step"])
    if not saved:
        return 0
    trained = int(saved["offset"]) + sum(max(0, min(step, last) - first + 1) * per_step
                                         for first, last, per_step in saved["stages"])
    return trained - tokens_through(stages, step)
