"""The scan stage of a build: input units -> shards -> per-document work, in worker processes.

The inputs' files (units) are cut, in input order, into shards of about `SHARD_BYTES` bytes on
disk. A worker reads a shard as a stream, one document at a time, and does everything a document
needs on its own: normalise, exact hash, MinHash signature, tokens with their cut points, and
hashed head features. It writes them to the shard's directory (spill.py files, nothing kept in
memory) and renames the directory into place, synced, when the shard is complete, so an interrupted
build (also by a power loss) redoes only the shards that have no directory yet. A file found damaged
after it yielded documents gives none: they are rolled back (readers.py says why). Everything after
the scan (dedup, embed, cluster, pack, write: assembly.py) reads these files in input order, through
`ScannedCorpus`.

`--shard i/n` runs the scan of the i-th of n contiguous runs of the shards (balanced by bytes):
n machines scan a corpus too big for one, and `longctx data merge` finishes the build from all
their scan directories, exactly as one machine would have from its own.

Workers are started with `spawn`: they import only this module's dependencies (numpy, zlib, the
tokenizer), ~35 MB each, whatever the parent has loaded. A worker that fails or dies (the
out-of-memory killer) stops them all, said once, with the files it read (scan_pool.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter, OrderedDict
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...durable import fsync_path, publish
from ...errors import DataError
from ..tokenizer import load_tokenizer, tokenizer_digest
from . import spill
from .conversations import RULES, Conversations
from .inputs import SCAN_FORMAT, SCAN_PLAN, input_files, read_once, unit_size
from .readers import iter_file
from .scan_pool import scan_in_workers
from .scan_progress import ShardReport, ShardsRead, in_worker, worker_setter
from .shard_files import ShardFiles

SHARD_BYTES = 16 << 20
FORMAT = SCAN_FORMAT
# 2: shards hashed by dedup.py's VERSION 2; 3: features of unspaced scripts by character (features.py);
# 4: a document starts with its tokenizer's text_prefix (tokenize.py); 5: a corrupt compressed file yields no
# document (readers.py: also none of the lines before the damage), its name recorded; 6: each document's
# first token trained on (loss_from.npy: instruction pairs, --response-field); 7: its gaps in training (gaps.bin:
# a conversation's turns between its answers); 8: where its characters switch (chars.bin), instruction data hashed
# by its pieces and signed by its answers (dedup.py); 9: a file unreadable part-way yields no document, named
VERSION = 9
PLAN = SCAN_PLAN
SHARDS = "shards"
OPEN_READERS = 64  # ScannedCorpus keeps at most this many shard files open


@dataclass(frozen=True)
class ScanOptions:
    """What the scan of a document depends on: a scan directory is only reused or merged under
    the same ones."""
    tokenizer: str
    dedup: str
    text_field: str
    response_field: str = ""  # records as instruction pairs (readers.py iter_file); '' = plain documents
    messages_field: str = ""  # records as conversations, rendered by the chat template (conversations.py)
    answers: str = "all"  # a conversation's answers trained on: all, or the last (conversations.py ANSWERS)


@dataclass(frozen=True)
class Unit:
    path: str  # the file read
    name: str  # the name its documents carry (relative to its input)
    size: int  # bytes on disk


def plan_units(inputs: list[str], out: str | Path | None = None) -> tuple[list[Unit], int]:
    """Every input file in read order, and the count skipped for their suffix. Files inside `out` (the
    build's own store or scan directory, when it lies inside an input directory) are never inputs: a
    rerun or an append would read its manifest, work files and docs.jsonl as documents."""
    if not inputs:
        raise DataError("no input given; pass --input with a directory, a .jsonl or .parquet file, or 'stdlib'.")
    own = Path(out).resolve() if out else None
    units, other, seen = [], 0, set()
    for spec in inputs:
        root, files, skipped = input_files(spec)
        other += skipped
        units.extend(Unit(str(f), f.relative_to(root).as_posix(), unit_size(f)) for f in read_once(files, seen)
                     if own is None or own not in f.resolve().parents)
    return units, other


def plan_shards(units: list[Unit], shard_bytes: int = 0) -> list[list[Unit]]:
    """Consecutive units grouped into shards of about `shard_bytes` (default SHARD_BYTES; a bigger
    file is one shard)."""
    shard_bytes = shard_bytes or SHARD_BYTES
    shards, cur, size = [], [], 0
    for u in units:
        if cur and size + u.size > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += u.size
    if cur:
        shards.append(cur)
    return shards


def machine_range(shards: list[list[Unit]], i: int, n: int) -> range:
    """The shards machine i of n scans: contiguous, balanced by bytes."""
    sizes = np.array([sum(u.size for u in s) for s in shards], dtype=np.float64)
    ends = np.cumsum(sizes)
    total = ends[-1] if len(ends) else 0.0
    lo = int(np.searchsorted(ends, total * i / n, side="right")) if i else 0
    hi = int(np.searchsorted(ends, total * (i + 1) / n, side="right")) if i + 1 < n else len(shards)
    return range(lo, max(lo, hi))


def plan_digest(units: list[Unit], opts: ScanOptions) -> str:
    """What every machine of a build must agree on: the inputs' names and sizes, the scan options, the
    tokenizer file's content (and its chat template's, for conversations) and this scan's version."""
    tok = tokenizer_digest(opts.tokenizer)
    if opts.messages_field:  # (a template revised beside an unchanged tokenizer.json renders other documents)
        # (and how its answers are found: a scan of an earlier longctx holds other documents, conversations.RULES)
        tok = [tok, Conversations(opts.tokenizer, opts.messages_field, opts.answers).template.digest(), RULES]
    h = hashlib.sha256(json.dumps([VERSION, asdict(opts), tok, [asdict(u) for u in units]]).encode())
    return h.hexdigest()[:16]


def resume_key(units: list[Unit], max_docs: int) -> str:
    """What else the shards already scanned in a work directory depend on, checked when a build
    resumes (not when scans of several machines are merged: their copies' mtimes differ): each input
    file's mtime (a file rewritten in place at the same size) and --max-docs (a shard that stopped
    at the old limit)."""
    def mtime(path: str) -> int:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return 0
    h = hashlib.sha256(json.dumps([max_docs, [[u.path, mtime(u.path)] for u in units]]).encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# One shard, in a worker


def shard_dir(work: Path, index: int) -> Path:
    return work / SHARDS / f"{index:06d}"


def scan_shard(work: str, index: int, units: list[Unit], opts: ScanOptions, token_dtype: str,
               max_docs: int = 0, on_read=None) -> dict:
    """Scan one shard into `work/shards/INDEX` (atomically); returns its counts. `on_read(bytes)`, if given,
    is told the bytes of its files read so far, while a file is read too (progress: scan_progress.py)."""
    final = shard_dir(Path(work), index)
    if (final / "shard.json").is_file():
        return json.loads((final / "shard.json").read_text())
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = load_tokenizer(opts.tokenizer)
    conversations = Conversations(opts.tokenizer, opts.messages_field, opts.answers) if opts.messages_field else None
    files = ShardFiles(tmp, token_dtype, opts.dedup == "minhash")
    skipped: Counter = Counter()
    damaged: list[str] = []
    # with --max-docs, where each skip and each unit fell (the shard's documents before it): the build counts
    # only those before its last document (assembly.py), not the ones a shard read past the corpus' limit
    where = _Where(skipped) if max_docs else None
    report = ShardReport(on_read)
    for u in units:
        mark, hurt = files.mark(), len(damaged)
        if where is not None:
            where.unit(files.n)
        for doc in iter_file(Path(u.path), u.name, opts.text_field, skipped, damaged, opts.response_field,
                             conversations, report.position):
            report.document()
            if where is not None:
                where.skips(files.n)
            files.add(doc, tok)
            if max_docs and files.n >= max_docs:
                break
        if where is not None:
            where.skips(files.n)
        if len(damaged) > hurt:
            files.rollback(mark)  # a damaged file gives no document (readers.py)
            if where is not None:
                where.rolled_back(files.n, damaged[hurt:])
        report.unit_done(u.size)
        if max_docs and files.n >= max_docs:
            break
    files.close()
    counts = {"index": index, "documents": files.n, "files": len(units), "bytes": files.raw,
              "skipped": dict(sorted(skipped.items())), "damaged": damaged,
              **({"skips_at": where.skips_at, "units_at": where.units_at, "damaged_at": where.damaged_at}
                 if where is not None else {})}
    (tmp / "shard.json").write_text(json.dumps(counts) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    # on the disk before it is published: a build resumed after a power loss trusts every shard that has
    # its shard.json, and would read files the disk never got (zeros, or cut short) as the documents
    for f in tmp.iterdir():
        fsync_path(f)
    publish(tmp, final)
    return counts


class _Where:
    """Where a shard's skips and units fell: `skips_at` [documents before, reason, count], `units_at` the
    documents before each unit opened."""

    def __init__(self, skipped: Counter):
        self.skipped, self.seen = skipped, Counter()
        self.skips_at: list[list] = []
        self.units_at: list[int] = []
        self.damaged_at: list[list] = []  # [documents before, name] of each damaged unit

    def unit(self, n: int) -> None:
        self.units_at.append(n)

    def skips(self, n: int) -> None:
        for reason, count in sorted((self.skipped - self.seen).items()):
            self.skips_at.append([n, reason, count])
        self.seen = Counter(self.skipped)

    def rolled_back(self, n: int, names: list[str]) -> None:
        for entry in self.skips_at:  # (the damaged unit's documents are gone)
            entry[0] = min(entry[0], n)
        self.damaged_at += [[n, name] for name in names]


def _scan_star(args) -> dict:
    return scan_shard(*args, on_read=worker_setter(args[1]))


def remove_stale_partials(shards_dir: Path, pattern: str = ".tmp-*", host: str | None = None) -> None:
    """Delete the half-written shards of a killed scan (`.tmp-N-PID` whose process is gone): they
    would be written again from the start anyway, and a large corpus leaves many. (`pattern`: other
    half-written directories named ...-PID, e.g. a killed default store's; `host`: only those named
    ...@HOST-PID, exactly this host: a glob's `*` would take host node1-2's for node1's.)"""
    if not shards_dir.is_dir():
        return
    for p in shards_dir.glob(pattern):
        rest, _, pid = p.name.rpartition("-")
        if host is not None and rest.rpartition("@")[2] != host:
            continue  # (another host's: its pid says nothing here)
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def run_scans(work: Path, shards: list[list[Unit]], todo: range, opts: ScanOptions, token_dtype: str,
              workers: int, max_docs: int = 0, on_done=None, read: ShardsRead | None = None) -> list[dict]:
    """Scan the shards `todo` (skipping complete ones) in `workers` processes; counts in shard order.
    With `max_docs`, shards are scanned in order only until that many documents are read.
    `on_done(counts, bytes)` is called as each shard is done; `read` (made for `workers`) is kept the
    bytes read of each shard, as the scan goes."""
    remove_stale_partials(work / SHARDS)
    jobs = [(str(work), i, shards[i], opts, token_dtype, max_docs) for i in todo]
    read = read or ShardsRead(len(shards), workers)
    results: dict[int, dict] = {}
    done_docs = 0

    def finished(c: dict) -> None:
        nonlocal done_docs
        results[c["index"]] = c
        done_docs += c["documents"]
        read.done(c["index"], sum(u.size for u in shards[c["index"]]))
        if on_done is not None:
            on_done(c, sum(u.size for u in shards[c["index"]]))

    if workers <= 1 or len(jobs) <= 1:
        for j in jobs:
            finished(scan_shard(*j, on_read=read.setter(j[1])))
            if max_docs and done_docs >= max_docs:
                break
    else:
        # (with max_docs: in order, a round of `workers` shards at a time, until enough documents)
        with closing(scan_in_workers(_scan_star, jobs, workers, lambda job: [u.path for u in job[2]],
                                     rounds=bool(max_docs), initializer=(in_worker, read.raw))) as results_in_turn:
            for k, c in enumerate(results_in_turn, start=1):
                finished(c)
                if max_docs and k % workers == 0 and done_docs >= max_docs:
                    break
    return [results[i] for i in sorted(results)]


# ----------------------------------------------------------------------------------------------
# Reading scanned shards back


class ScannedShard:
    """A complete shard's files, read lazily."""

    def __init__(self, path: Path, token_dtype: str, minhash: bool):
        self.path = path
        self.counts = json.loads((path / "shard.json").read_text())
        self.n = self.counts["documents"]
        self.token_dtype, self.minhash = token_dtype, minhash

    def hashes(self) -> np.ndarray:
        return np.load(self.path / "hashes.npy")

    def sigs(self) -> np.ndarray | None:
        return np.load(self.path / "sigs.npy", mmap_mode="r") if self.minhash else None

    def loss_from(self) -> np.ndarray:
        """Per document, its first token trained on (tokenize.py tokenize_answers; 0: every token)."""
        return np.load(self.path / "loss_from.npy")

    def gaps(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Documents `rows`' gaps in training (tokenize.py tokenize_answers) as (offsets, values), in order."""
        offsets = np.load(self.path / "gaps.offsets.npy")
        values = np.fromfile(self.path / "gaps.bin", dtype=np.int64)
        return spill.ragged_rows(offsets, values, rows)

    def names(self) -> list[str]:
        with open(self.path / "names.jsonl") as f:
            return [json.loads(line) for line in f]

    def _dtypes(self) -> dict:
        return {"text": np.uint8, "tokens": self.token_dtype, "breaks": np.int32, "strong": np.int32,
                "feat_idx": np.uint16, "feat_val": np.float32, "gaps": np.int64, "chars": np.int64}

    def ragged(self, what: str) -> spill.RaggedReader:
        return spill.RaggedReader(self.path / what, self._dtypes()[what])

    def damage(self) -> str | None:
        """What of the shard's files does not hold its `documents` (a scan copied from another machine in
        part, say), or None. A merge checks it: a cut text.bin would otherwise be read as shorter texts."""
        try:
            for what, dtype in self._dtypes().items():
                offsets = np.load(self.path / f"{what}.offsets.npy", mmap_mode="r")
                size = os.path.getsize(self.path / f"{what}.bin")
                if len(offsets) != self.n + 1 or size != int(offsets[-1]) * np.dtype(dtype).itemsize:
                    return f"{what}.bin and its offsets hold {len(offsets) - 1} documents in {size} bytes"
            for name in ("hashes.npy", "loss_from.npy", *(("sigs.npy",) if self.minhash else ())):
                rows = len(np.load(self.path / name, mmap_mode="r"))
                if rows != self.n:
                    return f"{name} holds {rows} documents"
            names = (self.path / "names.jsonl").read_bytes()
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        lines = names.count(b"\n")
        if lines != self.n or (names and not names.endswith(b"\n")):
            return f"names.jsonl holds {lines} lines"
        return None

    def token_lengths(self) -> np.ndarray:
        return spill.ragged_lengths(self.path / "tokens")

    def text_bytes(self) -> np.ndarray:
        return spill.ragged_lengths(self.path / "text")



@dataclass
class ScannedCorpus:
    """The scanned shards of a build as one list of documents (read order), read on demand."""
    shards: list[ScannedShard]
    token_dtype: str
    starts: np.ndarray = field(init=False)  # first document of each shard
    _readers: OrderedDict = field(default_factory=OrderedDict, init=False)  # the most recently used

    def __post_init__(self):
        self.starts = np.cumsum([0] + [s.n for s in self.shards])

    @property
    def n(self) -> int:
        return int(self.starts[-1])

    def locate(self, doc: int) -> tuple[int, int]:
        s = int(np.searchsorted(self.starts, doc, side="right") - 1)
        return s, doc - int(self.starts[s])

    def reader(self, s: int, what: str) -> spill.RaggedReader:
        """An open reader, kept among the last OPEN_READERS used: each holds a file and its shard's
        offsets, so keeping every shard's would grow with the corpus (and exhaust file handles)."""
        key = (s, what)
        if key in self._readers:
            self._readers.move_to_end(key)
        else:
            self._readers[key] = self.shards[s].ragged(what)
            if len(self._readers) > OPEN_READERS:
                self._readers.popitem(last=False)[1].close()
        return self._readers[key]

    def get(self, what: str, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        s, j = self.locate(doc)
        return self.reader(s, what).get(j, start, stop)

    def text(self, doc: int) -> str:
        s, j = self.locate(doc)
        return self.reader(s, "text").raw(j).decode("utf-8", "surrogatepass")

    def per_doc(self, fn) -> np.ndarray:
        return np.concatenate([fn(sh) for sh in self.shards]) if self.shards else np.zeros(0)

    def kept_in_shards(self, kept: np.ndarray):
        """(shard, the shard's kept documents as its own row numbers) for each shard holding some."""
        for s, sh in enumerate(self.shards):
            lo, hi = int(self.starts[s]), int(self.starts[s + 1])
            mine = kept[(kept >= lo) & (kept < hi)] - lo
            if len(mine):
                yield sh, mine

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

def write_plan(work: Path, plan: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / f".{PLAN}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, work / PLAN)


def read_plan(work: Path) -> dict | None:
    p = work / PLAN
    if not p.is_file():
        return None
    try:
        plan = json.loads(p.read_text())
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        plan = f"{type(e).__name__}: {e}"
    if not isinstance(plan, dict):
        raise DataError(f"{p} is not a scan plan of `longctx data build` ({str(plan)[:80]}); if it is a scan's, the "
                        f"scan is damaged: remove '{work}' and run its `longctx data build` again.")
    return plan
