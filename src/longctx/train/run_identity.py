"""Which run a metrics record belongs to: `run_id` and `run_attempt` in every record (train and eval).

Two runs given one metrics.file (other run directories: only the directories are locked) wrote records that no field
told apart, so `longctx report` drew their steps interleaved as one curve. `run_id` is a random id made when a run
starts from step 0 and saved with its checkpoints (trainer_state.json "run"), so a resume keeps it: a run's
attempts are one run (a checkpoint of another run directory, loaded to fork it, starts a run with its own id).
`run_attempt` is 0 at the start and the resumed checkpoint's attempt + 1 after (two resumes of one checkpoint share a
number; the resume moves the abandoned attempt's records aside). A resume of a checkpoint saved before the id was
gets a new one (its earlier records, without an id, are read as that run's: report.py)."""

from __future__ import annotations

import secrets

STATE = "run"  # its name in the checkpoints' trainer state


def keep_run_identity(trainer) -> None:
    """Set trainer.run_id and trainer.run_attempt (a resumed checkpoint's id and its attempt + 1, else a new id),
    and save them with each checkpoint."""
    ckpt = trainer.ckpt
    saved = ((ckpt.resumed_state or {}).get(STATE) if ckpt is not None else None) or {}
    if saved.get("id") and ckpt.parent is None:  # (loaded from another run's directory: a fork, a run of its own)
        saved = {}
    if saved.get("id"):
        trainer.run_id, trainer.run_attempt = str(saved["id"]), int(saved.get("attempt", 0)) + 1
    else:  # (rank 0's, so every rank writes the same one into its share of the checkpoint)
        trainer.run_id = trainer.rt.broadcast(secrets.token_hex(4) if trainer.rt.is_main else None)
        trainer.run_attempt = 1 if trainer.start_step else 0
    if ckpt is not None:
        ckpt.extra_state[STATE] = lambda: {"id": trainer.run_id, "attempt": trainer.run_attempt}


def record_tags(trainer) -> dict:
    """The fields every metrics record of this job carries."""
    return {"run_id": trainer.run_id, "run_attempt": trainer.run_attempt}
