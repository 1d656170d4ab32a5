"""The packed-data store: token samples as memory-mapped numpy arrays, an index, a manifest.

A sample is one packed training sequence of `seq_len` tokens. Layout of a store directory:

    manifest.json                 written last: a store is complete exactly when it exists
    part-00000/                   one part per build or append; never rewritten
      train.tokens.npy            uint16/uint32 [samples, seq_len], padded with the pad token
      train.segments.npy          int64 [segments, 5]: sample, offset, length, doc, start
      train.samples.npy           int64 [samples + 1]: each sample's first segment (CSR pointer)
      eval.*                      the same for the eval split (documents held out by name hash)
      docs.jsonl                  per document (doc = its line number + the part's first doc id):
                                  name, tokens (EOS included), split
      hashes.npy                  uint64 exact-duplicate hash per document (dedup across appends)
      minhash.npy                 uint64 [docs, 128] MinHash signatures (with --dedup minhash)

A segment `(sample, offset, length, doc, start)` says that tokens `[start, start + length)` of
document `doc` lie at `[offset, offset + length)` of the sample; a sample's segments are
contiguous from offset 0, and the rest of the sample is padding.

A manifest of another format version (a store written by an older longctx) is refused with a
message that says to rebuild it.

Crash safety: a part is written under `.tmp-part-*` and renamed into place; the manifest is
written to a temporary file and renamed over `manifest.json` last. An interrupted build or
append leaves either no manifest (the store does not look complete) or the previous manifest,
which does not list the unfinished part (the next append removes it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..durable import fsync_path, publish, write_text_durably
from ..errors import DataError

MANIFEST = "manifest.json"
FORMAT = "longctx-store"
VERSION = 2
# 3: some part trains some documents on their responses only (LOSS_FROM); a store without is written as 2
MASKED_VERSION = 3
# 4: some document is trained on several spans (LOSS_GAPS: a conversation's answers): a reader that knows
# only LOSS_FROM would train on the user turns between them, so it must refuse the store
GAPS_VERSION = 4
READABLE_VERSIONS = (VERSION, MASKED_VERSION, GAPS_VERSION)
LOSS_FROM = "loss_from.npy"  # a part's per-document first token trained on (int64; absent: 0 for every one)
# per document, the token offsets after LOSS_FROM where training stops and starts again (ragged, int64:
# loss_gaps.bin and loss_gaps.offsets.npy; absent: none in any document). data/trained_spans.py reads both
LOSS_GAPS = "loss_gaps"
SPLITS = ("train", "eval")
# segment columns in the store
S_SAMPLE, S_OFFSET, S_LENGTH, S_DOC, S_START = range(5)
POINTER = "samples"  # {split}.samples.npy


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


@dataclass
class SplitArrays:
    tokens: np.ndarray    # [samples, seq_len]
    segments: np.ndarray  # [segments, 5]
    pointer: np.ndarray   # [samples + 1]: each sample's first segment


def new_part_dir(root: Path, index: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-part-{index:05d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def next_part_index(manifest: dict | None) -> int:
    """The number of a new part: past every part the manifest lists. Their count was it until a manifest lost an
    entry (a bad append dropped from it by hand: part-00000, part-00002), when an append took a listed part's name
    and publish_part removed that part's files to write its own."""
    listed = {p["dir"] for p in manifest["parts"]} if manifest else set()
    index = len(listed)
    while f"part-{index:05d}" in listed:
        index += 1
    return index


def publish_part(tmp: Path, root: Path, index: int) -> str:
    name = f"part-{index:05d}"
    final = root / name
    if final.exists():  # left by an append that died before its manifest: not part of the store
        shutil.rmtree(final)
    # durable before it is published: after a power loss the manifest must never name a part whose
    # files did not reach the disk
    for f in tmp.iterdir():
        fsync_path(f)
    publish(tmp, final)
    return name


def write_manifest(root: Path, manifest: dict) -> None:
    write_text_durably(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=False) + "\n")


# what a build leaves in its --out before its manifest is written (builder/out_dir.py's list of a store's entries)
_BUILD_ENTRY = re.compile(r"^(part-\d{5}|\.tmp-part-\d{5}-\d+|\.manifest\.json\.tmp-\d+|\.build)$")


def _not_a_store_hint(root: Path) -> str:
    """What to do about a path that is no store, said after "is not a longctx data store": finish an unfinished
    build, name a store of a directory of stores (data.path naming their parent) or the directory of a store's
    manifest file, or build one."""
    build = f" Build one with `longctx data build --input PATH --seq-len N --out {root}`."
    if root.name == MANIFEST and root.is_file():
        return f" It is a store's manifest file: name its directory, {root.parent}."
    if root.is_file():  # (a corpus file given as the store: the build advice named it as --out, where none goes)
        return (f" It is a file: to train on its text, build a store from it with `longctx data build --input "
                f"{root} --seq-len N --out DIR` and name DIR.")
    try:  # (the first entries: a directory of a corpus' files given by mistake may hold millions)
        entries = list(itertools.islice(root.iterdir(), 10_000)) if root.is_dir() else []
        if any(_BUILD_ENTRY.match(p.name) for p in entries):
            return (" It holds an unfinished build (no manifest.json is written until a build completes); "
                    "run `longctx data build` again." + build)
        if {"plan.json", "shards"} <= {p.name for p in entries}:  # (builder/scan.py's)
            return (" It is a shard scan (`longctx data build --shard i/n`): merge the scans into a store with "
                    "`longctx data merge SCAN... --out DIR`, and name that.")
        stores = sorted(str(p) for p in entries if (p / MANIFEST).is_file())
    except OSError:  # (a directory that cannot be listed: nothing more to say of it)
        return build
    if stores:
        named = ", ".join(stores[:4]) + (f" and {len(stores) - 4} more" if len(stores) > 4 else "")
        return (f" It is a directory of stores ({named}): name the store to read, or several comma-separated "
                f"to mix them (e.g. {','.join(stores[:2])}).")
    if entries:  # (a corpus given as the store: a build into it is refused, as it holds other files)
        held = ", ".join(sorted(p.name for p in entries)[:3]) + (", ..." if len(entries) > 3 else "")
        return (f" It holds other files ({held}): to train on them, build a store from them with `longctx data build "
                f"--input {root} --seq-len N --out DIR` and name DIR.")
    return build


def read_manifest(root: str | Path) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise DataError(f"'{root}' is not a longctx data store: {path} does not exist.{_not_a_store_hint(root)}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); rebuild the store with `longctx data build`.") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise DataError(f"{path} is not a longctx store manifest of a version this longctx reads "
                        f"({', '.join(map(str, READABLE_VERSIONS[:-1]))} or {READABLE_VERSIONS[-1]}, "
                        f"found {manifest.get('format')!r} version {manifest.get('version')!r}); rebuild the store "
                        f"with this version's `longctx data build`.")
    wrong = _malformed(manifest)
    if wrong:
        raise DataError(f"{path} is damaged: {wrong} (edited by hand, or written by another tool?); restore it, or "
                        f"rebuild the store with `longctx data build`.")
    return manifest


def _malformed(m: dict) -> str | None:
    """What of a manifest's fields that a reader takes as given is missing or of the wrong kind (None: nothing),
    where it would be a KeyError or TypeError traceback later, or a part read from outside the store."""
    def count(d, path: str) -> str | None:
        value = d.get(path.rsplit(".", 1)[-1]) if isinstance(d, dict) else None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else f"{path} is {value!r} where a count is expected"

    tok, parts = m.get("tokenizer"), m.get("parts")
    checks = [count(m, "seq_len"), count(tok, "tokenizer.vocab_size"),
              None if isinstance(tok, dict) and isinstance(tok.get("spec"), str) else "tokenizer.spec is missing"]
    if not isinstance(parts, list):
        checks.append(f"parts is {type(parts).__name__}, not a list")
    for i, part in enumerate(parts if isinstance(parts, list) else []):
        name = part.get("dir") if isinstance(part, dict) else None
        if not isinstance(name, str) or not name.startswith("part-") or "/" in name or "\\" in name:
            checks.append(f"parts[{i}].dir is {name!r}, not a part directory's name (part-NNNNN)")
            continue
        splits = part.get("splits") if isinstance(part.get("splits"), dict) else {}
        checks += [count(splits.get(split), f"parts[{i}].splits.{split}.{key}")
                   for split in SPLITS for key in ("samples", "tokens")]
    return next((c for c in checks if c), None)


def text_prefix(manifest: dict) -> list[int]:
    """The special tokens each document of a store (or the store a checkpoint trained on) begins with
    (data/tokenizer.py text_prefix); [] for one written before they were recorded, whose documents
    began with none."""
    return [int(t) for t in manifest["tokenizer"].get("text_prefix", [])]


def remove_stale(root: Path, manifest: dict | None) -> None:
    """Temporary and unlisted parts left by interrupted builds or appends."""
    listed = {p["dir"] for p in manifest["parts"]} if manifest else set()
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith(".tmp-part-") or (p.name.startswith("part-") and p.name not in listed):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{MANIFEST}.tmp-"):
            p.unlink(missing_ok=True)


def load_split(root: Path, part: dict, split: str, seq_len: int | None = None) -> SplitArrays | None:
    if part["splits"][split]["samples"] == 0:
        return None
    d = root / part["dir"]
    try:
        arrays = SplitArrays(
            np.load(d / f"{split}.tokens.npy", mmap_mode="r"),
            np.load(d / f"{split}.segments.npy"),
            np.load(d / f"{split}.{POINTER}.npy"),
        )
    except (OSError, ValueError) as e:
        raise DataError(f"the store '{root}' is damaged: {d}/{split}.* cannot be read ({e}); rebuild it.") from None
    _check_split(root, d, split, part["splits"][split], arrays)
    if seq_len is not None and arrays.tokens.shape[1] != seq_len:
        raise DataError(f"the store '{root}' is damaged: {d}/{split}.tokens.npy holds samples of "
                        f"{arrays.tokens.shape[1]} tokens, its manifest says seq_len {seq_len}; rebuild it.")
    return arrays


def _check_split(root: Path, d: Path, split: str, record: dict, a: SplitArrays) -> None:
    """The files hold what the manifest says they do: samples, segments and tokens agree. A part left by
    another build (two builds racing into one directory) or files cut short would otherwise be read as
    the manifest's data."""
    samples, tokens = int(record["samples"]), int(record["tokens"])
    found = (a.tokens.shape[0] if a.tokens.ndim == 2 else -1, len(a.pointer) - 1,
             int(a.segments[:, S_LENGTH].sum()) if a.segments.ndim == 2 and len(a.segments) else 0)
    if found != (samples, samples, tokens) or (len(a.pointer) and a.pointer[-1] != len(a.segments)):
        raise DataError(f"the store '{root}' is damaged: {d}/{split}.* hold {found[0]} samples ({found[1]} in the "
                        f"index) of {found[2]} tokens, its manifest {samples} samples of {tokens} tokens; rebuild it.")
    wrong = _index_problem(a)
    # (the digest the build recorded of the segment index: a document id or start changed in it passes the
    # checks above, and would train other documents' spans and masks; the tokens have no such digest)
    if not wrong and record.get("layout") and segments_digest(a.segments) != record["layout"]:
        wrong = "its digest is not the layout its manifest records"
    if wrong:
        raise DataError(f"the store '{root}' is damaged: the index of {d}/{split}.* ({split}.{POINTER}.npy, "
                        f"{split}.segments.npy) was changed since the build: {wrong}; rebuild it.")


def _index_problem(a: SplitArrays) -> str | None:
    """What of a split's index is not as a build writes it (None: nothing): each sample's segments in order in the
    pointer, each segment inside its sample. Counts alone pass a bit changed in either file, which read as a
    traceback (a pointer that goes back: "repeats may not contain negative values") or as other tokens."""
    steps = np.diff(a.pointer)
    if len(a.pointer) and a.pointer[0] != 0 or (steps < 0).any():
        return "the sample index is not in order"
    if not len(a.segments):
        return None
    seq_len = a.tokens.shape[1]
    seg = a.segments
    if not np.array_equal(seg[:, S_SAMPLE], np.repeat(np.arange(len(steps)), steps)):
        return "a segment names another sample than the index does"
    if (seg[:, S_LENGTH] <= 0).any() or (seg[:, S_OFFSET] < 0).any() or (seg[:, S_START] < 0).any() \
            or (seg[:, S_OFFSET] + seg[:, S_LENGTH] > seq_len).any():
        return f"a segment lies outside its sample of {seq_len} tokens"
    return None


def part_documents_digest(root: Path, part: dict) -> str | None:
    """A digest of a part's documents' contents: the one its manifest record holds (`documents_digest`, which
    the builder writes), else (a store built before) of its hashes.npy (documents_digest)."""
    return part.get("documents_digest") or documents_digest(root / part["dir"])


def layout_digest(part_dir: Path, split: str) -> str:
    """A digest of how a split's samples are packed: its segment index ({split}.segments.npy: each segment's
    sample, offset, length, document and start), read in slices. The same documents packed otherwise (another
    --max-memory, so other packing groups; another builder version) have other samples at the same indices,
    which a data position's cursor would read without a word (data/store_identity.py store_identity)."""
    path = part_dir / f"{split}.segments.npy"
    return segments_digest(np.load(path, mmap_mode="r") if path.is_file() else np.zeros((0, 5), np.int64))


def segments_digest(segments: np.ndarray) -> str:
    """layout_digest of a split's segment index in memory (or memory-mapped)."""
    digest = hashlib.blake2b(digest_size=16)
    for start in range(0, len(segments), 1 << 18):
        # (no copy where they are little-endian int64 already, as a build writes them: read per open of a store)
        digest.update(memoryview(np.ascontiguousarray(segments[start:start + (1 << 18)], dtype="<i8")).cast("B"))
    return digest.hexdigest()


def documents_digest(part_dir: Path) -> str | None:
    """A digest of the exact-duplicate hash of each document a part keeps (hashes.npy, 8 bytes a document,
    read in slices), in order, and of where each one's training starts where that is not its first token
    (LOSS_FROM: a prompt moved between the two fields of a pair keeps the text's hash, not what is trained
    on); None where the part has no hashes.npy (a store written by another tool)."""
    path = part_dir / "hashes.npy"
    if not path.is_file():
        return None
    try:
        hashes = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"the store part '{part_dir}' is damaged: {path} cannot be read ({e}); rebuild it.") from None
    digest = hashlib.blake2b(digest_size=16)
    for start in range(0, len(hashes), 1 << 20):
        digest.update(np.ascontiguousarray(hashes[start:start + (1 << 20)]).astype("<u8").tobytes())
    firsts = load_loss_from(part_dir)
    if firsts is not None:
        digest.update(b"loss_from")
        for start in range(0, len(firsts), 1 << 20):
            digest.update(np.ascontiguousarray(firsts[start:start + (1 << 20)]).astype("<i8").tobytes())
    gaps = load_loss_gaps(part_dir)
    if gaps is not None:
        for name, values in zip((b"gap_offsets", b"gaps"), gaps):
            digest.update(name + np.ascontiguousarray(values).astype("<i8").tobytes())
    return digest.hexdigest()


def response_only_documents(part: dict) -> int:
    """How many of a part's documents are trained on their responses only (its manifest record's count;
    0 for a part written before instruction pairs, or by another tool, which has no counts)."""
    return int(part.get("counts", {}).get("response_only_documents", 0))


def load_loss_from(part_dir: Path) -> np.ndarray | None:
    """A part's per-document first token trained on (memory-mapped), or None: every token of every one."""
    path = part_dir / LOSS_FROM
    if not path.is_file():
        return None
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"the store part '{part_dir}' is damaged: {path} cannot be read ({e}); rebuild it.") from None


def load_loss_gaps(part_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """A part's per-document gaps in training (LOSS_GAPS) as (offsets [documents + 1], values), or None."""
    values, offsets = part_dir / f"{LOSS_GAPS}.bin", part_dir / f"{LOSS_GAPS}.offsets.npy"
    if not values.is_file() and not offsets.is_file():
        return None
    try:
        found = np.load(offsets), np.fromfile(values, dtype=np.int64)
    except (OSError, ValueError) as e:
        raise DataError(f"the store part '{part_dir}' is damaged: {values} or {offsets} cannot be read ({e}); "
                        f"rebuild it.") from None
    if found[0].ndim != 1 or not len(found[0]) or int(found[0][-1]) > len(found[1]):  # (values cut short)
        raise DataError(f"the store part '{part_dir}' is damaged: {values} holds {len(found[1]):,} gaps, its offsets "
                        f"{int(found[0][-1]) if found[0].ndim == 1 and len(found[0]) else 'none'}; rebuild it.")
    return found


def answer_gap_documents(part: dict) -> int:
    """How many of a part's documents are trained on several spans (its manifest record's count)."""
    return int(part.get("counts", {}).get("answer_gap_documents", 0))


def load_part_docs(root: Path, part: dict) -> tuple[np.ndarray, np.ndarray | None]:
    d = root / part["dir"]
    try:
        hashes = np.load(d / "hashes.npy")
        sigs = np.load(d / "minhash.npy") if (d / "minhash.npy").is_file() else None
    except (OSError, ValueError) as e:
        raise DataError(f"the store '{root}' is damaged: {d}/hashes.npy or minhash.npy cannot be read ({e}); "
                        f"rebuild it.") from None
    # one row a document: rows missing or left from other documents would have an append keep copies of them
    # (or drop documents for copies of what the store does not hold), without a word
    want = part.get("documents")  # (a manifest another tool wrote may not count them)
    for name, rows in (("hashes.npy", len(hashes)), ("minhash.npy", None if sigs is None else len(sigs))):
        if want is not None and rows is not None and rows != want:
            raise DataError(f"the store '{root}' is damaged: {d}/{name} holds {rows:,} documents' rows, its manifest "
                            f"{want:,} documents, so an append cannot tell which documents it holds; rebuild the "
                            f"store (all its inputs) into a new --out.")
    return hashes, sigs
