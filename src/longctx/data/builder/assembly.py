"""From scanned shards to a store part: dedup -> embed -> cluster -> split -> pack -> publish, in bounded memory.

The scan (scan.py) left every document's text, tokens, cut points, hashes and head features on
disk. `Assembly` reads them back in input order, one method per stage, and keeps in memory only
what grows slowly with the corpus: a byte or two per document (kept, split), 8 bytes per exact
hash and 12 per LSH band for dedup, the k-means centroids. Everything that grows with the tokens
stays on disk and is read a group at a time:

- dedup: `Deduper` over the documents in input order (the first occurrence is kept), each LSH
  candidate confirmed by the true Jaccard of the two texts' shingle sets; documents already in
  the store (an append) count as seen first;
- embed and cluster: embed.py, cluster.py (unit vectors in a file, chunked spherical k-means);
- split: holdout.py (train and eval items: whole documents, or pieces of long ones);
- pack: clusters (datasculpt) or runs of documents in input order (bfd, concat) a group of about
  `group_tokens` tokens at a time, each group packed on its own and appended to the part's files
  (part_writer.py);
- publish: the part renamed into place, then the manifest written (store.py: a store is complete
  exactly when its manifest lists the part).

Each stage is timed into `records` (timing.py), which the manifest keeps as the part's "stages".
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ...errors import DataError
from ...progress import current, progress_bar
from .. import store
from .cluster import cluster
from .conversations import LAST_ONLY, RULES
from .cut_conversations import cut_hashes, cut_view, eos_text, turn_cuts
from .dedup import VERSION as DEDUP_VERSION
from .dedup import Deduper
from .earlier_parts import stored_documents
from .embed import embed
from .fallback_parts import fallback_starts
from .field_hint import missing_field_hint
from .holdout import IN_BOTH, IN_EVAL, IN_TRAIN, split_items
from .manifest import store_manifest
from .options import BuildOptions
from .pack import pack
from .part_writer import SplitWriter, groups, write_doc_files
from .readers import skipped_text
from .scan import ScannedCorpus, ScannedShard
from .timing import MISSING, timed

SPLIT_FLAG = {"train": IN_TRAIN, "eval": IN_EVAL}


class Assembly:
    """One build's way from its scanned shards to a new part of the store at `root` (whose
    manifest is `old`, None for a new store). `run` calls the stages in order; each leaves what
    the later ones need in named attributes."""

    def __init__(self, opts: BuildOptions, root: Path, old: dict | None, tokenizer, shards: list[ScannedShard],
                 other_suffix: int, work: Path, records: dict, log):
        self.opts, self.root, self.old, self.tokenizer = opts, root, old, tokenizer
        self.work, self.records, self.log = work, records, log
        self.token_dtype = store.token_dtype(tokenizer.vocab_size)
        self.corpus = ScannedCorpus(shards, np.dtype(self.token_dtype).name)
        self.skipped: dict = {}  # reason -> files or documents skipped by the scan
        for shard in shards:
            for reason, count in shard.counts["skipped"].items():
                self.skipped[reason] = self.skipped.get(reason, 0) + count
        if other_suffix:
            self.skipped["other_suffix"] = self.skipped.get("other_suffix", 0) + other_suffix
        # conversations kept but trained on their last answer only (conversations.py): read, not skipped
        self.last_answer_only = self.skipped.pop(LAST_ONLY, 0)
        self.damaged = [name for shard in shards for name in shard.counts.get("damaged", [])]  # corrupt files
        self.files = sum(shard.counts["files"] for shard in shards)
        self.documents_read = self.raw_bytes = 0  # what the stages read: documents, UTF-8 bytes
        self.response_only = 0  # kept documents trained on their response only (instruction data)
        self.answer_gaps = 0  # of those, the ones trained on several spans (conversations' answers)
        self.pairs_dropped = 0  # instruction data longer than a sample, dropped before dedup
        self.eos_at: dict[int, int] = {}  # conversations longer than a sample: corpus document -> cut after an answer
        self.kept_eos_at: dict[int, int] = {}  # the same by kept document
        self.cut_hashes: dict = {}  # their (exact hash, signature) as stored (dedup and a later append compare them)
        self.kept_cut_hashes: dict = {}  # the same by kept document
        self.kept = np.zeros(0, np.int64)  # corpus documents that survive dedup, in input order
        self.lengths = np.zeros(0, np.int64)  # their token counts (EOS included)
        self.names: list[str] = []  # their names
        self.embeddings = None  # embed.Embeddings of the kept documents, or None
        self.clusters: np.ndarray | None = None  # cluster per kept document (datasculpt)
        self.items: dict = {}  # split -> holdout.Items
        self.where = np.zeros(0, np.int8)  # per kept document: IN_TRAIN, IN_EVAL or IN_BOTH
        self.split_info: dict = {}  # the split stage's counts, for the pack record
        self.part_index = self.doc_base = 0  # the new part's number and its first document id
        self.part_dir: Path | None = None  # the part being written (a temporary name until published)
        self.splits: dict = {}  # split -> samples, tokens, documents, packing stats

    def run(self) -> dict:
        """Every stage; the store's new manifest."""
        self.count_inputs()
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            self.dedup()
            self.measure()
            self.embed()
            self.cluster()
            self.split()
            self.pack()
            return self.publish()
        finally:
            if self.embeddings is not None:
                self.embeddings.close()
            self.corpus.close()

    def _stage(self, name: str, fn, *args):
        return timed(self.records, name, self.raw_bytes, self.log, fn, *args)

    # ------------------------------------------------------------------------------------------
    # the stages, in order

    def _say_damaged(self) -> None:
        if self.damaged:  # by name, so they can be repaired: a count alone does not say which
            n = len(self.damaged)
            named = ", ".join(self.damaged[:10]) + (f" and {n - 10:,} more" if n > 10 else "")
            self.log(f"  scan      skipped {n:,} corrupt, unreadable or UTF-16/32 input file(s) (none of their "
                     f"documents kept): {named} (all in the manifest: damaged_files)")

    def count_inputs(self) -> None:
        """What the scan read (up to --max-docs), into the scan stage's record."""
        opts, corpus = self.opts, self.corpus
        if corpus.n == 0:
            self._say_damaged()
            hint = missing_field_hint(opts.inputs, self.skipped, {"--text-field": opts.text_field,
                                                                  "--response-field": opts.response_field})
            raise DataError(f"the inputs ({', '.join(opts.inputs)}) hold no usable document "
                            f"({skipped_text(self.skipped)}). "
                            f"{hint or 'Point --input at text, .jsonl or .parquet data.'}")
        self.documents_read = min(corpus.n, opts.max_docs) if opts.max_docs else corpus.n
        # the limit reached, what lies past its last document is not this build's input: shards scan their files up
        # to --max-docs documents each, and in parallel, so they read past it
        cut = counts_before(corpus.shards, opts.max_docs) if opts.max_docs and corpus.n >= opts.max_docs else None
        if cut is not None:
            skipped, self.files, self.damaged = cut
            self.skipped = {**skipped, **({"other_suffix": self.skipped["other_suffix"]}
                                          if "other_suffix" in self.skipped else {})}
        self._say_damaged()
        self.raw_bytes = int(corpus.per_doc(lambda shard: shard.text_bytes())[:self.documents_read].sum())
        scan = self.records.setdefault("scan", {})
        scan.update(files=self.files, documents=self.documents_read, skipped=dict(sorted(self.skipped.items())),
                    mb=round(self.raw_bytes / 1e6, 2))
        if "seconds" in scan and scan["seconds"]:
            scan["mb_per_s"] = round(self.raw_bytes / 1e6 / scan["seconds"], 2)

    def dedup(self) -> None:
        """Duplicates removed (dedup.py), among the documents a sample can hold: an instruction pair longer
        than a sample is dropped first (cut across samples, its response would be trained without its
        prompt), so that it takes no copy of itself that fits with it."""
        too_long = self._pairs_too_long()
        seen, seen_plain = stored_documents(self.root, self.old, self.opts.dedup, self.log,
                                             bool(self.opts.messages_field))
        bar = progress_bar(self.documents_read, "dedup", "doc", self.opts.progress)
        keep = self._stage("dedup", self._dedup, seen, seen_plain, too_long, bar)
        if bar is not None:
            bar.close()
        self.kept = np.flatnonzero(keep)
        if len(self.kept) == 0:
            raise DataError("every document is a duplicate of one already in the store; nothing to add.")

    def _pairs_too_long(self) -> np.ndarray:
        """[corpus documents] bool: instruction data longer than a sample (counted, said), but for the conversations
        cut after their last answer that fits (--long-conversations truncate), whose lengths become the cut's."""
        # every scanned document's token count (EOS included), read once: measure() takes the kept ones'
        self.corpus_lengths = lengths = self.corpus.per_doc(lambda shard: shard.token_lengths()).astype(np.int64)
        firsts = self.corpus.per_doc(lambda shard: shard.loss_from())
        too_long = (firsts > 0) & (lengths > self.opts.seq_len) & (np.arange(len(lengths)) < self.documents_read)
        if self.opts.long_conversations == "truncate" and too_long.any():
            self.eos_at = turn_cuts(self.corpus, np.flatnonzero(too_long), self.opts.seq_len,
                                     self.tokenizer.eos_id)
            if self.eos_at:
                cut = np.array(list(self.eos_at.items()), dtype=np.int64)
                self.log(f"  dedup     cut {len(cut):,} conversation(s) longer than a sample of {self.opts.seq_len:,} "
                         f"tokens (the longest {int(lengths[cut[:, 0]].max()):,}) after their last answer that fits"
                         f" (--long-conversations drop drops them instead)")
                lengths[cut[:, 0]], too_long[cut[:, 0]] = cut[:, 1] + 1, False  # (the EOS after the cut)
        self.pairs_dropped = dropped = int(too_long.sum())
        if dropped:
            self.skipped["pair_longer_than_sample"] = self.skipped.get("pair_longer_than_sample", 0) + dropped
            kind = "conversation" if self.opts.messages_field else "instruction pair"  # (their own word)
            self.log(f"  dedup     dropped {dropped:,} {kind}(s) longer than a sample of "
                     f"{self.opts.seq_len:,} tokens (the longest {int(lengths[too_long].max()):,}): cut, a "
                     f"response would be trained without its prompt. Raise --seq-len to keep them.")
            if dropped == min(self.documents_read, len(lengths)):
                raise DataError(f"every document is {'a' if self.opts.messages_field else 'an'} {kind} longer than "
                                f"--seq-len {self.opts.seq_len}; raise --seq-len.")
        return too_long

    def measure(self) -> None:
        """The kept documents' token counts and names (the scan tokenized them)."""
        self.lengths = self.corpus_lengths[self.kept]
        # the cut conversations by their index among the kept documents (the store's numbering, less doc_base)
        if self.eos_at:
            docs = np.fromiter(self.eos_at, np.int64)
            at = np.minimum(np.searchsorted(self.kept, docs), len(self.kept) - 1)
            self.kept_eos_at = {int(a): self.eos_at[int(d)] for a, d in zip(at, docs) if self.kept[a] == d}
            self.kept_cut_hashes = {int(a): self.cut_hashes[int(d)] for a, d in zip(at, docs) if self.kept[a] == d}
        self.names = self._kept_names()
        dropped = self.pairs_dropped
        self.records["tokenize"] = {"tokens": int(self.lengths.sum()), "longest": int(self.lengths.max()),
                                    "longer_than_seq_len": int((self.lengths > self.opts.seq_len).sum()),
                                    **({"pairs_dropped": dropped} if dropped else {}),
                                    **({"conversations_truncated": len(self.kept_eos_at)} if self.eos_at else {})}

    def embed(self) -> None:
        """Only where they are used: datasculpt's relevance, or the homogeneity figure (`stats`)."""
        opts = self.opts
        if opts.strategy == "datasculpt" or opts.stats:
            self.embeddings = self._stage("embed", embed, self.corpus, self.kept, self.work / "emb.npy",
                                          opts.embed_model, opts.memory)

    def cluster(self) -> None:
        opts = self.opts
        if opts.strategy == "datasculpt":
            self.clusters = self._stage("cluster", cluster, self.embeddings, self.lengths, opts.seq_len,
                                        opts.clusters, opts.seed, opts.memory)

    def split(self) -> None:
        held = bool(self.old and self.old["totals"]["eval_samples"])  # (an append to a store with an eval split)
        self.items, self.where, self.split_info = split_items(self.corpus, self.kept, self.names, self.lengths,
                                                              self.opts.holdout_len, self.opts.eval_fraction, self.log,
                                                              self.opts.seq_len, fallback=not held,
                                                              held_out=fallback_starts(self.old, self.root))
        # (an append to a store with train samples may add eval documents only: its --eval-fraction is the store's)
        if not self.items["train"].doc and not (self.old and self.old["totals"]["train_samples"]):
            raise DataError("every document landed in the eval split; lower --eval-fraction.")

    def pack(self) -> None:
        """Both splits packed and written into a new part directory, with the per-document files."""
        self.part_index = store.next_part_index(self.old)
        self.doc_base = self.old["totals"]["documents"] if self.old else 0
        store.remove_stale(self.root, self.old)
        self.part_dir = store.new_part_dir(self.root, self.part_index)
        self._stage("pack", self._pack_and_write)
        for split in store.SPLITS:  # an empty split has no files
            if not self.splits[split]["samples"]:
                for f in self.part_dir.glob(f"{split}.*"):
                    f.unlink()

    def _instruction_said(self) -> str:
        """What the build's log says of its instruction data ('' for plain documents only)."""
        if not self.response_only:
            return ""
        several = f", {self.answer_gaps:,} of them on several answers" if self.answer_gaps else ""
        if self.last_answer_only:  # (--answers all, a template that renders earlier answers otherwise as history)
            several += (f"; {self.last_answer_only:,} conversations trained on their last answer only: the chat "
                        f"template renders their earlier answers otherwise once they are history")
        return f" ({self.response_only:,} trained on their responses only{several})"

    def publish(self) -> dict:
        """The part renamed into place, then the manifest that lists it; the manifest."""
        name = store.publish_part(self.part_dir, self.root, self.part_index)
        manifest = store_manifest(self.opts, self.tokenizer, self.token_dtype, self.old, self._part_record(name))
        store.write_manifest(self.root, manifest)
        train, dedup = self.splits["train"], self.records["dedup"]
        self.log(f"data build: wrote {self.opts.shown_as or self.root} ({train['samples']:,} train / "
                 f"{self.splits['eval']['samples']:,} eval samples of {self.opts.seq_len} tokens; fill "
                 f"{self._train_stats()['fill_rate']:.3f}, {len(self.kept):,} documents"
                 f"{self._instruction_said()}, "
                 f"{dedup['exact_duplicates'] + dedup['near_duplicates']:,} duplicates removed, "
                 f"{skipped_text(self.skipped)})")
        return manifest

    # ------------------------------------------------------------------------------------------
    # dedup

    def _dedup(self, seen, seen_plain, too_long, bar) -> tuple[np.ndarray, dict]:
        """Keep mask over the corpus (only the first `documents_read` are read). Signatures are read
        a shard at a time; a candidate's from another shard is one row read from its file (not a
        memory map of every shard, whose touched pages would count as resident)."""
        corpus, read = self.corpus, self.documents_read
        # a conversation cut after an answer is compared as stored (cut_conversations.py), not whole
        closing = eos_text(self.tokenizer) if self.eos_at else ""
        self.cut_hashes = cut = cut_hashes(corpus, self.eos_at, self.opts.dedup == "minhash", closing)

        def signature_of(doc: int) -> np.ndarray:
            if doc in cut:
                return cut[doc][1]
            shard, row = corpus.locate(doc)
            return np.array(corpus.shards[shard].sigs()[row])

        def text_of(doc: int) -> str:
            return cut_view(corpus, self.eos_at, doc, closing)[0] if doc in cut else corpus.text(doc)

        def switches_of(doc: int) -> np.ndarray:
            return cut_view(corpus, self.eos_at, doc, closing)[1] if doc in cut else corpus.get("chars", doc)

        instruction = self.opts.response_field or self.opts.messages_field  # (else no document has switches)
        deduper = Deduper(self.opts.dedup, self.opts.dedup_threshold, text_of=text_of, sig_of=signature_of,
                          switches_of=switches_of if instruction else None)
        if seen is not None:
            deduper.seed(*seen, seen_plain)
        keep = np.zeros(corpus.n, dtype=bool)
        progress = current()  # the dedup stage's phase (timing.py)
        progress.expect(read, "documents")
        for index, shard in enumerate(corpus.shards):
            first = int(corpus.starts[index])
            if first >= read:
                break
            sigs = np.load(shard.path / "sigs.npy") if shard.minhash else None
            for row, h in enumerate(shard.hashes()[:read - first].tolist()):
                if not too_long[first + row]:
                    h, sig = cut.get(first + row, (h, None if sigs is None else sigs[row]))
                    keep[first + row] = deduper.check(first + row, h, sig) is None
            progress.update(min(shard.n, read - first))
            if bar is not None:
                bar.update(shard.n)
        return keep, {"documents_read": read, "exact_duplicates": deduper.exact, "near_duplicates": deduper.near,
                      "kept": int(keep.sum()), "near_candidates_checked": deduper.checked,
                      "near_estimate_disagreed": deduper.disagreed,
                      "index_mb": round((deduper.lsh.nbytes + deduper.hashes.nbytes) / 1e6, 2)}

    def _kept_names(self) -> list[str]:
        names = []
        for shard, rows in self.corpus.kept_in_shards(self.kept):
            all_names = shard.names()
            names.extend(all_names[j] for j in rows.tolist())
        return names

    # ------------------------------------------------------------------------------------------
    # pack

    def _pack_and_write(self) -> tuple[None, dict]:
        opts = self.opts
        bar = progress_bar(int(self.lengths.sum()), "pack", "tok", opts.progress)
        progress = current()  # the pack stage's phase (timing.py): tokens packed, both splits
        progress.expect(sum(int(np.sum(self.items[split].length)) for split in store.SPLITS), "tokens")
        groups_packed = 0
        for split in store.SPLITS:
            writer = SplitWriter(self.part_dir, split, opts.seq_len, self.token_dtype, self.tokenizer.eos_id,
                                 self.corpus, self.kept, self.doc_base, self.kept_eos_at)
            groups_packed += self._pack_split(writer, self.items[split], bar, progress)
            stats = writer.close()
            documents = int(np.isin(self.where, (SPLIT_FLAG[split], IN_BOTH)).sum())
            self.splits[split] = {"samples": stats["samples"], "tokens": stats["tokens"], "documents": documents,
                                  "layout": store.layout_digest(self.part_dir, split),
                                  "stats": stats if stats["samples"] else None}
        if bar is not None:
            bar.close()
        self.response_only, self.answer_gaps = write_doc_files(
            self.part_dir, self.corpus, self.kept, self.names, self.lengths, self.where, opts.dedup == "minhash",
            self.kept_eos_at, self.kept_cut_hashes)
        return None, self._pack_record(groups_packed)

    def _pack_split(self, writer: SplitWriter, items, bar, progress) -> int:
        """One split packed and written group by group; the number of groups."""
        item_doc, item_start, item_len = items.arrays()
        count = 0
        for group in groups(item_doc, item_len, self.clusters, self.opts.group_tokens):
            group = np.sort(group)  # items in document order inside a group, as a global packing sees them
            self._pack_group(writer, item_doc[group], item_start[group], item_len[group])
            count += 1
            progress.update(int(item_len[group].sum()))
            if bar is not None:
                bar.update(int(item_len[group].sum()))
        return count

    def _pack_group(self, writer: SplitWriter, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """The items (document, start, length) of one group, packed and written."""
        opts = self.opts
        vector_of = item_vectors = None
        if self.embeddings is not None:
            unique = np.unique(docs)
            vector_of = dict(zip(unique.tolist(), self.embeddings.rows(unique)))
            item_vectors = np.stack([vector_of[int(d)] for d in docs.tolist()])
        breaks, strong = (None, None) if opts.strategy == "concat" else self._item_breaks(docs, starts, lengths)
        packing = pack(opts.strategy, lengths, opts.seq_len, item_vectors,
                       None if self.clusters is None else self.clusters[docs], breaks, strong)
        writer.write(packing, docs, starts, vector_of)

    def _item_breaks(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[list, list]:
        """Each item's line breaks and paragraph breaks relative to its start (None for an item
        that fits a sample: it is never cut)."""
        breaks, strong = [], []
        for doc, start, length in zip(docs.tolist(), starts.tolist(), lengths.tolist()):
            if length <= self.opts.seq_len:
                breaks.append(None)
                strong.append(None)
                continue
            for found, what in ((breaks, "breaks"), (strong, "strong")):
                at = self.corpus.get(what, int(self.kept[doc])).astype(np.int64)
                found.append(at[(at > start) & (at < start + length)] - start)
        return breaks, strong

    def _train_stats(self) -> dict:
        """The train split's packing figures (those of no sample for an append of eval documents only)."""
        return self.splits["train"]["stats"] or {"samples": 0, "fill_rate": 0.0, "split_fraction": 0.0}

    def _pack_record(self, groups_packed: int) -> dict:
        train = self._train_stats()
        homogeneity = train.get("homogeneity")
        record = {"samples": train["samples"], "fill_rate": round(train["fill_rate"], 4),
                  "split_fraction": round(train["split_fraction"], 4),
                  "homogeneity": None if homogeneity is None else round(homogeneity, 4),
                  "groups": groups_packed, "group_tokens": self.opts.group_tokens, **self.split_info}
        if homogeneity is None:  # the manifest keeps null; the log line says why
            record[MISSING] = {"homogeneity": "not measured without document embeddings" if self.embeddings is None
                               else "no train sample holds two documents"}
        return record

    def _part_record(self, name: str) -> dict:
        dedup = self.records["dedup"]
        return {
            "dir": name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": list(self.opts.inputs),
            "documents": len(self.kept),
            "first_doc": self.doc_base,
            "dedup_version": DEDUP_VERSION,  # how its hashes and signatures were made (dedup.py), for appends
            # how its conversations were cut into answers (conversations.RULES): their hashes, for appends
            **({"answer_rules": RULES} if self.opts.messages_field else {}),
            # its documents' contents, which a data position's store identity reads (data/loader.py)
            "documents_digest": store.documents_digest(self.root / name),
            "counts": {
                "files": self.files, "documents_read": self.documents_read,
                "skipped": dict(sorted(self.skipped.items())), "damaged_files": self.damaged,
                "exact_duplicates": dedup["exact_duplicates"], "near_duplicates": dedup["near_duplicates"],
                "documents_kept": len(self.kept), "tokens": int(self.lengths.sum()), "raw_bytes": self.raw_bytes,
                **({"response_only_documents": self.response_only} if self.response_only else {}),
                **({"answer_gap_documents": self.answer_gaps} if self.answer_gaps else {}),
                **({"last_answer_only": self.last_answer_only} if self.last_answer_only else {}),
            },
            "splits": self.splits,
            "stages": self.records,
        }


def counts_before(shards, cut: int) -> tuple[dict, int, list[str]] | None:
    """(skipped by reason, files opened, damaged files) before the corpus' document `cut` (--max-docs): what a
    scan that stopped there read. None for shards scanned without the record (their totals stand)."""
    skipped: Counter = Counter()
    files = base = 0
    damaged: list[str] = []
    for shard in shards:
        c = shard.counts
        if "skips_at" not in c:
            return None
        for n, reason, count in c["skips_at"]:
            if base + n < cut:
                skipped[reason] += count
        files += sum(base + n < cut for n in c["units_at"])
        damaged += [name for n, name in c.get("damaged_at", []) if base + n < cut]
        base += shard.n
    return dict(sorted(skipped.items())), files, damaged
