"""The input side of `longctx data build` as docs/data.md describes it, written without the builder's code: the
reference reader of tests/unit/test_readers_fuzz117.py, and the random corpora it reads.

- a directory: every file under it, through symlinked directories (each real directory once, a link back up the
  tree adds nothing), a file reached twice through links once; dotfiles and dot-directories not read; files in
  path order; text files by a known suffix, `.jsonl`, `.parquet`, `.arrow`; text and `.jsonl` also `.gz` / `.zst`
  (the suffix before the compression decides); any other suffix skipped and counted (`other_suffix`);
- a text file is one document named by its path; a `.jsonl` line one record named `path:LINE` (from 1, blank
  lines counted, not read), a parquet / arrow row `path:ROW` (from 1);
- text normalised: a leading UTF-8 BOM dropped, CRLF / CR -> LF, Unicode NFC;
- skipped and counted: empty / white-space-only, binary (a NUL in the first 8 KiB), not UTF-8 (also a JSON string
  with a lone surrogate), an unparsable JSON line or one that is no object, a record without a string text field;
  a corrupt compressed file counted once, named (`damaged_files`), none of its documents kept.
"""

import codecs
import gzip
import io
import json
import os
import unicodedata
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

TEXT = (".txt", ".md", ".py")  # (among the suffixes docs call text; the corpora use only these)
EOS = 257  # the byte tokenizer's

# pieces documents are made of: combining marks that compose with the piece before (NFC), astral characters,
# every line end, BOMs, U+2028, white space
PIECES = ["a", "bc", " ", "word", "é", "e", "\u0301", "\u0327", "A\u030a", "\u212b", "ﬁ", "😀", "\U0001d11e", "中文",
          "\u1100\u1161", "\r\n", "\r", "\n", "\n\n", "\u2028", "\u2029", "\ufeff", "\t", "  ", "\u00a0", "ß", "<|x|>"]


def normalise(text: str) -> str:
    if text[:1] == "\ufeff":
        text = text[1:]
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))


# -- reading ------------------------------------------------------------------------------------------------------

def _walk(top: str) -> list[str]:
    root, seen, out = os.path.realpath(top), set(), []

    def visit(d: str):
        real = os.path.realpath(d)
        if real in seen or (real != root and root.startswith(real + os.sep)):
            return
        seen.add(real)
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if name.startswith("."):
                continue
            if os.path.isdir(p):
                visit(p)
            elif os.path.isfile(p):
                out.append(p)
    visit(top)
    return out


def kind(name: str):
    """('text' | 'jsonl' | 'parquet' | 'arrow' | None, compression)"""
    low = name.lower()
    comp = next((c for c in (".gz", ".zst") if low.endswith(c)), None)
    inner = os.path.splitext(low[: -len(comp)] if comp else low)[1]
    if inner in (".parquet", ".arrow"):
        return (None if comp else inner[1:]), comp
    if inner == ".jsonl":
        return "jsonl", comp
    return ("text" if inner in TEXT else None), comp


def _raw(path: str, comp):
    data = open(path, "rb").read()
    if comp and not data:  # (no stream at all: a download cut before it began, damaged by the docs)
        raise EOFError
    if comp == ".gz":
        return gzip.decompress(data)
    if comp == ".zst":
        return _unzstd(data)
    return data


def _unzstd(data: bytes) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as r:
        out.write(r.read())
    return out.getvalue()


def _value(v, docs, skipped, name):
    if not isinstance(v, str):
        skipped["missing_text_field"] = skipped.get("missing_text_field", 0) + 1
        return
    if "\x00" in v[:100]:  # (the corpora put a NUL only near the start or far past 8 KiB)
        skipped["binary"] = skipped.get("binary", 0) + 1
        return
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        skipped["invalid_utf8"] = skipped.get("invalid_utf8", 0) + 1
        return
    text = normalise(v)
    if not text.strip():
        skipped["empty"] = skipped.get("empty", 0) + 1
        return
    docs.append((name, text))


def _wide(raw: bytes) -> str | None:
    """The UTF-16 / UTF-32 a .jsonl file starts in (docs/data.md: skipped whole, counted once, named), by its
    byte-order mark (UTF-8's says UTF-8) or, without one, where its start reads in one as JSON: white space, then
    `{` or `[`, no U+0000, and JSON's next character (`"` or `}` after `{`, a value's first or `]` after `[`) or at
    least 4 ASCII characters."""
    if raw.startswith(codecs.BOM_UTF8):
        return None
    if raw.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf32_file"
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf16_file"
    for kind, codec, unit in (("utf32_file", "utf-32-le", 4), ("utf32_file", "utf-32-be", 4),
                              ("utf16_file", "utf-16-le", 2), ("utf16_file", "utf-16-be", 2)):
        text = raw[:4096 // unit * unit][:len(raw) // unit * unit].decode(codec, "replace")
        body = text.lstrip(" \t\r\n")
        second, start = body[1:].lstrip(" \t\r\n")[:1], text[:len(text) - len(body) + 16]
        if body[:1] in ("{", "[") and "\x00" not in start and (sum(c < "\x80" for c in start) >= 4 or second and (
                (body[:1] == "{" and second in '"}') or (body[:1] == "[" and second in '{["-0123456789tfn]'))):
            return kind
    return None


def _jsonl(raw: bytes, name: str, docs, skipped, damaged=None):
    if wide := _wide(raw):
        skipped[wide] = skipped.get(wide, 0) + 1
        if damaged is not None:
            damaged.append(name)
        return
    head = raw[:1 << 20]  # (CR line ends: a CR and no LF in the first MiB; there an LF ends a line too, CRLF one)
    cr = b"\r" in head and b"\n" not in head
    lines = [q for p in raw.split(b"\r") for q in p.removeprefix(b"\n").split(b"\n")] if cr else raw.split(b"\n")
    for i, line in enumerate(lines, start=1):
        if line.startswith(b"\xef\xbb\xbf"):  # (before the blank test: a BOM before a blank line, files joined)
            line = line[3:]
        if not line.strip():
            continue
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:  # (also UTF-16 / UTF-32, which json.loads would take from bytes)
            skipped["invalid_utf8"] = skipped.get("invalid_utf8", 0) + 1
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            skipped["bad_json_line"] = skipped.get("bad_json_line", 0) + 1
            continue
        _value(record.get("text"), docs, skipped, f"{name}:{i}")


def _table(path: str, fmt: str):
    if fmt == "parquet":
        return pq.read_table(path)
    with pa.memory_map(path) as src:
        try:
            return pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(path).read_all()


def _partial(path: str, comp) -> bytes:
    """What a cut-short compressed file decompresses to before its end."""
    data = open(path, "rb").read()
    if comp == ".gz":
        return zlib.decompressobj(wbits=31).decompress(data)
    out, d = b"", zstandard.ZstdDecompressor()
    while data:
        o = d.decompressobj()
        out += o.decompress(data)
        data = o.unused_data if o.eof else b""
    return out


def read_unit(path: str, name: str, docs, skipped, damaged, corrupt=(), partial=None):
    fmt, comp = kind(path)
    if fmt in ("parquet", "arrow"):
        for row, v in enumerate(_table(path, fmt).column("text").to_pylist(), start=1):
            _value(v, docs, skipped, f"{name}:{row}")
        return
    try:
        if name in corrupt:  # (a truncated zstd stream reads as less text: the corpus says which it cut)
            if partial is not None and fmt == "jsonl":  # (the skips its lines before the damage may count)
                _jsonl(_partial(path, comp).rpartition(b"\n")[0], name, [], partial)
            raise EOFError
        raw = _raw(path, comp)
    except (OSError, EOFError, zstandard.ZstdError):
        skipped["bad_compressed_file"] = skipped.get("bad_compressed_file", 0) + 1
        damaged.append(name)
        return
    if fmt == "jsonl":
        return _jsonl(raw, name, docs, skipped, damaged)
    if b"\x00" in raw[:8192]:
        skipped["binary"] = skipped.get("binary", 0) + 1
        return
    try:
        text = normalise(raw.decode("utf-8"))
    except UnicodeDecodeError:
        skipped["invalid_utf8"] = skipped.get("invalid_utf8", 0) + 1
        return
    if not text.strip():
        skipped["empty"] = skipped.get("empty", 0) + 1
    else:
        docs.append((name, text))


def read_corpus(top: str, corrupt=()):
    """([(name, normalised text)] in order, {reason: count}, [damaged file names], {reason: count of the records
    skipped in damaged files before their damage})"""
    docs, skipped, damaged, real_seen, partial = [], {}, [], set(), {}
    for p in _walk(top):
        rel = Path(os.path.relpath(p, top)).as_posix()
        if kind(p)[0] is None:
            skipped["other_suffix"] = skipped.get("other_suffix", 0) + 1
            continue
        if os.path.realpath(p) in real_seen:
            continue
        real_seen.add(os.path.realpath(p))
        read_unit(p, rel, docs, skipped, damaged, corrupt, partial)
    return docs, skipped, damaged, partial


def exact_key(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n")).rstrip("\n")


def kept(docs, dedup: str):
    """{name: byte tokens} of the documents a store of `docs` keeps, in order (exact dedup: the first copy)."""
    seen, out = set(), {}
    for name, text in docs:
        key = exact_key(text)
        if dedup == "exact" and key in seen:
            continue
        seen.add(key)
        out[name] = list(text.encode("utf-8")) + [EOS]
    return out


# -- random corpora -----------------------------------------------------------------------------------------------

def text_of(rng, n=None) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n if n is not None else rng.randrange(1, 40)))


def values(rng, pool: list[str]):
    """A record's text field: usually text (an earlier one again now and then: a copy), else nothing usable."""
    r = rng.random()
    if r < 0.12:
        return rng.choice([None, 5, 1.5, True, ["a"], {"text": "a"}])
    if r < 0.18:
        return rng.choice(["", " \n\t", "\ufeff", "\r\n", "\u2028"])
    if r < 0.22:
        return "\x00" + text_of(rng)
    if r < 0.25:
        return "\ud800" + text_of(rng)  # (a lone surrogate)
    if pool and r < 0.35:
        return rng.choice(pool).replace("\n", rng.choice(["\r\n", "\n", "\n  "]), 1)
    pool.append(text_of(rng))
    return pool[-1]


def jsonl_bytes(rng, pool) -> bytes:
    lines = []
    for _ in range(rng.randrange(1, 9)):
        r = rng.random()
        if r < 0.08:
            lines.append(rng.choice([b"", b"   ", b"not json", b"[1, 2]", b'"text"', b'{"text": "a"', b"\xff{}"]))
            continue
        v = values(rng, pool)
        rec = {"id": rng.randrange(99)} if rng.random() < 0.1 else {"text": v, "id": 1}
        line = json.dumps(rec, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        lines.append((b"\xef\xbb\xbf" if rng.random() < 0.1 else b"") + line + (b"\r" if rng.random() < 0.2 else b""))
    return b"\n".join(lines) + rng.choice([b"", b"\n", b"\n\n"])


def text_bytes(rng, pool) -> bytes:
    r = rng.random()
    if r < 0.06:
        return rng.choice([b"", b"  \r\n\t", b"\xef\xbb\xbf", b"ab\x00cd", b"ok \xff\xfe", b"\xed\xa0\x80 x"])
    if r < 0.1:  # a NUL far past the first 8 KiB: a document with it
        return ("x" * 9000 + "\x00" + text_of(rng)).encode()
    if pool and r < 0.2:
        return rng.choice(pool).encode()
    pool.append(text_of(rng))
    raw = pool[-1].encode()
    return (b"\xef\xbb\xbf" if rng.random() < 0.2 else b"") + raw


def compress(rng, raw: bytes, comp) -> bytes:
    if comp == ".gz":
        return gzip.compress(raw)
    if comp == ".zst":
        cut = rng.randrange(1, 3)  # (several frames, one after the other)
        step = max(1, len(raw) // cut)
        return b"".join(zstandard.ZstdCompressor().compress(raw[i:i + step]) for i in range(0, len(raw) or 1, step))
    return raw


def table(rng, pool, fmt: str, path: Path):
    vals = [values(rng, pool) for _ in range(rng.randrange(1, 7))]
    vals = [v if v is None or isinstance(v, str) else None for v in vals]  # (a string column: nulls, no numbers)
    vals = [v for v in vals if v is None or "\ud800" not in v]
    column = pa.array(vals, type=rng.choice([pa.string(), pa.large_string()]))
    if rng.random() < 0.3:
        column = column.dictionary_encode()
    if all(v is None for v in vals) and rng.random() < 0.5:
        column = pa.nulls(len(vals))  # (a column of nulls only: its type is null)
    t = pa.table({"other": list(range(len(vals))), "text": column})
    if fmt == "parquet":
        pq.write_table(t, path, row_group_size=rng.randrange(1, 4))
    else:
        opener = pa.ipc.new_stream if rng.random() < 0.5 else pa.ipc.new_file
        with opener(str(path), t.schema) as w:
            for b in t.to_batches(max_chunksize=2):
                w.write_batch(b)


def make_corpus(rng, d: Path, outside: Path, files: int = 14) -> set:
    """A random corpus in `d` (and a linked directory in `outside`); returns the names of the files it cut short."""
    dirs = [d, d / "sub", d / "sub" / "deeper", d / "b-c", d / "ü", outside]
    for x in dirs:
        x.mkdir(parents=True, exist_ok=True)
    pool, corrupt = [], set()
    for i in range(files):
        where = rng.choice(dirs)
        fmt = rng.choice(["txt", "md", "py", "jsonl", "jsonl", "parquet", "arrow"])
        comp = rng.choice([None, None, ".gz", ".zst"]) if fmt in ("txt", "md", "jsonl") else None
        path = where / f"f{rng.randrange(1000)}_{i}.{fmt}{comp or ''}"
        if fmt in ("parquet", "arrow"):
            table(rng, pool, fmt, path)
            continue
        raw = jsonl_bytes(rng, pool) if fmt == "jsonl" else text_bytes(rng, pool)
        wide = fmt == "jsonl" and rng.random() < 0.08
        if wide:  # (not UTF-8: skipped whole, named with the damaged files)
            raw = raw.decode("utf-8", "replace").encode(rng.choice(["utf-16", "utf-16-le", "utf-32-le"]))
        raw = compress(rng, raw, comp)
        # (a UTF-16 / UTF-32 file is not cut short: which of its two skips a reader counts, the docs do not say)
        if comp and rng.random() < 0.25 and not wide:
            # cut short: a damaged file (zstd: within its last frame; cut where a frame ends it reads as a shorter file)
            raw = raw[: len(raw) // 2] if comp == ".gz" else raw[:-2]
            corrupt.add(f"linked/{path.name}" if where == outside else Path(os.path.relpath(path, d)).as_posix())
        path.write_bytes(raw)
    if rng.random() < 0.4:  # (an empty compressed file)
        name = rng.choice(["sub/e.jsonl.gz", "sub/e.md.zst", "e.txt.gz", "e.jsonl.zst"])
        (d / name).write_bytes(b"")
        corrupt.add(name)
    (d / ".hidden.txt").write_text("never read")
    (d / ".cache").mkdir()
    (d / ".cache" / "x.txt").write_text("never read either")
    some = sorted(p for p in d.rglob("*") if p.is_file() and ".cache" not in p.parts and p.name[0] != ".")
    (d / "image.png").write_bytes(b"\x89PNG")
    (d / "table.parquet.gz").write_bytes(b"?")
    (d / "linked").symlink_to(outside, target_is_directory=True)
    (d / "sub" / "up").symlink_to(d, target_is_directory=True)  # (a loop: adds nothing)
    if some:
        (d / "zz_link.txt").symlink_to(rng.choice(some))  # (the same file twice: read once)
    return corrupt
