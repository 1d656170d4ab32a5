"""An output directory's path checked before `longctx checkpoint export | import` reads any weight."""

from __future__ import annotations

from pathlib import Path


def file_in_the_way(out: Path) -> Path | None:
    """The file that keeps directory `out` from being made (`out` itself, or the nearest existing of
    its parents when that is a file), else None. Checked first: otherwise the export or import
    reads and converts every weight and fails only where it creates the directory."""
    out = Path(out).expanduser()
    nearest = next((p for p in (out, *out.parents) if p.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None
