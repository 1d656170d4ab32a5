"""Where longctx keeps what it computes once per machine and reuses: `$LONGCTX_CACHE`, by default
`~/.cache/longctx` (the default data store under data/, the calibrated CPU peak). A path that does not exist yet
is made on first use; one that is, or lies under, something other than a directory is refused (`longctx`'s main
reads it before any command's work): it was the raw OSError of the first write, the default data store's, in
train's preflight."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

ENV = "LONGCTX_CACHE"


def cache_root() -> Path:
    text = os.environ.get(ENV, "")
    if not text:
        return Path.home() / ".cache" / "longctx"
    path = Path(text)
    blocked = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    what = ("it is the folder where longctx keeps what it computes once per machine (the default data store, the "
            "CPU's peak). Set it to a directory (made if missing), or unset it for ~/.cache/longctx.")
    if blocked is not None and not blocked.is_dir():
        where = "is" if blocked == path else f"lies under {str(blocked)!r}, which is"
        raise ConfigError(f"{ENV}={text!r} {where} not a directory: {what}")
    if blocked is not None and blocked != path and not os.access(blocked, os.W_OK | os.X_OK):
        raise ConfigError(f"{ENV}={text!r} does not exist and cannot be made: {str(blocked)!r} is not writable by "
                          f"this user; {what}")
    return path
