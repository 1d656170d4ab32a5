"""What `longctx eval` feeds the model: sequences of exactly `length` tokens with the labels to score.

Everything here is host work done before the model exists (so bad input stops the command before
any rank builds anything), and deterministic, so every layout scores the same sequences.

- ppl: consecutive spans of `length` tokens from documents at least that long (a store's split,
  or a text file as one document), labels = the next token inside the span. Loss is bucketed
  by position in the span: the "loss vs position" curve.
- passkey / needle: data/synthetic.py's prompts, filler from the same documents, one per (length,
  depth, sample), labels on the answer tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.samples import IGNORE
from ..data.store import (
    MANIFEST,
    S_DOC,
    S_LENGTH,
    S_OFFSET,
    S_START,
    load_split,
    read_manifest,
    response_only_documents,
)
from ..data.synthetic import retrieval_prompt
from ..data.trained_spans import part_trained_spans
from ..errors import ConfigError, DataError

TASKS = ("ppl", "passkey", "needle")


@dataclass
class Sequence:
    tokens: np.ndarray    # [length] int64
    labels: np.ndarray    # [length] int64, -100 = not scored
    length: int
    depth: float | None = None   # retrieval: where the asked needle is
    answer: str | None = None
    sample: int = 0              # retrieval: which of the (length, depth)'s --samples prompts it is


FILLER_POOL_TOKENS = 1 << 22  # retrieval filler: from the first 4M tokens of the source (or `length`, if more)


@dataclass
class TokenSource:
    """Documents as token arrays (the filler and the ppl text), read lazily, and where they came from."""
    documents: Callable[[], Iterator[np.ndarray]]  # a fresh pass over the documents, in order
    description: str
    tokenizer_spec: str | None = None  # the store's tokenizer (None: tokenized here with the model's)
    meta: dict = field(default_factory=dict)  # a store's: its vocab_size, its tokenizer record (its "identity")
    # a fresh pass of (document, its tokens trained on or None: all), for instruction data (None: all of all)
    trained_documents: Callable[[], Iterator[tuple[np.ndarray, np.ndarray | None]]] | None = None

    def scored(self) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Each document with the tokens a ppl scores (None: every one): of instruction data, its answers."""
        if self.trained_documents is not None:
            return self.trained_documents()
        return ((doc, None) for doc in self.documents())

    def stream(self, limit: int) -> np.ndarray:
        """The documents one after another, up to `limit` tokens (only those documents are read)."""
        out, n = [], 0
        for doc in self.documents():
            out.append(doc[:limit - n])
            n += len(out[-1])
            if n >= limit:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def store_documents(root: Path, split: str, trained: bool = False) -> Iterator:
    """Each document of a store split, reassembled from its packed segments, in document order: each
    run of its text, where a document's pieces went to both splits (builder/holdout.py), is one, so a
    span never crosses the text the other split holds. Lazy: the segment index is read up front, a
    document's tokens only when it is reached, so a caller that needs a few spans never holds the split.
    With `trained`, (tokens, which of them the document trains on: None where every one is)."""
    manifest = read_manifest(root)
    for part in manifest["parts"]:  # a document lies in one part
        arrays = load_split(root, part, split)
        if arrays is None:
            continue
        spans = part_trained_spans(root, part) if trained else None
        seg = arrays.segments
        sample_of = np.repeat(np.arange(len(arrays.pointer) - 1), np.diff(arrays.pointer))
        order = np.lexsort((seg[:, S_START], seg[:, S_DOC]))  # by document, then by position in it
        doc, start, end = seg[order, S_DOC], seg[order, S_START], seg[order, S_START] + seg[order, S_LENGTH]
        cuts = np.flatnonzero((doc[1:] != doc[:-1]) | (start[1:] != end[:-1])) + 1  # another document, or a gap
        for group in np.split(order, cuts):
            tokens = np.concatenate([np.asarray(arrays.tokens[sample_of[i]][seg[i, S_OFFSET]:seg[i, S_OFFSET] +
                                                                           seg[i, S_LENGTH]]) for i in group]
                                    ).astype(np.int64)
            if not trained:
                yield tokens
                continue
            at = int(seg[group[0], S_START]) + np.arange(len(tokens))
            yield tokens, None if spans is None else spans.trained(
                np.full(len(tokens), int(seg[group[0], S_DOC]) - int(part["first_doc"])), at)


def load_source(data: str, split: str, tokenizer, default_store, prefix=()) -> TokenSource:
    """`--data`: '' (the default corpus store), a store directory, a text file (one document), or a
    glob of text files ('DIR/**/*.py': each file one document, in sorted order; text held out from
    training, such as sources the corpus does not hold). `prefix`: the special tokens the model's documents
    began with (config/tokenizer.py model_text_prefix), put before each text document as a store's builder
    puts them before each of its documents, so a span at a document's start reads as training read it."""
    if not data:
        data = str(default_store())
    if is_glob(data):
        return _glob_source(data, tokenizer, prefix)
    path = Path(data)
    if path.is_dir():
        if not (path / MANIFEST).is_file():
            raise DataError(f"--data {data}: a directory must be a store built by `longctx data build` (it has no "
                            f"{MANIFEST}); pass a store, a text file, a quoted glob of its text files, each one "
                            f"document (--data '{path / '**' / '*.txt'}'), or nothing for the default corpus.")
        manifest = read_manifest(path)
        documents = sum(int(p["splits"][split].get("documents", p["splits"][split]["samples"]))
                        for p in manifest["parts"])
        if not documents:
            raise DataError(f"--data {data}: the store's {split} split is empty; use --split "
                            f"{'train' if split == 'eval' else 'eval'} or another store.")
        answers = any(map(response_only_documents, manifest["parts"]))  # (instruction data: its answers scored)
        return TokenSource(lambda: store_documents(path, split), f"{path} ({split} split, {documents} documents"
                           f"{'; ppl scores their answers' if answers else ''})",
                           manifest["tokenizer"]["spec"], {"vocab_size": int(manifest["tokenizer"]["vocab_size"]),
                                                           "tokenizer": manifest["tokenizer"]},
                           (lambda: store_documents(path, split, trained=True)) if answers else None)
    if path.is_file():
        tokens = _encoded(tokenizer, read_text(path, data), prefix)
        return TokenSource(lambda: iter([tokens]), f"{path} (text file)")
    raise ConfigError(f"--data {data} is neither a store directory nor a text file; pass a store built by "
                      f"`longctx data build`, a text file, or nothing for the default corpus.")


def is_glob(data: str) -> bool:
    """Whether `--data` is a glob of text files (a path that exists is itself, whatever its characters)."""
    return any(c in data for c in "*?[") and not Path(data).exists()


def read_text(path: Path, data: str) -> str:
    """A text --data file's text, read as `longctx data build` reads a text document (UTF-8, CRLF as LF: its
    readers.py decode). A file that is not text is refused: the builder's records and compressed files (.jsonl,
    .parquet, .arrow, .gz, .zst), binary or not UTF-8; read as text with undecodable bytes replaced, each was
    a document of replacement characters or JSON syntax that ppl and passkey's filler measured silently."""
    from ..data.builder.readers import decode, unit_format

    fmt, compression = unit_format(path)
    why = f"a {compression or '.' + str(fmt)} file" if fmt != "text" or compression else None
    text = None
    if why is None:
        text, skip = decode(path.read_bytes())
        why = {"binary": "binary (a NUL byte in its first 8 KiB)", "invalid_utf8": "not UTF-8 text"}.get(skip)
    if why is not None:
        raise DataError(f"--data {data}: {path} is {why}, and eval reads a text file as one document. Build a store "
                        f"from it (longctx data build --input {path} --out STORE; it reads .jsonl, .parquet, .arrow "
                        f"and .gz / .zst files) and pass --data STORE, or pass a text file.")
    return text or ""  # (an empty or whitespace-only file: no document long enough, said by the task)


def _encoded(tokenizer, text: str, prefix) -> np.ndarray:
    """A text document's tokens after `prefix` (load_source's)."""
    return np.concatenate([np.asarray(prefix, dtype=np.int64),
                           np.asarray(tokenizer.encode_batch([text])[0], dtype=np.int64)])


def _glob_source(pattern: str, tokenizer, prefix=()) -> TokenSource:
    """The files `pattern` matches (recursive with **), sorted, each one document, read when iterated."""
    import glob

    if tokenizer is None:
        raise ConfigError(f"--data {pattern!r} is text, which needs a tokenizer; pass --tokenizer byte|PATH.")
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise ConfigError(f"--data {pattern!r} matches no file; pass a glob of text files (quoted, so the shell "
                          f"leaves it alone), a store, a text file, or nothing for the default corpus.")

    def documents():
        for p in paths:
            yield _encoded(tokenizer, read_text(Path(p), pattern), prefix)
    return TokenSource(documents, f"{pattern} ({len(paths)} files)")


def ppl_sequences(source: TokenSource, length: int, samples: int) -> list[Sequence]:
    """Up to `samples` spans of `length` tokens, consecutive within each long-enough document; of instruction
    data each token predicts the next only where that is one its document trains on (an answer's), as
    training's loss and in-training evaluation score it, and a span with none is passed over."""
    out, longest = [], 0
    for doc, trained in source.scored():
        longest = max(longest, len(doc))
        for start in range(0, len(doc) - length + 1, length):
            span = doc[start:start + length]
            labels = np.full(length, IGNORE, dtype=np.int64)
            labels[:-1] = span[1:]
            if trained is not None:
                scored = trained[start + 1:start + length]
                if not scored.any():
                    continue
                labels[:-1][~scored] = IGNORE
            out.append(Sequence(span, labels, length))
            if len(out) == samples:
                return out
    if not out:
        split = "another split (--split train), " if "(eval split" in source.description else ""  # (a store's)
        raise DataError(f"ppl at {length} tokens needs a document of at least {length} tokens; the longest in "
                        f"{source.description} has {longest}. Pass a longer text (--data FILE), {split}or "
                        f"shorter --lengths.")
    return out


def retrieval_sequences(task: str, source: TokenSource, tokenizer, length: int, depths: list[float],
                        samples: int, seed: int) -> list[Sequence]:
    """`samples` prompts per depth. Sample j has its own key and its own stretch of filler, drawn from
    (seed, length, j) alone and the same at every depth: the depth curve compares the same prompts with
    only the needle moved (as a needle-in-a-haystack sweep does), and a depth's prompts are the same
    whatever other depths and lengths are asked for."""
    # (at least `length` tokens: a length past the pool draws from as much of the source as it needs, not a
    # refusal that counts the pool as the source's size)
    stream = source.stream(max(FILLER_POOL_TOKENS, length))
    if len(stream) < length:
        raise DataError(f"{task} at {length} tokens needs at least {length} filler tokens; {source.description} "
                        f"has {len(stream)}. Pass a longer text (--data FILE) or shorter --lengths.")
    out = []
    for depth in depths:
        for j in range(samples):
            rng = np.random.default_rng([seed, length, j])
            start = int(rng.integers(0, len(stream) - length + 1))
            prompt = retrieval_prompt(task, stream[start:start + length], length, depth, rng, tokenizer)
            out.append(Sequence(prompt.tokens, prompt.labels, length, depth, prompt.answer, j))
    return out


def depth_key(depth: float) -> int:
    """A depth as a seed word: its value in millionths (0.5 -> 500000), so a depth's draws never
    depend on its place in --depths."""
    return int(round(depth * 10**6))


def parse_lengths(text: str) -> list[int]:
    """'1K,4K,16000' -> [1024, 4096, 16000] (K = 1024, M = 1024 * 1024)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = {"k": 1024, "m": 1024 * 1024}.get(item[-1:].lower(), 1)
        number = item[:-1] if scale != 1 else item
        try:
            value = int(number) * scale
        except ValueError:
            value = 0
        if value <= 0:
            raise ConfigError(f"--lengths {text!r}: {item!r} is not a positive token count; write e.g. 1K,4K,16384.")
        out.append(value)
    return list(dict.fromkeys(out))  # a length given twice is evaluated once


def parse_depths(text: str) -> list[float]:
    """'0,0.25,0.5' -> [0.0, 0.25, 0.5], each in [0, 1]."""
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"--depths {text!r}: {item.strip()!r} is outside [0, 1]; a depth is where the needle "
                            f"sits as a fraction of the filler (0 = start, 1 = just before the question).")
        out.append(value)
    return list(dict.fromkeys(out))
