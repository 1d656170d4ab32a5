"""The trainer's own state beside the step and the data position: saved in each checkpoint's
trainer_state.json (checkpoint/manager.py `extra_state`, one JSON object per name) and restored on a
resume and after a rollback, so the run goes on as the uninterrupted one would.

- "guard": the spike check's window (guard.py) and the count of skipped steps (exact: a save reads
  every step before it), so a resumed run checks its first steps and its metrics go on counting;
- "moe": the routers' last choices per expert and FlexMoE's placer (moe_hooks.py), so expert copies
  are placed where they would have been;
- "schedule": the learning-rate schedule's settings (step/schedule.py schedule_state), so a resume that
  changes the next step's rate (a longer train.steps under a decay) says so (resume_note).

A checkpoint written before a name was saved restores it empty (the state a fresh run starts with).
"""

from __future__ import annotations

from ..step.schedule import resume_note, schedule_state
from .moe_hooks import MoEStepHook


def keep_step_state(trainer) -> None:
    """Register the trainer's state with its checkpointing, and restore it from a resumed checkpoint."""
    ckpt = trainer.ckpt
    if ckpt is None:
        return
    ckpt.extra_state["guard"] = lambda: {**trainer.guard.state_dict(), "skipped_steps": trainer.skipped_steps}
    if (moe := trainer.hooks.find(MoEStepHook)) is not None:
        ckpt.extra_state["moe"] = moe.state_dict
    ckpt.extra_state["schedule"] = lambda: schedule_state(trainer.cfg)
    if ckpt.resumed_state is not None:
        trainer.skipped_steps = int((ckpt.resumed_state.get("guard") or {}).get("skipped_steps", 0))
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
