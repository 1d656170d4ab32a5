"""Environment variables that longctx reads in its higher floors, parsed strictly in one place (no torch: `longctx
data build` in bounded memory runs this too), and `check_environment`, which `longctx`'s main runs, with the
floor's own readers (progress.py, cache_dir.py, faults.py), before any command's work.

The decode's switches (generate/blocks.py LONGCTX_DECODE_GRAPHS, generate/cache_pool.py LONGCTX_REUSE_CACHES) and
the host-memory budget (train/host_budget.py) are parsed with the functions here where they are read, so a bad
value is the same clear error there and at the command's start: one read lazily (a decode's graphs) is refused
before the work, not in the middle of it or never. The ranks' error folder (LONGCTX_ERROR_DIR, longctx's own: job/
relaunch.py sets it) is checked here only; its readers take it as it is. Before these checks,
LONGCTX_DECODE_GRAPHS / LONGCTX_REUSE_CACHES=false (anything but 0) read as on. The accepted values of every
variable: docs/running.md, "Environment variables"; tests/unit/test_badenv114.py walks them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import ConfigError

DECODE_GRAPHS_ENV = "LONGCTX_DECODE_GRAPHS"
REUSE_CACHES_ENV = "LONGCTX_REUSE_CACHES"
HOST_MEMORY_ENV = "LONGCTX_HOST_MEMORY_BYTES"
ERROR_DIR_ENV = "LONGCTX_ERROR_DIR"  # (set by job/relaunch.py in the ranks it starts: their errors go there)


def switch(name: str, default: bool = True) -> bool:
    """An on/off variable: 1 on, 0 off, unset or empty the default. Anything else is refused: `false` or
    `off` read as on (only 0 was off), the opposite of what was meant."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ConfigError(f"{name}={os.environ[name]!r}: it takes 1 (on) or 0 (off); unset, it is "
                          f"{'on' if default else 'off'}. Set it to 0 or 1, or unset it.")
    return text == "1"


def host_memory_bytes() -> float | None:
    """LONGCTX_HOST_MEMORY_BYTES: a budget of host bytes standing in for the free host memory (a testing aid), or
    None where it is unset or empty."""
    text = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{HOST_MEMORY_ENV} must be a number of bytes (e.g. 8e9), got {text!r}: it stands in for "
                          f"this node's free host memory (a testing aid); unset it to use the real figure.")
    return value


def error_dir() -> str | None:
    """LONGCTX_ERROR_DIR: longctx's own, the existing folder where the ranks of `longctx train --nproc N` hand their
    errors to the launcher. Set to what is no directory, the errors were written nowhere (and a rank's errors not
    printed either, under RANK)."""
    text = os.environ.get(ERROR_DIR_ENV)
    if text is not None and not (text and Path(text).is_dir()):  # (Path('') is the working directory)
        raise ConfigError(f"{ERROR_DIR_ENV}={text!r} is not a directory: the variable is longctx's own, set by "
                          f"`longctx train --nproc N` in the ranks it starts (the folder their errors go to). "
                          f"Unset it.")
    return text


def check_environment() -> None:
    """The variables above parsed once, before any command's work (each reader parses it again where it is read: the
    same function, the same error). cli.py checks the floor's other readers' beside it (progress.py's
    LONGCTX_PROGRESS_S, cache_dir.py's LONGCTX_CACHE, faults.py's LONGCTX_FAULT)."""
    switch(DECODE_GRAPHS_ENV)
    switch(REUSE_CACHES_ENV)
    host_memory_bytes()
    error_dir()
