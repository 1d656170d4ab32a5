"""What `longctx data build` must make of a corpus, computed here from the documented rules alone (no builder
code), and the random corpora it is computed for: the reference of tests/unit/test_build_fuzz116.py.

- readers.py: text normalised (BOM dropped, CRLF/CR -> LF, NFC); empty, white-space-only, binary and
  non-UTF-8 documents skipped, and counted; files sorted by path, jsonl records by line (from 1);
- dedup.py: the first of each set of exact copies kept (line ends and trailing white space aside); with
  minhash also the first of texts with the same words (Jaccard 1: the corpora hold no other near copies);
- tokenize.py: a document is the tokenizer's prefix, its text's tokens and one EOS; its breaks are the
  text tokens that start a line, its strong breaks those after a blank line;
- pack.py cut_points: a long piece ends at the last strong break in a sample's last 1/64, else the last
  line break in its second half, else at seq_len; bfd and datasculpt split no other piece;
- holdout.py: a piece (a document, or a piece of the holdout grid of a longer one) held out by the CRC32 of
  its name (`name#piece`); when none is, the lowest-hash piece's sample-sized part;
- instruction pairs (--response-field): prompt and response each normalised; tokens as the model reads them
  at inference (special-token strings as the special tokens, one that ends the pair its EOS), trained on from
  the response's first (a break too); a pair longer than a sample dropped before dedup; copies of pairs only.
"""

import gzip
import json
import os
import re
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import PurePosixPath

EOS = 257  # the byte tokenizer's EOS, also its pad
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# (e + combining accent: NFC makes it é; a special token's string, text in a document)
EXOTIC = ["é", "e\u0301", "ß", "жук", "中文", "😀", "ﬁ", "Å", "<|endoftext|>"]


# -- the corpus ---------------------------------------------------------------------------------------

@dataclass
class Doc:
    name: str
    text: str  # as written (before normalisation)
    prompt: str | None = None  # an instruction pair's (--response-field): `text` is then prompt + response


def words(rng, n, pool, lines=0.12):
    """`n` words of `pool`, a line ending after a `lines` fraction of them (a third of those after a blank line)."""
    out = []
    for _ in range(n):
        out.append(rng.choice(pool))
        if rng.random() < lines:
            out.append("\n\n" if rng.random() < 0.3 else "\n")
    return " ".join(out).replace(" \n ", "\n").replace(" \n\n ", "\n\n")


def variant(rng, text):
    """The same document as dedup sees it: an exact copy (other line ends, trailing blanks, a BOM), or one with
    the same words spaced otherwise (an exact copy to none, a near one to minhash: Jaccard 1)."""
    how = rng.randrange(4)
    if how == 3 and " " in text:
        return text.replace(" ", "  ", 1)
    if how == 0:
        return text.replace("\n", rng.choice(["\r\n", "\r"]))
    if how == 1:
        return text.replace("\n", "  \n") + "\n\n"
    return "\ufeff" + text if how == 2 else text + "\n"


def make_corpus(rng, d, seq_len, prefix="t", copies=(), tiny=False, pairs=False):
    """Documents written under `d` (file names begin with `prefix`; `copies`: texts of another corpus written
    too; `pairs`: records as prompt and response, each text cut in two at a random space); ([Doc] of
    everything a reader sees, in input order, the skips expected)."""
    pool = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 8))) + rng.choice(["", "", "", *EXOTIC])
            for _ in range(4000)]
    texts = [words(rng, rng.choice([1, 3, 20, 60, 150]), pool) for _ in range(rng.randint(1, 3 if tiny else 14))]
    if not tiny:
        texts += [words(rng, seq_len * rng.randint(1, 3), pool) for _ in range(rng.randint(0, 2))]  # many samples
        if rng.random() < 0.5:
            texts.append(" ".join(rng.choice(pool) for _ in range(seq_len // 2)))  # long, no line break
        if rng.random() < 0.5:  # long, short paragraphs: blank lines near where samples end
            texts.append(words(rng, seq_len, pool, lines=0.6))
    texts += [variant(rng, rng.choice(texts)) for _ in range(rng.randint(0, 4))]
    texts += [unicodedata.normalize("NFD", t) for t in rng.sample(texts, 1) if not t.isascii()]
    texts += list(copies)
    rng.shuffle(texts)
    d.mkdir(parents=True)
    files, records = write_files(rng, d, prefix, texts)
    lines, skipped = bad_lines(rng, [json.dumps(record(t, pairs)) for t in records], pairs)
    half = rng.randint(0, len(lines))
    parts = ((f"{prefix}r.jsonl", lines[:half]), (f"{prefix}s.jsonl.gz", lines[half:]))
    (d / parts[0][0]).write_text("".join(x + "\n" for x in parts[0][1]))
    (d / parts[1][0]).write_bytes(gzip.compress("".join(x + "\n" for x in parts[1][1]).encode()))
    docs = [Doc(n, t) for n, t in files.items() if t.strip()]
    for fname, part in parts:
        for k, line in enumerate(part, start=1):
            rec = json.loads(line) if line.startswith("{") else {}
            if pairs and readable(rec.get("text"), "") and readable(rec.get("response")):
                docs.append(Doc(f"{fname}:{k}", rec["text"] + rec["response"], rec["text"]))
            elif pairs and readable(rec.get("text"), "") and isinstance(rec.get("response"), str) and \
                    "\x00" not in rec["response"]:
                skipped["empty"] += 1  # (a response of white space only)
            elif not pairs and readable(rec.get("text")):
                docs.append(Doc(f"{fname}:{k}", rec["text"]))
    # (files sorted by path: the directory `t` before the file `t-x.txt`, whose name sorts after `t/...`)
    docs.sort(key=lambda x: (PurePosixPath(x.name.split(":")[0]).parts, int((x.name.split(":") + ["0"])[1])))
    for reason in ("empty", "empty", "binary", "invalid_utf8", "other_suffix"):  # (the files write_files adds)
        skipped[reason] = skipped.get(reason, 0) + 1
    return docs, skipped


def record(text, pairs):
    """A record of `text`: as an instruction pair, cut before a word chosen by the text's words (copies, also
    spaced otherwise, are cut alike: else the two were near copies to minhash, and not to the reference)."""
    if not pairs:
        return {"text": text}
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    cut = starts[zlib.crc32(unicodedata.normalize("NFC", " ".join(text.split())).encode()) % len(starts)]
    return {"text": text[:cut], "response": text[cut:]}


def readable(text, empty=None):
    """Whether a record's field is read: a string, not white space only (unless `empty` is "": a prompt),
    no NUL, UTF-8."""
    if not isinstance(text, str) or not (text.strip() or empty == "") or "\x00" in text:
        return False
    return all(not 0xD800 <= ord(c) <= 0xDFFF for c in text)


def write_files(rng, d, prefix, texts):
    """About 60% of `texts` as files (some in a subdirectory, under a name that is no UTF-8, compressed), the others
    returned as records; an empty, a white-space-only, a binary, a non-UTF-8 and an unread file."""
    files, records = {}, []
    for i, t in enumerate(texts):
        if rng.random() < 0.6:
            name = rng.choice([f"{prefix}{i:03d}.txt", f"{prefix}{i:03d}.md", f"{prefix}/ü{i}.txt",
                               f"{prefix}-{i}.txt", os.fsdecode(f"{prefix}{i}-".encode() + b"\xff.txt"),
                               f"{prefix}{i:03d}.txt.gz", f"{prefix}{i:03d}.py.zst"])
            files[name] = t
            (d / name).parent.mkdir(exist_ok=True)
            with open(os.path.join(os.fsencode(d), os.fsencode(name)), "wb") as f:
                f.write(compressed(name, t.encode("utf-8")))
        else:
            records.append(t)
    for name, raw in ((f"{prefix}e0.txt", b""), (f"{prefix}e1.md", b" \n\t\n"), (f"{prefix}b.txt", b"a\x00b"),
                      (f"{prefix}u.txt", b"caf\xe9"), (f"{prefix}p.png", b"\x89PNG")):
        (d / name).write_bytes(raw)
    return files, records


def compressed(name, raw):
    if name.endswith(".gz"):
        return gzip.compress(raw)
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor().compress(raw)
    return raw


def bad_lines(rng, lines, pairs):
    """`lines` with records a reader skips (or passes over) put among them; the skips they count."""
    skipped = {"empty": 0, "binary": 0, "invalid_utf8": 0}
    reasons = {'{"text": "  "}': "missing_response_field" if pairs else "empty", "not json": "bad_json_line",
               "": None, "[1, 2]": "bad_json_line",
               '{"body": "no text"}': "missing_text_field", '{"text": 3}': "missing_text_field",
               '{"text": "a\\u0000b"}': "binary", '{"text": "\\ud800 x"}': "invalid_utf8"}
    if pairs:
        # (a response of white space only: counted where make_corpus reads the records)
        reasons.update({'{"text": "q", "response": " \\n"}': None, '{"text": "q", "response": 3}':
                        "missing_response_field", '{"text": "q", "response": "\\u0000"}': "binary"})
    for e in rng.sample(list(reasons), rng.randint(0, len(reasons))):
        lines.insert(rng.randint(0, len(lines)), e)
        if reasons[e]:
            skipped[reasons[e]] = skipped.get(reasons[e], 0) + 1
    return lines, skipped


# -- the reference --------------------------------------------------------------------------------------

def normalised(text):
    text = text[1:] if text.startswith("\ufeff") else text
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))


def exact_key(text):
    return "\n".join(line.rstrip() for line in text.split("\n")).rstrip("\n")


def kept_documents(docs, dedup, encode=None, seq_len=0):
    """{name: Tokens} of the documents kept, in input order: an instruction pair longer than `seq_len` dropped
    first (cut, its response would be trained apart from its prompt), then the copies of earlier documents
    (instruction data: of earlier instruction data, prompt and response each the same)."""
    seen, kept = set(), {}
    for doc in docs:
        if doc.prompt is None:
            text = normalised(doc.text)
            keys = [exact_key(text), tuple(text.split())]
            tokens = (encode or byte_tokens)(text)
        else:
            prompt, response = normalised(doc.prompt), normalised(doc.text[len(doc.prompt):])
            keys = [("pair", exact_key(prompt), exact_key(response)), ("pair", tuple(prompt.split()),
                                                                         tuple(response.split()))]
            tokens = (encode or byte_tokens)(prompt + response, len(prompt))
            if tokens.loss_from and len(tokens) > seq_len:
                continue
        keys = {"none": [], "exact": keys[:1], "minhash": keys}[dedup]
        if any(k in seen for k in keys):
            continue
        seen.update(keys)
        kept[doc.name] = tokens
    return kept


class Tokens(list):
    """A document's tokens (its prefix, text and EOS), with `breaks` (text tokens that start a line) and
    `strong` (those after a blank line)."""


def tokens_of(ids, prefix, eos, newlines):
    """Tokens of text ids whose i-th follows `newlines[i]` newlines after the one before it."""
    t = Tokens(list(prefix) + list(ids) + [eos])
    t.loss_from = 0
    t.breaks = [len(prefix) + i for i in range(1, len(ids)) if newlines[i] >= 1]
    t.strong = [len(prefix) + i for i in range(1, len(ids)) if newlines[i] >= 2]
    return t


def byte_tokens(text, prompt=None):
    """Bytes; of an instruction pair (`prompt`: its prompt's characters), trained on from its response's first
    (`loss_from`), which is a break too."""
    ids = list(text.encode("utf-8"))
    t = tokens_of(ids, [], EOS, [0] + [int(ids[i - 1] == 10) + (i > 1 and ids[i - 1] == ids[i - 2] == 10)
                                       for i in range(1, len(ids))])
    if prompt is not None:
        t.loss_from = len(text[:prompt].encode("utf-8"))
        t.breaks = sorted(set(t.breaks) | ({t.loss_from} if t.loss_from else set()))
    return t


def bpe_tokenizer(path, texts):
    """A small BPE tokenizer.json (BOS put before a text, <|endoftext|> its EOS); its reference encoder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>",
                                                                                        "<|endoftext|>"]))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path))

    def encode(text, prompt=None):
        """A document's "<|endoftext|>" is text; an instruction pair's the special token, as at inference
        (data/tokenizer.py), and one that ends it is its EOS (builder/tokenize.py)."""
        tok.encode_special_tokens = prompt is None
        enc = tok.encode(text, add_special_tokens=False)
        ids, starts = enc.ids, [o[0] for o in enc.offsets]
        if prompt is not None and ids and ids[-1] == eos:
            ids, starts = ids[:-1], starts[:-1]
        t = tokens_of(ids, [bos], eos, [0] + [text[a:b].count("\n") for a, b in zip(starts, starts[1:])])
        if prompt is not None:
            head = tok.encode(text[:prompt], add_special_tokens=False).ids
            assert ids[:len(head)] == head, "(the reference's corpus: a prompt whose ids begin the pair's)"
            t.loss_from = 1 + len(head)
            t.breaks = sorted(set(t.breaks) | {t.loss_from})
        return t
    return encode


def cuts(length, size, breaks, strong):
    """pack.py cut_points as its docstring states it: [0, ..., length], pieces of at most `size`."""
    out, s = [0], 0
    while length - s > size:
        hi = s + size
        near_end = [b for b in strong if hi - max(1, size // 64) < b <= hi]
        second_half = [b for b in breaks if s + size // 2 < b <= hi]
        s = max(near_end or second_half or [hi])
        out.append(s)
    return out + [length]


def item_cuts(tokens, start, length, size):
    inside = lambda xs: [b - start for b in xs if start < b < start + length]  # noqa: E731
    return [start + c for c in cuts(length, size, inside(tokens.breaks), inside(tokens.strong))]


def held(name, fraction):
    return zlib.crc32(name.encode("utf-8", "surrogateescape")) % 1_000_000 < fraction * 1_000_000


def add(items, name, start, length):
    if items and items[-1][0] == name and items[-1][1] + items[-1][2] == start:
        items[-1] = (name, items[-1][1], items[-1][2] + length)
    else:
        items.append((name, start, length))


def split_reference(kept, fraction, grid, seq_len, fallback=True):
    """{split: [(name, start, length)]} in document order (holdout.py's rule; `fallback` False: an append to a
    store with an eval split, which holds out only what hashes into it)."""
    out = {"train": [], "eval": []}
    lowest = None
    for name, tokens in kept.items():
        n = len(tokens)
        bounds = [0, n] if fraction == 0 or n <= grid else item_cuts(tokens, 0, n, grid)
        names = [name] if len(bounds) == 2 else [f"{name}#{p}" for p in range(len(bounds) - 1)]
        for p, piece in enumerate(names):
            rank = zlib.crc32(piece.encode("utf-8", "surrogateescape")) % 1_000_000
            if fraction and (lowest is None or rank < lowest[0]):
                lowest = (rank, name, bounds[p])
        for a, b, piece in zip(bounds, bounds[1:], names):
            add(out["eval" if fraction and held(piece, fraction) else "train"], name, a, b - a)
    one_piece = len(kept) < 2 and all(len(t) <= seq_len for t in kept.values())
    if fallback and fraction and not out["eval"] and not one_piece:
        _, name, at = lowest
        tokens = kept[name]
        grid_cuts = [0, len(tokens)] if len(tokens) <= seq_len else item_cuts(tokens, 0, len(tokens), seq_len)
        a = max(c for c in grid_cuts[:-1] if c <= at)
        b = grid_cuts[grid_cuts.index(a) + 1]
        out["eval"] = [(name, a, b - a)]
        train = []
        for doc, s, m in out["train"]:
            for x, y in ((s, a), (b, s + m)) if doc == name else ((s, s + m),):
                if y > x:
                    train.append((doc, x, y - x))
        out["train"] = train
    return out


def expected_segments(kept, items, seq_len):
    """bfd / datasculpt: each item whole, an item longer than a sample cut at its cut points."""
    segs = []
    for name, s, m in items:
        c = [s, s + m] if m <= seq_len else item_cuts(kept[name], s, m, seq_len)
        segs += [(name, a, b - a) for a, b in zip(c, c[1:])]
    return sorted(segs)


