"""A store's manifest after a build or an append: its settings, its parts and the totals and
packing figures of all of them (samples of different parts never mix, so the store's figures are
the parts' figures weighted by their samples or documents)."""

from __future__ import annotations

import numpy as np

from ...config.tokenizer import tokenizer_identity
from .. import store
from ..store_template import store_record
from .options import BuildOptions


def store_version(parts: list[dict]) -> int:
    """The oldest format that holds what the parts train on: a longctx that reads only older ones refuses the
    store rather than train on its prompts (instruction pairs) or its user turns (conversations' answers)."""
    if any(map(store.answer_gap_documents, parts)):
        return store.GAPS_VERSION
    return store.MASKED_VERSION if any(map(store.response_only_documents, parts)) else store.VERSION


def store_manifest(opts: BuildOptions, tokenizer, token_dtype, old: dict | None, part: dict) -> dict:
    """The manifest of the store `old` (None: a new store) with `part` added."""
    parts = (old["parts"] if old else []) + [part]
    return {
        "format": store.FORMAT,
        "version": store_version(parts),
        "seq_len": opts.seq_len,
        "strategy": opts.strategy,
        "dedup": opts.dedup,
        "eval_fraction": opts.eval_fraction,
        "holdout_tokens": opts.holdout_len,
        "seed": opts.seed,
        "tokenizer": {"spec": opts.tokenizer, "name": tokenizer.name, "identity": tokenizer_identity(opts.tokenizer),
                      "vocab_size": int(tokenizer.vocab_size),
                      "eos_id": int(tokenizer.eos_id), "pad_id": int(tokenizer.eos_id),
                      "text_prefix": tokenizer.text_prefix(),  # what each document begins with
                      **_chat_template(opts, old)},
        "token_dtype": np.dtype(token_dtype).name,
        "inputs": [i for p in parts for i in p["inputs"]],
        "totals": _totals(parts),
        "packing": _packing(parts, opts.seq_len),
        "parts": parts,
    }


def _chat_template(opts: BuildOptions, old: dict | None) -> dict:
    """The template conversations were rendered with (data/store_template.py): the scan's, with the earlier parts
    whose template is not known listed apart, else the store's."""
    if opts.messages_field:
        recorded = store_record(opts.chat_template, old)
    else:
        recorded = (old or {}).get("tokenizer", {}).get("chat_template")
    return {"chat_template": recorded} if recorded else {}


def _totals(parts: list[dict]) -> dict:
    totals = {"documents": 0, "tokens": 0, "duplicates_removed": 0, "files_skipped": 0,
              "train_samples": 0, "eval_samples": 0}
    for p in parts:
        c = p["counts"]
        totals["documents"] += c["documents_kept"]
        totals["tokens"] += c["tokens"]
        totals["duplicates_removed"] += c["exact_duplicates"] + c["near_duplicates"]
        totals["files_skipped"] += sum(c["skipped"].values())
        totals["train_samples"] += p["splits"]["train"]["samples"]
        totals["eval_samples"] += p["splits"]["eval"]["samples"]
    return totals


def _packing(parts: list[dict], seq_len: int) -> dict:
    """Per split with samples: fill rate, split fraction, documents per sample, homogeneity."""
    packing = {}
    for split in store.SPLITS:
        rows = [p["splits"][split] for p in parts if p["splits"][split]["samples"]]
        if not rows:
            continue
        samples = sum(r["samples"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        docs = sum(r["documents"] for r in rows)
        packing[split] = {
            "fill_rate": tokens / (samples * seq_len),
            "split_fraction": sum(r["stats"]["split_fraction"] * r["documents"] for r in rows) / max(docs, 1),
            "docs_per_sample": sum(r["stats"]["docs_per_sample"] * r["samples"] for r in rows) / samples,
            "homogeneity": (sum(r["stats"]["homogeneity"] * r["samples"] for r in rows) / samples
                            if all(r["stats"].get("homogeneity") is not None for r in rows) else None),
        }
    return packing
