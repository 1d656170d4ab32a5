"""A checkpoint's manifest edited as an older or another run would have written it, its checksum made anew so that
it still reads as whole (the tests of resumes from checkpoints written before a manifest key existed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def rewrite_manifest(checkpoint: Path, edit: Callable[[dict], None]) -> dict:
    """Apply `edit` (in place) to the manifest of `checkpoint`, re-checksum and write it; the manifest written."""
    from longctx.checkpoint.manifest import MANIFEST, _manifest_checksum

    path = Path(checkpoint) / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["checksum"] = _manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    return manifest
