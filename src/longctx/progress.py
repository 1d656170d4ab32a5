"""Progress bars for a person at a terminal, and nothing for a log file.

A bar redraws itself with carriage returns; sent to a file or a pipe (a scheduler's log, `| tee`,
torchrun's redirected output) each redraw is one more frame that buries the metrics lines. So a bar
is shown only when it is wanted (metrics.progress, data build --no-progress) and stderr is a
terminal; everything else reads the one line per log interval.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def on_terminal() -> bool:
    """Whether stderr is an interactive terminal (not a file, a pipe or a dumb console)."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A tqdm bar on stderr, or None when it is not wanted or stderr is not a terminal."""
    if not (enabled and on_terminal()):
        return None

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
