"""The units of an input, in a deterministic order, and reading whole inputs into memory.

An input (`--input`, `data.corpus`) is 'stdlib', a directory, a saved Hugging Face dataset or one
file; its *units* are the files readers.py reads one at a time. In a directory: files sorted by
path (dotfiles and files under dot-directories skipped: .git, .venv, caches; text files only with
a known suffix). A directory written by
`Dataset.save_to_disk` (`state.json` listing its arrow files) or `DatasetDict.save_to_disk`
(`dataset_dict.json` listing its splits), given as the input or found inside an input directory,
is read through its arrow files in the order state.json lists them (splits in dataset_dict.json
order), at the place the dataset directory sorts; its json files are metadata, not documents. Its
names start with the dataset directory's own name: `--input ds` gives
`ds/data-00000-of-00001.arrow:1`, a DatasetDict `dd/train/data-00000-of-00001.arrow:1`.

`read_inputs` reads every document of the inputs into memory: the reference the tests and the
packing-quality benchmark compare the streaming build with.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import DataError
from ..store import FORMAT as STORE_FORMAT
from ..store import MANIFEST as STORE_MANIFEST
from .corpus import TEXT_SUFFIXES, Document, hidden, stdlib_files, stdlib_root
from .readers import check_libraries, iter_file, unit_format

# the json files a saved dataset holds beside its arrow files: metadata, never documents
DATASET_METADATA = {"state.json", "dataset_info.json", "dataset_dict.json"}
SCAN_FORMAT, SCAN_PLAN = "longctx-scan", "plan.json"  # scan.py's (which imports this module)
# what longctx's own builds write: (the file that marks such a directory, its "format", what it is)
BUILD_OUTPUTS = ((STORE_MANIFEST, STORE_FORMAT, "a data store"), (SCAN_PLAN, SCAN_FORMAT, "a `--shard` scan"))


@dataclass
class ReadResult:
    docs: list[Document]
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    files: int = 0
    bytes: int = 0  # raw bytes of the documents kept (UTF-8)
    damaged: list[str] = field(default_factory=list)  # names of the corrupt files skipped


def _listed(path: Path) -> bool:
    """Whether a file found in an input directory is read (text files only with a known suffix)."""
    fmt, compression = unit_format(path)
    if fmt is None:
        return False
    if fmt != "text":
        return True
    name = path.name.lower()
    return Path(name[: -len(compression)] if compression else name).suffix in TEXT_SUFFIXES


def unit_size(path: Path) -> int:
    """Bytes on disk of one unit (compressed size for a compressed file), for balancing shards;
    0 when it cannot be stat'ed (reading it then counts it as unreadable)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


# -- listing the units of an input -----------------------------------------------------------------

def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _dataset_files(d: Path) -> list[Path] | None:
    """The arrow files of a directory written by `Dataset.save_to_disk`, in state.json's order;
    None when `d` is not one."""
    state = _read_json(d / "state.json")
    if not isinstance(state, dict) or not isinstance(state.get("_data_files"), list):
        return None
    files = []
    for entry in state["_data_files"]:
        fname = entry.get("filename") if isinstance(entry, dict) else None
        f = d / fname if isinstance(fname, str) and fname and Path(fname).name == fname else None
        if f is None or not f.is_file():
            raise DataError(
                f"'{d}' is a saved Hugging Face dataset whose state.json lists the data file {fname!r}, "
                f"which is not in that directory; save the dataset again with save_to_disk, or copy it whole."
            )
        files.append(f)
    return files


def saved_dataset(d: Path) -> list[Path] | None:
    """The arrow files of a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`
    (splits in dataset_dict.json's order), or None when `d` is neither."""
    splits = _read_json(d / "dataset_dict.json")
    if isinstance(splits, dict) and isinstance(splits.get("splits"), list):
        files = []
        for split in splits["splits"]:
            part = _dataset_files(d / str(split)) if (d / str(split)).is_dir() else None
            if part is None:
                raise DataError(
                    f"'{d}' is a saved Hugging Face DatasetDict whose dataset_dict.json lists the split "
                    f"'{split}', but '{d / str(split)}' is not a saved dataset (no state.json listing its "
                    f"arrow files); save it again with save_to_disk, or copy it whole."
                )
            files += part
        return files
    return _dataset_files(d)


def build_output(d: Path) -> str | None:
    """What `d` is when a longctx build wrote it (a store or a shard scan), else None."""
    for marker, fmt, what in BUILD_OUTPUTS:
        found = _read_json(d / marker) if (d / marker).is_file() else None
        if isinstance(found, dict) and found.get("format") == fmt:
            return what
    return None


def _walk(top: Path) -> list[Path]:
    """Every file under `top`, through symlinked directories too (a corpus assembled from links, `books ->
    /mnt/books`, was read without them, and without a word), each directory once by its real path (a link
    back to an ancestor, a loop, adds nothing). A directory that cannot be listed is an error: its documents
    would be missing from the store unsaid. A filesystem's lost+found (fsck's, at its mount point: root's, and
    unlistable by others) is no corpus, and not read."""
    def refuse(e: OSError):
        raise DataError(f"the input directory '{e.filename}' cannot be listed ({e.strerror}): its documents would be "
                        f"missing from the store; make it readable, or move it out of the input.")

    root = os.path.realpath(top)
    seen, files = {root}, []
    for d, dirs, names in os.walk(top, onerror=refuse, followlinks=True):
        keep = []
        for name in sorted(dirs):
            # (an input on a volume of its own: `/mnt/corpus`, or one reached by a link, `books -> /mnt/books`,
            # whose path ismount calls no mount point)
            if name == "lost+found" and os.path.ismount(os.path.realpath(d)):
                continue
            real = os.path.realpath(os.path.join(d, name))
            # (a link to a directory above the input holds the input: a loop, and the rest of it is not the input)
            if not name.startswith(".") and real not in seen and not root.startswith(real.rstrip(os.sep) + os.sep):
                seen.add(real)
                keep.append(name)
        dirs[:] = keep
        files += [Path(d) / name for name in names]
    return files


def _refuse_dangling(paths: list[Path]) -> None:
    """Refuse links among `paths` whose target is missing (`books -> /mnt/books`, the volume not mounted): passed
    over, their documents were missing from the store unsaid, as an unlistable directory's would be (_walk)."""
    dangling = [f for f in paths if f.is_symlink() and not f.exists()]
    if dangling:
        named = "; ".join(f"'{f}' is a link to '{os.readlink(f)}', which does not exist or cannot be reached"
                          for f in dangling[:3])
        more = f" (and {len(dangling) - 3} more such links)" if len(dangling) > 3 else ""
        raise DataError(f"{named}{more}: its documents would be missing from the store; restore the target (mount "
                        f"its volume), or remove the link from the input.")


def _directory_units(p: Path) -> tuple[list[Path], int]:
    """(units of directory `p` in a deterministic order, files skipped): files sorted by path, a saved
    dataset's arrow files in its own order at the place the dataset directory sorts. A store or scan
    that a build wrote inside the directory (a store per sequence length beside the corpus) is not
    read: its manifest.json, plan.json and docs.jsonl are the build's records, not documents."""
    files, others = [], []  # (others: links to nothing, fifos, sockets, directories named like files)
    for f in _walk(p):
        if not hidden(f.relative_to(p)):
            (files if f.is_file() else others).append(f)
    _refuse_dangling(others)
    files.sort()
    built = {f.parent for f in files if f.name in (STORE_MANIFEST, SCAN_PLAN) and build_output(f.parent)}
    if built:
        files = [f for f in files if not any(a in built for a in f.parents)]
    datasets: dict[Path, list[Path]] = {}
    # outermost first, so a DatasetDict claims its splits
    for d in sorted({f.parent for f in files if f.name in ("state.json", "dataset_dict.json")},
                    key=lambda d: len(d.parts)):
        if d not in datasets and not any(a in datasets for a in d.parents):
            found = saved_dataset(d)
            if found is not None:
                datasets[d] = found
    in_datasets = {f for units in datasets.values() for f in units}
    units, skipped, placed = [], 0, set()
    for f in files:
        owner = next((a for a in f.parents if a in datasets), None) if datasets else None
        if owner is None:
            if _listed(f):
                units.append(f)
            else:
                skipped += 1
        else:
            if owner not in placed:
                units += datasets[owner]
                placed.add(owner)
            if f not in in_datasets and f.name not in DATASET_METADATA:
                skipped += 1  # e.g. a cache-*.arrow that state.json does not list
    return units, skipped


def input_files(spec: str, option: str = "--input") -> tuple[Path, list[Path], int]:
    """(root, the units read_inputs reads for `spec` in order, files skipped for their suffix):
    'stdlib', a directory (text, .jsonl, .parquet and .arrow files, text and .jsonl also .gz / .zst,
    saved Hugging Face datasets; dotfiles and dot-directories skipped), a saved dataset directory, or one file. A unit's
    name is its path relative to root. `option` names the setting `spec` came from in errors
    (--input, data.corpus). Checks now that pyarrow / zstandard are installed where units need them."""
    if spec == "stdlib":
        return (*stdlib_files(), 0)
    p = Path(spec)
    if not p.exists():
        raise DataError(f"{option} '{spec}' does not exist: it is neither 'stdlib' nor an existing directory or "
                        f"file; pass a directory of text files, a .jsonl, .parquet or .arrow file (.jsonl and text "
                        f"also .gz / .zst), a dataset saved with save_to_disk, or 'stdlib'.")
    if not p.is_dir():
        if unit_format(p)[0] is None:
            return p.parent, [], 1
        check_libraries([p])
        return p.parent, [p], 0
    root = p
    if saved_dataset(p) is not None:
        p = p.absolute()  # names start with the dataset directory's own name, also for '.'
        root = p.parent
    what = build_output(p)
    if what is not None:
        raise DataError(f"{option} '{spec}' is {what} written by `longctx data build`, not documents; point "
                        f"{option} at the documents it was built from (or pass the store to `longctx train "
                        f"--data.path`).")
    usable, skipped = _directory_units(p)
    if not usable:
        raise DataError(
            f"{option} directory '{spec}' holds no usable file (text files with a suffix among "
            f"{', '.join(sorted(TEXT_SUFFIXES))}, .jsonl / .parquet / .arrow files, text and .jsonl also "
            f"compressed as .gz / .zst, or datasets saved with save_to_disk; names starting with '.', and "
            f"everything under such directories, are not read); point {option} at a directory with documents."
        )
    check_libraries(usable)
    return root, usable, skipped


def read_once(files: list[Path], seen: set[str]) -> list[Path]:
    """`files` less those already read by their real path (`seen`, updated): a file reached twice through
    symlinks (a link beside its target, a linked directory that is also an --input) gives its documents once,
    as a path given twice is refused (overlapping_inputs) rather than stored twice under --dedup none."""
    out = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def overlapping_inputs(inputs: list[str]) -> list[str]:
    """What is wrong with inputs that name the same files twice (the same path, however written, or one
    inside another, by their resolved paths; 'stdlib' is the standard library's directory): each file is
    read once per input naming it, so every document of them went into the store twice, without a word
    under --dedup none (and the copies were counted as duplicates removed under the others)."""
    seen: list[tuple[str, Path]] = []
    problems = []
    for spec in inputs:
        path = (stdlib_root() if spec == "stdlib" else Path(spec)).resolve()
        for earlier, other in seen:
            if path == other:
                problems.append(f"'{spec}' and '{earlier}' are the same input")
            elif other in path.parents or path in other.parents:
                inner, outer = (spec, earlier) if other in path.parents else (earlier, spec)
                problems.append(f"'{inner}' lies inside '{outer}'")
        seen.append((spec, path))
    return problems


def read_inputs(inputs: list[str], text_field: str = "text", max_docs: int = 0) -> ReadResult:
    """All documents of all inputs, in a deterministic order (inputs as given, units as input_files
    lists them). Every input is listed (and checked) before the first is read. With `max_docs`,
    reading stops at that many documents: skips past that point are not counted."""
    if not inputs:
        raise DataError("no input given; pass --input with a directory, a .jsonl, .parquet or .arrow file, a "
                        "dataset saved with save_to_disk, or 'stdlib'.")
    out = ReadResult(docs=[])
    listed = [input_files(spec) for spec in inputs]
    seen: set[str] = set()
    for root, files, other in listed:
        out.skipped["other_suffix"] += other
        for f in read_once(files, seen):
            out.files += 1
            start, damaged = len(out.docs), len(out.damaged)
            docs = iter_file(f, f.relative_to(root).as_posix(), text_field, out.skipped, out.damaged)
            for doc in docs:
                out.docs.append(doc)
                if max_docs and len(out.docs) >= max_docs:
                    docs.close()
                    break
            if len(out.damaged) > damaged:
                del out.docs[start:]  # a damaged file gives no document (readers.py)
            if max_docs and len(out.docs) >= max_docs:
                break
        if max_docs and len(out.docs) >= max_docs:
            break
    out.bytes = sum(len(d.text.encode("utf-8")) for d in out.docs)
    return out
