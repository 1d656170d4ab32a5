"""The store `longctx train` uses when no `data.path` is given: built from `data.corpus` on first
use, cached in `$LONGCTX_CACHE/data` (default `~/.cache/longctx/data`) under a key of everything
that determines it (corpus files with sizes and mtimes, tokenizer and its file's sha256, seq_len,
strategy, dedup, max_docs, eval_fraction, CACHE_VERSION and the builder's scan VERSION: a builder
that keeps other documents bumps one, so an older cached store is never reused; and the store's
format VERSION, which this longctx refuses to read in any other), and reused afterwards.

The store is built complete in a temporary directory next to its final name and renamed into
place, so a concurrent or interrupted build never exposes a half-written store; when two processes
race, the loser discards its copy and uses the winner's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

from ..cache_dir import cache_root
from ..errors import UserError
from . import store
from .builder.inputs import input_files
from .builder.options import BuildOptions
from .builder.pipeline import build_store
from .builder.scan import VERSION as SCAN_VERSION
from .builder.scan import remove_stale_partials
from .store import MANIFEST
from .tokenizer import tokenizer_digest

# 2: near-duplicates confirmed by their true Jaccard; 3: the streaming build (eval pieces); 4: exact dedup keeps
# indentation, short and CJK / Thai documents shingled as they read, tokenizer files' truncation / padding off
# and special-token strings in documents encoded as text (dedup.VERSION 2); 5: a long document's consecutive
# pieces on one side of the eval split are one run of text (concat no longer cuts it inside a sample), token
# dtype from a tokenizer's largest id
CACHE_VERSION = 5


def _fingerprint(corpus: str, tokenizer: str) -> dict:
    # exactly the files the build reads (a clear DataError for a missing or empty corpus)
    root, files, _ = input_files(corpus, "data.corpus")
    h = hashlib.sha256()
    for f in files:
        s = f.stat()
        h.update(f"{f.relative_to(root)}\0{s.st_size}\0{s.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    fp = {"root": str(root), "files": len(files), "digest": h.hexdigest()}
    tok = tokenizer_digest(tokenizer)
    if tok is not None:
        fp["tokenizer"] = tok
    return fp


AUTO_DATASCULPT_FROM = 2048


def resolve_strategy(strategy: str, seq_len: int) -> str:
    """`auto`: below 2048 tokens nearly every document is longer than a sample, so packing has
    nothing to choose and concat (fill 1.0, the fastest) is used; datasculpt from 2048 up."""
    if strategy != "auto":
        return strategy
    return "datasculpt" if seq_len >= AUTO_DATASCULPT_FROM else "concat"


def trained_grid(checkpoint: str) -> int:
    """The eval-split grid of the data a longctx checkpoint trained on: its manifest's holdout_tokens (the
    grid of the stores its run built from data.corpus: train/stages.py holdout_grid), else its
    trained_positions (a run's longest sequence), 0 where neither is known (hf:DIR, no checkpoint):
    the store's own then."""
    from ..config.hf import checkpoint_manifest

    if not checkpoint or checkpoint.startswith("hf:"):
        return 0
    try:
        manifest = checkpoint_manifest(checkpoint)[1]
    except UserError:  # (the eval or bench refuses a bad checkpoint itself, with its own words)
        return 0
    return int(manifest.get("holdout_tokens") or manifest.get("trained_positions", 0))


def default_store(data_cfg, seq_len: int, progress: bool = False, log=print, announce_cached: bool = True,
                  holdout_tokens: int = 0) -> Path:
    """The cached store for this data config and seq_len, built now if it does not exist yet. Its eval
    split is held out on the grid of `holdout_tokens` (builder/holdout.py; 0 = seq_len): a staged run's
    longest stage, so that every stage holds out the same text; for `longctx eval` and `bench decode`,
    the grid the model's own training data was held out on (`trained_grid`)."""
    strategy = resolve_strategy(data_cfg.strategy, seq_len)
    holdout_tokens = 0 if holdout_tokens == seq_len else holdout_tokens  # (the same store as without it)
    key_fields = {
        "version": CACHE_VERSION, "builder": SCAN_VERSION, "store": store.VERSION, "corpus": data_cfg.corpus,
        "tokenizer": data_cfg.tokenizer, "seq_len": seq_len, "strategy": strategy, "dedup": data_cfg.dedup,
        "max_docs": data_cfg.max_docs,
        "eval_fraction": data_cfg.eval_fraction, "fingerprint": _fingerprint(data_cfg.corpus, data_cfg.tokenizer),
        **({"holdout_tokens": holdout_tokens} if holdout_tokens else {}),
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    tag = "stdlib" if data_cfg.corpus == "stdlib" else Path(data_cfg.corpus).name or "corpus"
    final = cache_root() / "data" / f"{tag}-{seq_len}-{strategy}-{key}"
    if (final / MANIFEST).is_file():
        if announce_cached:
            log(f"data: using the cached store {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # a build killed outright (SIGKILL, the OOM killer) leaves its half-written store: removed by the next
    # build on the same host once its process is gone (the cache may be shared by hosts: only this one's)
    host = socket.gethostname()
    remove_stale_partials(final.parent, ".tmp-*@*-*", host=host)
    tmp = final.parent / f".tmp-{final.name}@{host}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"data: building the store for {data_cfg.corpus} at seq_len {seq_len} (first use; cached in {final})")
    try:
        build_store(BuildOptions(
            inputs=[data_cfg.corpus], out=str(tmp), seq_len=seq_len, tokenizer=data_cfg.tokenizer,
            strategy=strategy, dedup=data_cfg.dedup, workers=data_cfg.workers,
            eval_fraction=data_cfg.eval_fraction, holdout_tokens=holdout_tokens, max_docs=data_cfg.max_docs,
            stats=False, progress=progress,
            shown_as=str(final)), log=log)
        (tmp / "cache_key.json").write_text(json.dumps(key_fields, indent=1, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            # another process published the same store first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
