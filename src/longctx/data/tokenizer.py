"""Tokenizers: a byte-level one that needs no files, and Hugging Face `tokenizer.json` files.

Both expose `vocab_size`, `eos_id`, `text_prefix()` and `encode_batch(texts) -> list[np.ndarray]`.

A document is encoded whole and as text: a tokenizer.json's own truncation and padding settings
are switched off (they would cut or pad every document silently), and a special token's literal
string in a document ("</s>" in a code corpus) is encoded as the text it is, never as the special
token (an instruction pair's are the special tokens, as at inference: builder/tokenize.py
tokenize_answers); the builder adds the special tokens itself: the tokenizer's own prefix (`text_prefix`, e.g.
Llama's BOS, which a pretrained model saw before every document) and the EOS id after. `encode` (a
prompt for generation or eval) keeps the tokenizer's usual reading of special-token strings, as
transformers does.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import DataError
from .chat_template import token_text


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is BOS and 257 is EOS."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def text_prefix(self) -> list[int]:
        return []  # (models trained on bytes start a document with its first byte)


PROBE = "1"  # any text: what a tokenizer puts before it is its special-token prefix (text_prefix)

# End-of-document tokens used by common tokenizer.json files, most specific first.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


def _configured_eos(path: Path) -> str | None:
    """The eos_token that the tokenizer_config.json beside a tokenizer.json names (a string, or transformers'
    {"content": ...} form); None where there is none or it cannot be read."""
    try:
        return token_text(json.loads((path.parent / "tokenizer_config.json").read_text()).get("eos_token"))
    except (OSError, ValueError, AttributeError):
        return None


def _eos_from_config(path: Path, vocab: dict[str, int]) -> str | None:
    """The configured eos_token where the tokenizer takes its end-of-document token from there: none of the usual
    strings is in its vocabulary (else that one is used, whatever the config says)."""
    if any(t in vocab for t in _EOS_CANDIDATES):
        return None
    return _configured_eos(path)


def _candidate_eos(tok: Tokenizer, vocab: dict[str, int]) -> str | None:
    """The first of _EOS_CANDIDATES that is one of the tokenizer's special tokens, else the first in its vocabulary
    (None where none is). A special token first: a candidate's string may also be a plain token, learnt from text
    that held it (a BPE trained on code writing "<|endoftext|>"), which a document's text encodes to: a word, no
    end. Before 2026-12-07 (commit 7f273663) the first in the vocabulary was taken: tokenizer_digest tells the
    tokenizers where that differs apart."""
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return next((t for t in _EOS_CANDIDATES if t in special), None) or _first_candidate(vocab)


def _first_candidate(vocab: dict[str, int]) -> str | None:
    return next((t for t in _EOS_CANDIDATES if t in vocab), None)


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, read with the `tokenizers` library."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"tokenizer file '{path}' does not exist; pass data.tokenizer=byte or a path to a tokenizer.json."
            )
        self.name = str(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # (the tokenizers library raises a bare Exception for a file it cannot parse)
            raise DataError(f"tokenizer file '{path}' is not a tokenizer.json the tokenizers library reads ({e}); "
                            f"pass data.tokenizer=byte or the tokenizer.json of a Hugging Face model.") from None
        self._tok.no_truncation()  # a document is never cut or padded to the file's settings
        self._tok.no_padding()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # ids need not be dense (a trimmed vocabulary, added tokens past the base one): the size is what an id
        # table needs, largest id + 1, not the count of tokens (a store's token dtype follows it: store.py)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        eos = vocab.get(_candidate_eos(self._tok, vocab))
        if eos is None:  # (DeepSeek's <｜end▁of▁sentence｜>, ...: the model's own, where its config names it)
            eos = vocab.get(_eos_from_config(path, vocab))
        if eos is None:
            raise DataError(
                f"tokenizer '{path}' has none of the end-of-document tokens {', '.join(_EOS_CANDIDATES)}, and no "
                f"tokenizer_config.json beside it names an eos_token of its vocabulary; longctx needs one to "
                f"separate documents."
            )
        self.eos_id = eos
        self.bos_id = None
        self._prefix: list[int] | None = None
        self._added: frozenset[int] | None = None
        self._fallback: dict[int, int] | None = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Documents' ids, their special-token strings read as text."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self.encode_encodings(texts)]

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """One text's ids; with add_special_tokens, the tokenizer's own post-processing (e.g. a BOS
        token) as transformers applies it by default (generation from a Hugging Face model)."""
        self._tok.encode_special_tokens = False
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def encode_encodings(self, texts: list[str], special_tokens: bool = False):
        """The library's Encoding objects (ids and character offsets), for the data pipeline: special-token
        strings in the texts are encoded as text, or with `special_tokens` read as the special tokens (an
        instruction pair, as the model's tokenizer reads a prompt at inference); no prefix added."""
        self._tok.encode_special_tokens = not special_tokens
        try:
            return self._tok.encode_batch(texts, add_special_tokens=False)
        finally:
            self._tok.encode_special_tokens = False

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def special_tokens(self) -> dict[str, int]:
        """{text: id} of its special tokens (decode leaves them out of the text)."""
        return {t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def added_ids(self) -> frozenset[int]:
        """The ids of its added tokens that are matched before normalisation (normalized=False: chat templates'
        special tokens), so that the library reads the text between two of them apart (builder/tokenize.py
        checks a prefix of a long text locally from one). One matched after normalisation (normalized=True,
        `add_tokens`' default) may take in the text around it (a Prepend('▁') normalizer's space)."""
        if self._added is None:
            self._added = frozenset(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if not t.normalized)
        return self._added

    def fallback_bytes(self) -> dict[int, int]:
        """{id: byte} of the tokens its decoder reads as bytes and joins into runs: a ByteFallback decoder's
        (Llama-2's, Mistral's tokenizer.json) pieces <0x00>..<0xFF>; {} for any other decoder. Such a run that is
        not valid UTF-8 decodes as one U+FFFD per byte, its valid characters too, so a run's text depends on all
        of its tokens (generate/output.py from_character)."""
        if self._fallback is None:
            self._fallback = {}
            if _has_type(json.loads(self._tok.to_str()).get("decoder"), "ByteFallback"):
                pieces = {f"<0x{b:02X}>": b for b in range(256)}
                self._fallback = {int(i): pieces[t] for t, i in self._tok.get_vocab(with_added_tokens=False).items()
                                  if t in pieces}
        return self._fallback

    def text_prefix(self) -> list[int]:
        """The ids the tokenizer's post-processing puts before a text (e.g. Llama's BOS), as transformers'
        tokenizer(text) gives them: what a document starts with in a store (builder/tokenize.py) and a
        prompt in `longctx generate`; [] when it adds none."""
        if self._prefix is None:
            plain = [int(t) for t in self.encode(PROBE)]
            full = [int(t) for t in self.encode(PROBE, add_special_tokens=True)]
            found = next((full[:i] for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain),
                         None)
            if found is None:
                raise DataError(f"the tokenizer {self.name} tokenizes {PROBE!r} as {plain} alone but as {full} with "
                                f"its special tokens, so the special tokens it puts before a text cannot be told "
                                f"apart; pass another tokenizer.")
            self._prefix = found
        return list(self._prefix)


def _has_type(node, kind: str) -> bool:
    """Whether a tokenizer.json component (`node`: its JSON, a Sequence's parts nested) is or holds a `kind`."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def tokenizer_digest(spec: str) -> str | None:
    """sha256 of a tokenizer spec's tokenizer.json (None for `byte` or a missing file): what a cached or
    half-built store was tokenized with, beyond its path. Where the end-of-document token comes from the
    tokenizer_config.json beside it, that token too: an edit of its eos_token separates documents with another
    id, under an unchanged tokenizer.json. Where a special candidate is chosen over an earlier one that is a plain
    word (_candidate_eos), the chosen string too: a store built before that rule ended documents with the word,
    and is rebuilt; every other tokenizer keeps the digest it had."""
    if spec == "byte":
        return None
    path = Path(spec)
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        data = path.read_bytes()
    except OSError:
        return None
    digest = hashlib.sha256(data)
    configured = _configured_eos(path)
    # (read once a process for each content: parsing a 14 MB tokenizer.json takes about a second, and Llama-3's
    # holds two candidates; a run asks again for each stage's store, in its preflight and in the run. The search
    # for candidates too: it reads the escapes of their characters, ~0.15 s for 20 MB of \uXXXX escapes)
    key = (digest.hexdigest(), configured)
    if key not in _EOS_RECORDS:
        # (the vocabulary is worth reading only where the config may name the token, or where two candidates'
        # strings are in the file: only then may a special candidate be chosen over an earlier plain one)
        chosen = configured is not None or _candidates_in(data) >= 2
        _EOS_RECORDS[key] = _eos_record(path, configured is not None) if chosen else b""
    digest.update(_EOS_RECORDS[key])  # (b"": the digest a tokenizer always had, sha256 of its file)
    return digest.hexdigest()


# The characters of the candidates, each as a JSON string may escape it: \uXXXX (hex digits in either case), '/'
# also \/. JSON writers other than the tokenizers library's escape '<' and '>' (Go's) or '/' (PHP's); any character
# may be. Keyed by the escape in lower case.
_UNESCAPED = {b"\\/": b"/", **{f"\\u{ord(c):04x}".encode(): c.encode() for c in sorted(set("".join(_EOS_CANDIDATES)))}}
# One backslash, then the rest of an escape: not an alternation of whole escapes, which sre tries one by one at every
# backslash (and a search, then a substitution, read the file twice): 0.8 s for a 20 MB tokenizer.json of a CJK
# vocabulary that Python's json.dump wrote (ensure_ascii: each character a \uXXXX, 2.6M backslashes, none of them a
# candidate's; up to 5 s on a busy machine), 0.15 s this way.
_CANDIDATE_ESCAPE = re.compile(rb"\\(?:/|u00(?i:%s))" % b"|".join(e[4:] for e in _UNESCAPED if e != b"\\/"))


def _candidates_in(data: bytes) -> int:
    """How many of _EOS_CANDIDATES a tokenizer.json's bytes may hold (as its strings or inside other text: only a
    parse tells which are tokens, so at least as many as it holds): a byte search for each, in the bytes with the
    escapes of their characters read (each escape is one backslash, never a match's end: none is missed; one after
    an escaped backslash is read too, a count too many at worst). Not the raw bytes alone: '<|endoftext|>' written
    "\\u003c|endoftext|\\u003e", or '</s>' "<\\/s>", was not found, so a choice the rule of 7f273663 changed was
    not recorded and a store built before it was taken for a new one."""
    data = _CANDIDATE_ESCAPE.sub(lambda m: _UNESCAPED[m[0].lower()], data)
    return sum(t.encode() in data for t in _EOS_CANDIDATES)


_EOS_RECORDS: dict[tuple[str, str | None], bytes] = {}  # tokenizer_digest's: (file's sha256, config's eos) -> bytes


def _eos_record(path: Path, config: bool) -> bytes:
    """What tokenizer_digest adds to the file's bytes for how its end-of-document token is chosen (b"" for nothing,
    the digest it always had)."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # (unreadable: HFTokenizer says why, where the store is built)
        return b""
    vocab = tok.get_vocab(with_added_tokens=True)
    record = b""
    eos = _eos_from_config(path, vocab) if config else None
    if eos is not None:
        record += b"\0eos_token of tokenizer_config.json\0" + eos.encode()
    chosen = _candidate_eos(tok, vocab)
    if chosen != _first_candidate(vocab):  # (else its stores keep the digest they were built under)
        record += b"\0special end-of-document token\0" + chosen.encode()
    return record


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)

