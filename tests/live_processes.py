"""The live processes a test's job left: their command lines, read from Linux's /proc."""

from __future__ import annotations

import os
from pathlib import Path


def processes_naming(text: str) -> list[str]:
    """The command lines of live processes (this one left out) that hold `text`, e.g. a test's model directory:
    the launcher and ranks of a job given it."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and str(os.getpid()) != cmdline.parent.name:
            found.append(args)
    return found
