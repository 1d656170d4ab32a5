"""Where `longctx generate --output FILE`'s lines are written until every one is in, and the note that FILE
exists already (generate/output.py Output writes them; moved out of it for its length)."""

from __future__ import annotations

import os
from pathlib import Path

from ..durable import new_file_error, written_in_place


def replacing_note(path: str) -> str:
    """The note that --output `path` holds a file already, which this run replaces ('' when none, or not a regular
    file: /dev/null), said before the weights are read: a demanding user's earlier results are never replaced
    without a word, and a Ctrl-C then still keeps them."""
    if not path or not os.path.isfile(path) or written_in_place(path):
        return ""
    if partial_path(path) == path:  # (its directory takes no new file: written over as the lines come)
        return f"--output {path} exists: it is written over in place, from the first line on"
    return (f"--output {path} exists: it is replaced once every line is in (until then it stays as it was, the "
            f"lines going to {partial_path(path)})")


def partial_path(path: str) -> str:
    """Where the lines of an --output file are written until every one is in (then renamed `path`): `path`
    itself when it is no regular file (/dev/null, /dev/stdout, a pipe) or one a process has open (/dev/stdout
    redirected to a file, /proc/self/fd/N), which a rename would replace; or an existing file in a directory that
    takes no new one (durable.py check_output_path accepts it when it may be written)."""
    if written_in_place(path):
        return path
    if os.path.isfile(path) and new_file_error(Path(os.path.realpath(path)).parent) is not None:
        return path
    return f"{path}.partial"
