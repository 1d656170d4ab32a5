"""`longctx data build`: inputs -> read -> dedup -> tokenize -> embed -> cluster -> pack -> store.

Each stage shows a progress bar and reports its counts and its throughput in MB/s of raw input
text (the UTF-8 bytes of the documents read), all of which also go into the manifest. Train and
eval samples are packed separately: a document is in the eval split when the hash of its name
says so (data/samples.py `is_eval_doc`), the same rule the trainer has always used.

A build writes one new part (store.py) and then the manifest; `append=True` adds a part to an
existing store, removing documents that duplicate ones already stored, without touching the
existing parts. Nothing is written before reading, dedup and tokenisation have succeeded, and the
manifest is written last, so a failed or interrupted build never leaves a store that looks complete.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..progress import progress_bar
from . import store as st
from .cluster import cluster as make_clusters
from .dedup import deduplicate
from .embed import embed
from .pack import STRATEGIES, pack, packing_stats
from .readers import read_inputs
from .samples import is_eval_doc
from .tokenize import tokenize
from .tokenizer import load_tokenizer

DEDUP_MODES = ("minhash", "exact", "none")


@dataclass
class BuildOptions:
    inputs: list[str]
    out: str
    seq_len: int
    tokenizer: str = "byte"
    strategy: str = "datasculpt"
    dedup: str = "minhash"
    workers: int = 2
    text_field: str = "text"
    eval_fraction: float = 0.0
    seed: int = 0
    embed_model: str = ""
    dedup_threshold: float = 0.8
    max_docs: int = 0
    append: bool = False
    stats: bool = True  # embeddings (and homogeneity) also for concat / bfd
    progress: bool = True
    clusters: int = 0  # 0 = automatic
    shown_as: str = ""  # the path messages name, when `out` is a temporary directory renamed into it after


@dataclass
class _Stages:
    raw_bytes: int = 0
    records: dict = field(default_factory=dict)


@contextmanager
def _stage(stages: _Stages, name: str, log):
    t0 = time.perf_counter()
    rec: dict = {}
    yield rec
    dt = time.perf_counter() - t0
    rec["seconds"] = round(dt, 3)
    rec["mb_per_s"] = round(stages.raw_bytes / 1e6 / dt, 2) if dt > 0 and stages.raw_bytes else None
    stages.records[name] = rec
    counts = ", ".join(f"{k} {v}" for k, v in rec.items() if k not in ("seconds", "mb_per_s"))
    log(f"  {name:<9} {dt:6.2f}s" + (f"  {rec['mb_per_s']:8.1f} MB/s" if rec["mb_per_s"] else "")
        + (f"  {counts}" if counts else ""))


def check_options(o: BuildOptions) -> None:
    problems = []
    if o.seq_len < 2:
        problems.append(f"--seq-len must be at least 2 tokens, got {o.seq_len}.")
    if o.strategy not in STRATEGIES:
        problems.append(f"--strategy {o.strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if o.dedup not in DEDUP_MODES:
        problems.append(f"--dedup {o.dedup!r} is not one of {', '.join(DEDUP_MODES)}.")
    if o.workers < 1:
        problems.append(f"--workers must be >= 1, got {o.workers}.")
    if not 0 <= o.eval_fraction < 1:
        problems.append(f"--eval-fraction must be in [0, 1), got {o.eval_fraction}.")
    if not 0 < o.dedup_threshold <= 1:
        problems.append(f"--dedup-threshold must be in (0, 1], got {o.dedup_threshold}.")
    if problems:
        raise DataError(" ".join(problems))


def build_store(o: BuildOptions, log=print) -> dict:
    """Build (or append to) the store at `o.out`; returns its manifest."""
    check_options(o)
    root = Path(o.out)
    old = None
    if (root / st.MANIFEST).is_file():
        if not o.append:
            raise DataError(f"'{root}' already holds a data store; pass --append to add documents to it, or "
                            f"choose another --out.")
        old = st.read_manifest(root)
        for key, want in (("seq_len", o.seq_len), ("strategy", o.strategy)):
            if old[key] != want:
                raise DataError(f"the store '{root}' was built with {key} {old[key]}; an append must use the same "
                                f"(got {want}).")
        if old["tokenizer"]["spec"] != o.tokenizer:
            raise DataError(f"the store '{root}' was built with tokenizer {old['tokenizer']['spec']!r}; an append "
                            f"must use the same (got {o.tokenizer!r}).")
    elif root.exists() and not root.is_dir():
        raise DataError(f"--out '{root}' exists and is not a directory.")
    tok = load_tokenizer(o.tokenizer)
    dtype = st.token_dtype(tok.vocab_size)
    stages = _Stages()
    shown = o.shown_as or root
    log(f"data build: {', '.join(o.inputs)} -> {shown} (seq_len {o.seq_len}, {o.strategy}, dedup {o.dedup}, "
        f"{tok.name} tokenizer, {o.workers} worker{'s' if o.workers != 1 else ''})")

    with _stage(stages, "read", log) as rec:
        res = read_inputs(o.inputs, o.text_field, o.max_docs)
        stages.raw_bytes = res.bytes
        rec.update(files=res.files, documents=len(res.docs), skipped=dict(sorted(res.skipped.items())),
                   mb=round(res.bytes / 1e6, 2))
    if not res.docs:
        raise DataError(f"the inputs ({', '.join(o.inputs)}) hold no usable document; skipped: "
                        f"{dict(res.skipped) or 'nothing'}. Point --input at text, .jsonl or .parquet data.")
    texts = [d.text for d in res.docs]

    with _stage(stages, "dedup", log) as rec:
        seen_h, seen_s = _seen(root, old, o.dedup)
        bar = progress_bar(len(texts), "dedup", "doc", o.progress)
        dd = deduplicate(texts, o.dedup, o.dedup_threshold, o.workers, seen_h, seen_s)
        if bar is not None:
            bar.update(len(texts))
            bar.close()
        rec.update(exact_duplicates=dd.exact_duplicates, near_duplicates=dd.near_duplicates,
                   kept=int(dd.keep.sum()), near_candidates_checked=dd.candidates_checked,
                   near_estimate_disagreed=dd.estimate_disagreed)
    keep = np.flatnonzero(dd.keep)
    docs = [res.docs[i] for i in keep]
    texts = [texts[i] for i in keep]
    if not docs:
        raise DataError("every document is a duplicate of one already in the store; nothing to add.")

    with _stage(stages, "tokenize", log) as rec:
        bar = progress_bar(len(texts), "tokenize", "doc", o.progress)
        tk = tokenize(texts, tok, o.workers, progress=bar)
        if bar is not None:
            bar.close()
        lengths = tk.lengths
        rec.update(tokens=int(lengths.sum()), longest=int(lengths.max()),
                   longer_than_seq_len=int((lengths > o.seq_len).sum()))

    emb = clusters = None
    if o.strategy == "datasculpt" or o.stats:
        with _stage(stages, "embed", log) as rec:
            emb = embed(texts, o.embed_model, o.workers, o.seed)
            rec.update(dim=int(emb.shape[1]), model=o.embed_model or "hashed-tfidf-svd")
    if o.strategy == "datasculpt":
        with _stage(stages, "cluster", log) as rec:
            clusters = make_clusters(emb, lengths, o.seq_len, o.clusters, o.seed)
            rec.update(clusters=int(clusters.max()) + 1)

    is_eval = np.array([is_eval_doc(d.name, o.eval_fraction) for d in docs], dtype=bool)
    split_docs = {"train": np.flatnonzero(~is_eval), "eval": np.flatnonzero(is_eval)}
    if len(split_docs["train"]) == 0:
        raise DataError("every document landed in the eval split; lower --eval-fraction.")
    packings, pack_stats = {}, {}
    with _stage(stages, "pack", log) as rec:
        for split, idx in split_docs.items():
            if len(idx) == 0:
                continue
            sub = lambda arrs: None if arrs is None else [arrs[i] for i in idx]  # noqa: E731
            p = pack(o.strategy, lengths[idx], o.seq_len,
                     None if emb is None else emb[idx], None if clusters is None else clusters[idx],
                     sub(tk.breaks), sub(tk.strong))
            packings[split] = p
            pack_stats[split] = packing_stats(p, len(idx), None if emb is None else emb[idx])
        t = pack_stats["train"]
        rec.update(samples=t["samples"], fill_rate=round(t["fill_rate"], 4),
                   split_fraction=round(t["split_fraction"], 4),
                   homogeneity=None if t.get("homogeneity") is None else round(t["homogeneity"], 4))

    index = len(old["parts"]) if old else 0
    doc_base = old["totals"]["documents"] if old else 0
    st.remove_stale(root, old) if root.is_dir() else None
    with _stage(stages, "write", log) as rec:
        tmp = st.new_part_dir(root, index)
        split_info = {}
        for split in st.SPLITS:
            if split in packings:
                idx = split_docs[split]
                doc_map = idx  # packing document j of this split is part document idx[j]
                info = st.write_split(tmp, split, packings[split], [tk.tokens[i] for i in idx], doc_base,
                                      doc_map, dtype, tok.eos_id)
                info.update(documents=int(len(idx)), stats=pack_stats[split])
            else:
                info = {"samples": 0, "tokens": 0, "documents": 0, "stats": None}
            split_info[split] = info
        with open(tmp / "docs.jsonl", "w") as f:
            for d, n, ev in zip(docs, lengths.tolist(), is_eval.tolist()):
                f.write(json.dumps({"name": d.name, "tokens": n, "split": "eval" if ev else "train"}) + "\n")
        np.save(tmp / "hashes.npy", dd.hashes[keep])
        if dd.signatures is not None:
            np.save(tmp / "minhash.npy", dd.signatures[keep])
        name = st.publish_part(tmp, root, index)
        rec.update(part=name, bytes=sum(p.stat().st_size for p in (root / name).iterdir()))

    part = {
        "dir": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": list(o.inputs),
        "documents": len(docs),
        "first_doc": doc_base,
        "counts": {
            "files": res.files, "documents_read": len(res.docs), "skipped": dict(sorted(res.skipped.items())),
            "exact_duplicates": dd.exact_duplicates, "near_duplicates": dd.near_duplicates,
            "documents_kept": len(docs), "tokens": int(lengths.sum()), "raw_bytes": res.bytes,
        },
        "splits": split_info,
        "stages": stages.records,
    }
    manifest = _manifest(o, tok, dtype, old, part)
    st.write_manifest(root, manifest)
    tr = split_info["train"]
    log(f"data build: wrote {shown} ({tr['samples']:,} train / {split_info['eval']['samples']:,} eval samples of "
        f"{o.seq_len} tokens; fill {tr['stats']['fill_rate']:.3f}, {len(docs):,} documents, "
        f"{dd.exact_duplicates + dd.near_duplicates:,} duplicates removed, {sum(res.skipped.values()):,} skipped)")
    return manifest


def _seen(root: Path, old: dict | None, mode: str):
    if old is None or mode == "none":
        return None, None
    hs, ss = [], []
    for part in old["parts"]:
        h, s = st.load_part_docs(root, part)
        hs.append(h)
        if s is not None:
            ss.append(s)
    sigs = np.concatenate(ss) if mode == "minhash" and ss else None
    return np.concatenate(hs), sigs


def _manifest(o: BuildOptions, tok, dtype, old: dict | None, part: dict) -> dict:
    parts = (old["parts"] if old else []) + [part]
    totals: dict = {"documents": 0, "tokens": 0, "duplicates_removed": 0, "files_skipped": 0,
                    "train_samples": 0, "eval_samples": 0}
    for p in parts:
        c = p["counts"]
        totals["documents"] += c["documents_kept"]
        totals["tokens"] += c["tokens"]
        totals["duplicates_removed"] += c["exact_duplicates"] + c["near_duplicates"]
        totals["files_skipped"] += sum(c["skipped"].values())
        totals["train_samples"] += p["splits"]["train"]["samples"]
        totals["eval_samples"] += p["splits"]["eval"]["samples"]
    # packing figures of the whole store (samples of different parts never mix)
    packing = {}
    for split in st.SPLITS:
        rows = [p["splits"][split] for p in parts if p["splits"][split]["samples"]]
        if not rows:
            continue
        samples = sum(r["samples"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        docs = sum(r["documents"] for r in rows)
        packing[split] = {
            "fill_rate": tokens / (samples * o.seq_len),
            "split_fraction": sum(r["stats"]["split_fraction"] * r["documents"] for r in rows) / max(docs, 1),
            "docs_per_sample": sum(r["stats"]["docs_per_sample"] * r["samples"] for r in rows) / samples,
            "homogeneity": (sum(r["stats"]["homogeneity"] * r["samples"] for r in rows) / samples
                            if all(r["stats"].get("homogeneity") is not None for r in rows) else None),
        }
    return {
        "format": st.FORMAT,
        "version": st.VERSION,
        "seq_len": o.seq_len,
        "strategy": o.strategy,
        "dedup": o.dedup,
        "eval_fraction": o.eval_fraction,
        "seed": o.seed,
        "tokenizer": {"spec": o.tokenizer, "name": tok.name, "vocab_size": int(tok.vocab_size),
                      "eos_id": int(tok.eos_id), "pad_id": int(tok.eos_id)},
        "token_dtype": np.dtype(dtype).name,
        "inputs": [i for p in parts for i in p["inputs"]],
        "totals": totals,
        "packing": packing,
        "parts": parts,
    }
