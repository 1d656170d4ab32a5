"""Errors a user can act on. The CLI prints their message as one paragraph, without a traceback."""


class UserError(Exception):
    """Something about the input or the setup that the user can fix; the message says how."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    exit_code = 2


class DataError(UserError, ValueError):
    pass


class TrainingError(UserError, RuntimeError):
    pass


# The exit code of a run stopped by a signal after saving: EX_TEMPFAIL (sysexits.h), "try again
# later". A batch script requeues on it (docs/checkpoints.md); nothing else in longctx exits with it.
REQUEUE_EXIT_CODE = 75


class Preempted(UserError):
    """The run was stopped by a signal (checkpoint.on_signal) at a step boundary, after saving that
    step: not a failure, a request to be started again (`--checkpoint.resume auto` continues it)."""

    exit_code = REQUEUE_EXIT_CODE
