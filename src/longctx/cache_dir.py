"""Where longctx keeps what it computes once per machine and reuses: `$LONGCTX_CACHE`, by default
`~/.cache/longctx` (the default data store under data/, the calibrated CPU peak)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("LONGCTX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "longctx"
