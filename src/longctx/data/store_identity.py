"""A packed store's identity as a checkpoint's data position records it (data/loader.py BatchLoader's
`store`): what says "the same content" (`store_identity`), how its samples were packed (`layout_of`), and the
words that describe a record to a user when a resume finds another store (`describe_store`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .store import part_documents_digest

# What says "the same content" of a store (store_identity): its build settings, each part's counts (from the
# manifest) and a digest of its documents' contents (store.py part_documents_digest, from the per-document hashes
# the builder keeps for dedup: 8 bytes a document, never the token arrays). Not its path, the parts' creation
# times or the stages' timings, so a store moved, or rebuilt from the same inputs with the same settings, keeps
# its identity; not float statistics (fill rate, homogeneity), which an identical rebuild on other hardware may
# round differently; and only named count keys, so a builder that records a new count does not change the
# identity of the same content. Beside it, apart so that a store built before keeps the identity its checkpoints
# hold, `layout`: how the samples are packed, where the builder recorded it (store.py layout_digest: the same
# documents packed in other groups, as another --max-memory packs them, are other samples at the same cursor).
PART_COUNTS = ("files", "documents_read", "raw_bytes", "exact_duplicates", "near_duplicates", "documents_kept",
               "tokens")
SPLIT_COUNTS = ("samples", "tokens", "documents")


def store_identity(manifest: dict, root: Path | None = None) -> dict:
    """The store's identity as a data position records it: `identity` (a digest of its settings and each
    part's inputs, counts and, given the store's `root`, documents' contents) and, to say what differs, its
    inputs, documents, tokens and train samples."""
    # (every key read with .get: a store written by other tools than the builder may lack the optional ones)
    tok, t = manifest.get("tokenizer", {}), manifest.get("totals", {})
    content = {
        **{k: manifest.get(k) for k in ("seq_len", "strategy", "dedup", "seed", "eval_fraction", "holdout_tokens")},
        # the tokenizer's recorded content hash (its spec where a store predates it: never the file read now)
        "tokenizer": [tok.get("identity") or tok.get("spec"), tok.get("vocab_size"), tok.get("text_prefix", [])],
        "inputs": manifest.get("inputs", []),
        "parts": [{"inputs": p.get("inputs"), "first_doc": p.get("first_doc"),
                   "counts": {k: p.get("counts", {}).get(k) for k in PART_COUNTS},
                   "splits": {s: {k: c.get(k) for k in SPLIT_COUNTS} for s, c in sorted(p.get("splits", {}).items())},
                   "documents": None if root is None else part_documents_digest(root, p)}
                  for p in manifest.get("parts", [])],
    }
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    layouts = [c.get("layout") for p in manifest.get("parts", []) for _, c in sorted(p.get("splits", {}).items())]
    return {"identity": digest, "inputs": list(manifest.get("inputs", [])), "documents": t.get("documents", 0),
            "tokens": t.get("tokens", 0), "train_samples": t.get("train_samples", 0),
            **({"layout": layout_of(layouts)} if layouts and all(layouts) else {})}


def layout_of(digests: list[str]) -> str:
    """One digest of several packing layouts (a store's splits; a mix's stores)."""
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:16]


def repacked(saved: dict, now: dict) -> bool:
    """Both records say how their store was packed (a position saved, or a store built, before layouts were
    recorded says nothing: not checked), and they differ."""
    return bool(saved.get("layout") and now.get("layout")) and saved["layout"] != now["layout"]


def describe_store(record: dict) -> str:
    inputs = ", ".join(record["inputs"]) or "inputs it does not name"
    if record.get("mix"):  # (a mix of stores: data/store_mix.py mix_identity)
        inputs = f"a mix of {', '.join(record['mix'])}"
    return (f"built from {inputs} ({record['documents']:,} documents, {record['tokens']:,} tokens, "
            f"{record['train_samples']:,} train samples; identity {record['identity']})")
