"""Tokenizers: a byte-level one that needs no files, and Hugging Face `tokenizer.json` files.

Both expose `vocab_size`, `eos_id` and `encode_batch(texts) -> list[np.ndarray]`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import DataError


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


# End-of-document tokens used by common tokenizer.json files, most specific first.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


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
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise DataError(
                f"tokenizer '{path}' has none of the end-of-document tokens {', '.join(_EOS_CANDIDATES)}; "
                f"longctx needs one to separate documents."
            )
        self.eos_id = eos
        self.bos_id = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """One text's ids; with add_special_tokens, the tokenizer's own post-processing (e.g. a BOS
        token) as transformers applies it by default (generation from a Hugging Face model)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def encode_encodings(self, texts: list[str]):
        """The library's Encoding objects (ids and character offsets), for the data pipeline."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)

