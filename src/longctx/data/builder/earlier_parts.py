"""What an append (`longctx data build --append`) reads of the store's earlier parts: their documents' exact
hashes and MinHash signatures, against which the new part's documents are deduplicated (their text is not
kept, so a near copy is found by the signatures' estimate alone: docs/data.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import store
from .conversations import RULES
from .dedup import VERSION as DEDUP_VERSION


def stored_documents(root: Path, old: dict | None, dedup: str, log,
                     conversations: bool = False) -> tuple[tuple | None, np.ndarray | None]:
    """((exact hashes, MinHash signatures or None), whether each signature's document is plain) of the
    documents already in the store at `root` (manifest `old`; None: a new store), for a build deduplicating
    by `dedup`: its instruction data's signatures are of their answers alone. `conversations`: this build
    reads conversations (--messages-field), whose hashes follow the answer rules (conversations.RULES)."""
    if old is None or dedup == "none":
        return None, None
    hashes, signatures, plain = [], [], []
    for part in old["parts"]:
        if part.get("dedup_version", 1) != DEDUP_VERSION:
            log(f"  dedup     {part['dir']} was hashed by an older longctx (dedup version "
                f"{part.get('dedup_version', 1)}, now {DEDUP_VERSION}): copies of its documents may not be "
                f"found (1: those that differ only in spacing or are short, CJK or Thai; 2: of instruction "
                f"data, hashed then as plain text); rebuild the store to be sure")
        elif conversations and part.get("answer_rules", 1) != RULES and _has_instruction_data(root, part):
            log(f"  dedup     {part['dir']} cut its conversations into answers by older rules (answer rules "
                f"{part.get('answer_rules', 1)}, now {RULES}: an answer that only calls a tool, the answers "
                f"before a template's closing EOS (Phi-3's), a conversation cut after an answer hashed as the "
                f"shorter one): copies of its conversations may not be found; rebuild the store to be sure")
        h, s = store.load_part_docs(root, part)
        hashes.append(h)
        if s is None and dedup == "minhash":
            log(f"  dedup     {part['dir']} has no MinHash signatures (built with another --dedup): only "
                f"exact copies of its documents are removed")
        if s is not None:
            signatures.append(s)
            firsts = store.load_loss_from(root / part["dir"])
            plain.append(np.ones(len(s), bool) if firsts is None else np.asarray(firsts) == 0)
    minhash = dedup == "minhash" and signatures
    return ((np.concatenate(hashes), np.concatenate(signatures) if minhash else None),
            np.concatenate(plain) if minhash else None)


def _has_instruction_data(root: Path, part: dict) -> bool:
    """Whether an earlier part holds documents trained from past their start (instruction data, conversations)."""
    firsts = store.load_loss_from(root / part["dir"])
    return firsts is not None and bool(np.any(np.asarray(firsts) != 0))
