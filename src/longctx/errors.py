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
