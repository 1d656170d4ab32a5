"""Writing a store part: each split packed and written a group at a time, then the per-document files.

Clusters (datasculpt) or runs of items in document order (bfd, concat) are taken a group of about
`group_tokens` tokens at a time (`groups`); each group is packed on its own (pack.py) and its
samples are appended to the part's files (spill.NpyAppender) as soon as it is done
(`SplitWriter`), so memory follows the group, not the corpus. A group's last samples are its only
partly filled ones, so the fill rate is within ~samples per group of one global packing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import store
from . import spill
from .dedup import NUM_PERM
from .holdout import SPLIT_OF
from .pack import DOC, LENGTH, SAMPLE, START, Packing, homogeneity
from .scan import ScannedCorpus


def groups(item_doc: np.ndarray, item_len: np.ndarray, clusters: np.ndarray | None, group_tokens: int):
    """Index arrays of items, each group about `group_tokens` tokens: whole clusters in cluster
    order (datasculpt), else runs of items in document order."""
    if clusters is None:
        order = np.arange(len(item_doc))
        keys = order
    else:
        c = clusters[item_doc]
        order = np.lexsort((np.arange(len(item_doc)), c))
        keys = c[order]
    cur, tokens = [], 0
    bounds = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    for a, b in zip(bounds.tolist(), np.r_[bounds[1:], len(keys)].tolist()):
        for run in _runs(order[a:b], item_len, group_tokens):  # a cluster bigger than a group: in runs
            cur.append(run)
            tokens += int(item_len[run].sum())
            if tokens >= group_tokens:
                yield np.concatenate(cur)
                cur, tokens = [], 0
    if cur:
        yield np.concatenate(cur)


def _runs(idx: np.ndarray, item_len: np.ndarray, group_tokens: int):
    """`idx` cut, in order, into runs of at most about `group_tokens` tokens (one run if it fits)."""
    ends = np.cumsum(item_len[idx])
    if len(ends) == 0 or ends[-1] <= group_tokens:
        yield idx
        return
    cuts = np.searchsorted(ends, np.arange(group_tokens, ends[-1], group_tokens), side="right")
    yield from (r for r in np.split(idx, np.unique(cuts)) if len(r))


class SplitWriter:
    """A split's tokens, segments and sample pointer, appended group by group, and its packing
    figures summed over the groups. Items name documents by their index in `kept` (the corpus
    documents the build keeps); the store numbers them from `doc_base` on."""

    def __init__(self, part: Path, split: str, seq_len: int, token_dtype, pad_id: int, corpus: ScannedCorpus,
                 kept: np.ndarray, doc_base: int, eos_at: dict[int, int] | None = None):
        self.part, self.split, self.seq_len, self.pad = part, split, seq_len, pad_id
        self.corpus, self.kept, self.doc_base = corpus, kept, doc_base
        self.eos_at = eos_at or {}  # kept documents cut after an answer (--long-conversations): where the EOS goes
        self.tokens = spill.NpyAppender(part / f"{split}.tokens.npy", token_dtype, (seq_len,))
        self.segments = spill.NpyAppender(part / f"{split}.segments.npy", np.int64, (5,))
        self.pointer = [0]
        self.samples = 0
        self.stats = {"tokens": 0, "docs": 0, "cut_docs": 0, "pairs": 0, "hom_sum": 0.0, "hom_n": 0}

    def write(self, packing: Packing, item_doc: np.ndarray, item_start: np.ndarray,
              vector_of: dict | None) -> None:
        """A group's packing over its items; `item_doc`/`item_start` map an item to its document
        and offset, `vector_of` a document to its embedding (None without embeddings)."""
        seg = packing.segments
        docs = item_doc[seg[:, DOC]]
        starts = item_start[seg[:, DOC]] + seg[:, START]
        order = np.lexsort((starts, docs, seg[:, SAMPLE]))  # within a sample: by document, then position
        seg, docs, starts = seg[order], docs[order], starts[order]
        sample_ends = np.cumsum(np.bincount(seg[:, SAMPLE], minlength=packing.num_samples))  # in segments
        before = np.cumsum(seg[:, LENGTH]) - seg[:, LENGTH]  # tokens of the group before each segment
        first = np.r_[0, sample_ends[:-1]]  # each sample's first segment
        offset = before - before[first[seg[:, SAMPLE]]]
        rows = np.full((packing.num_samples, self.seq_len), self.pad, dtype=self.tokens.dtype)
        for sample, doc, start, length, at in zip(seg[:, SAMPLE].tolist(), docs.tolist(), starts.tolist(),
                                                  seg[:, LENGTH].tolist(), offset.tolist()):
            rows[sample, at:at + length] = self._tokens(doc, start, length)
        self.tokens.append(rows)
        self.segments.append(np.stack([seg[:, SAMPLE] + self.samples, offset, seg[:, LENGTH], self.doc_base + docs,
                                       starts], axis=1))
        self.pointer.extend((self.pointer[-1] + sample_ends).tolist())
        self.samples += packing.num_samples
        self._count(seg, docs, packing.num_samples, vector_of)

    def _tokens(self, doc: int, start: int, length: int) -> np.ndarray:
        """A kept document's tokens [start, start + length); a conversation cut after an answer ends with the
        EOS (the pad id: the tokenizer's) where it is cut, as one that ended there is stored."""
        cut = self.eos_at.get(doc, start + length)
        tokens = self.corpus.get("tokens", int(self.kept[doc]), start, min(cut, start + length))
        return tokens if cut >= start + length else np.r_[tokens, np.array([self.pad], tokens.dtype)]

    def _count(self, seg: np.ndarray, docs: np.ndarray, num_samples: int, vector_of: dict | None) -> None:
        """The quality figures of one group, added to the split's."""
        s = self.stats
        s["tokens"] += int(seg[:, LENGTH].sum())
        pairs = np.unique(np.stack([docs, seg[:, SAMPLE]], 1), axis=0)  # (document, sample), each once
        udocs, per_doc = np.unique(pairs[:, 0], return_counts=True)
        s["docs"] += len(udocs)
        s["cut_docs"] += int((per_doc > 1).sum())
        s["pairs"] += len(pairs)
        if vector_of is not None and len(pairs):
            local = np.searchsorted(udocs, pairs[:, 0])
            vectors = np.stack([vector_of[int(d)] for d in udocs.tolist()]).astype(np.float64)
            h = homogeneity(np.stack([local, pairs[:, 1]], 1), vectors, num_samples)
            if h["homogeneity"] is not None:
                s["hom_sum"] += h["homogeneity"] * h["multi_doc_samples"]
                s["hom_n"] += h["multi_doc_samples"]

    def close(self) -> dict:
        """Finish the files (header, pointer); the split's packing figures."""
        self.tokens.close()
        self.segments.close()
        np.save(self.part / f"{self.split}.{store.POINTER}.npy", np.asarray(self.pointer, dtype=np.int64))
        s = self.stats
        stats = {
            "samples": self.samples, "tokens": s["tokens"],
            "fill_rate": s["tokens"] / (self.samples * self.seq_len) if self.samples else 0.0,
            "split_fraction": s["cut_docs"] / s["docs"] if s["docs"] else 0.0,
            "docs_per_sample": s["pairs"] / self.samples if self.samples else 0.0,
        }
        if s["hom_n"] or s["pairs"]:
            stats["homogeneity"] = s["hom_sum"] / s["hom_n"] if s["hom_n"] else None
            stats["multi_doc_samples"] = s["hom_n"]
        return stats


def write_doc_files(part: Path, corpus: ScannedCorpus, kept: np.ndarray, names: list[str], lengths: np.ndarray,
                    where: np.ndarray, minhash: bool, eos_at: dict[int, int] | None = None,
                    cut_hashes: dict | None = None) -> tuple[int, int]:
    """docs.jsonl (name, tokens, split per kept document), hashes.npy and, with minhash dedup,
    minhash.npy: what a later append dedups against; loss_from.npy (store.LOSS_FROM) where a kept
    document is trained on its response only (instruction data with a prompt), and store.LOSS_GAPS where
    one pauses its training between answers (a conversation's; one cut after an answer, `eos_at` by kept
    document, keeps the gaps before its cut). Returns how many are of each."""
    with open(part / "docs.jsonl", "w") as f:
        for name, length, went in zip(names, lengths.tolist(), where.tolist()):
            f.write(json.dumps({"name": name, "tokens": length, "split": SPLIT_OF[went]}) + "\n")
    hashes = spill.NpyAppender(part / "hashes.npy", np.uint64)
    sigs = spill.NpyAppender(part / "minhash.npy", np.uint64, (NUM_PERM,)) if minhash else None
    loss_from = spill.NpyAppender(part / store.LOSS_FROM, np.int64)
    gaps = spill.RaggedWriter(part / store.LOSS_GAPS, np.int64)
    masked = gapped = index = 0
    for shard, rows in corpus.kept_in_shards(kept):
        mine_h = np.array(shard.hashes()[rows])
        mine_s = np.array(shard.sigs()[rows], dtype=np.uint64) if sigs is not None else None
        for kept_index, (h, sig) in (cut_hashes or {}).items():  # (a cut conversation: its hash and signature
            if index <= kept_index < index + len(rows):         # as stored)
                mine_h[kept_index - index] = h
                if mine_s is not None and sig is not None:
                    mine_s[kept_index - index] = sig
        hashes.append(mine_h)
        if sigs is not None:
            sigs.append(mine_s)
        firsts = shard.loss_from()[rows]
        loss_from.append(firsts)
        masked += int(np.count_nonzero(firsts))
        offsets, values = shard.gaps(rows)
        for i in range(len(rows)):
            mine = values[offsets[i]:offsets[i + 1]]
            cut = (eos_at or {}).get(index + i)
            mine = mine if cut is None else mine[mine < cut]
            gaps.append(mine)
            gapped += len(mine) > 0
        index += len(rows)
    for writer in (hashes, loss_from, gaps, *([sigs] if sigs is not None else [])):
        writer.close()
    # where no document needs them, the files are not written: the part reads as before they existed
    if not masked:
        (part / store.LOSS_FROM).unlink()
    if not gapped:
        for suffix in (".bin", ".offsets.npy"):
            (part / f"{store.LOSS_GAPS}{suffix}").unlink()
    return masked, gapped
