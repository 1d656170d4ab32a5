"""Where a store's parts held out a document only because nothing hashed into their eval split (holdout.py's
fallback): an append holds out its revision at the same place (holdout.split_items `held_out`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import store


def fallback_starts(manifest: dict | None, root: Path) -> dict[str, int]:
    """{name: the token offset its held-out part starts at} of each document a part of the store at `root` held
    out by the fallback (its pack record's `eval_fallback`). The offset, not the name alone: a revision cut into
    other pieces (grown past the grid, or by pieces whose hash is lower) held out its own lowest-hash piece,
    and trained on the very text its first version holds out."""
    out: dict[str, int] = {}
    for part in manifest["parts"] if manifest else []:
        name = part.get("stages", {}).get("pack", {}).get("eval_fallback")
        if not name or not part["splits"]["eval"]["samples"]:
            continue
        lines = (root / part["dir"] / "docs.jsonl").read_text(encoding="utf-8").splitlines()
        docs = {part["first_doc"] + i for i, line in enumerate(lines) if json.loads(line).get("name") == name}
        segments = np.load(root / part["dir"] / "eval.segments.npy")
        starts = [s for d, s in segments[:, [store.S_DOC, store.S_START]].tolist() if d in docs]
        out[name] = int(min(starts, default=0))
    return out
