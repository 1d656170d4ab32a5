"""Small tokenizers trained offline with the `tokenizers` trainers, random texts in many scripts, and what the
docs say longctx must make of them, computed with the libraries alone (no longctx code): the reference of
tests/unit/test_tokenizer_fuzz118.py.

- ids (data/tokenizer.py, builder/tokenize.py): the `tokenizers` library's own, a document's special-token
  strings read as text, no post-processing; a document in a store is the library's prefix (what its
  post-processor puts before a text), those ids and one EOS;
- generate's text (docs/generate.md "Output"): decode(prompt + new ids) less decode(prompt), as transformers'
  text-generation pipeline defines it (special tokens skipped, no clean-up of spaces: the tokenizer.json's own
  decoder); where the prompt's text is no prefix of the whole (a character across the boundary) the new ids
  decoded alone;
- stop strings: a row ends at the first new token after which that text holds one (a special token's text: when
  that token is generated), and its text is cut before the first occurrence of any.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

# Each kind is a tokenizer.json as common models ship them: GPT-2's byte-level BPE; a SentencePiece-like BPE
# (Metaspace, NFKC) with a BOS; Llama-2's byte-fallback BPE (Prepend/Replace normalizer, ByteFallback decoder);
# BERT's WordPiece (lower-casing normalizer, [CLS] $A [SEP]); a Unigram with Metaspace and NFKC.
KINDS = ("bytelevel_bpe", "metaspace_bpe", "bytefallback_bpe", "wordpiece", "unigram")
EOS = {"bytelevel_bpe": "<|endoftext|>", "metaspace_bpe": "</s>", "bytefallback_bpe": "</s>", "wordpiece": "[SEP]",
       "unigram": "</s>"}
CHAT = ["<|im_start|>", "<|im_end|>"]  # special tokens added to every kind (a chat template's)

FRAGMENTS = {
    "ascii": ["the", "quick", "brown", "fox", "Hello", "world", "it's", "x=1;", "a.b", "(ok)", "42", "3.14", "!?"],
    "cjk": ["中文", "字符", "測試", "日本語", "かな", "한국어", "漢"],
    "emoji": ["😀", "👩\u200d👩\u200d👧", "👍🏽", "🇫🇷", "❤️", "🧑\u200d💻"],
    "combining": ["e\u0301", "a\u0308\u0304", "n\u0303", "\u0301", "ﬁ", "Å", "①", "ｆｕｌｌ", "ẞ", "İ"],
    "rtl": ["שלום", "مرحبا", "\u202ehidden\u202c", "עולם", "\u200f"],
    "control": ["\x07", "\x1b[0m", "\x7f", "\x0b", "\x0c", "\u0085", "\u2028", "\ufeff", "\u200b"],
    "space": [" ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", " \n "],
    "special": ["<|endoftext|>", "</s>", "<s>", "[SEP]", "<|im_end|>", "<0x41>", "##"],
}


def random_text(rng: random.Random, pieces: int | None = None) -> str:
    """Fragments of every script, joined with or without spaces; now and then a very long word or nothing."""
    if rng.random() < 0.04:
        return ""
    out = []
    for _ in range(rng.randint(1, 14) if pieces is None else pieces):
        kind = rng.choice(list(FRAGMENTS))
        if rng.random() < 0.05:
            out.append("".join(rng.choice("abcdefgh中😀é") for _ in range(rng.randint(40, 300))))
        else:
            out.append(rng.choice(FRAGMENTS[kind]))
        if rng.random() < 0.5:
            out.append(" ")
    return "".join(out)


def training_corpus() -> list[str]:
    rng = random.Random(118)
    return [random_text(rng) for _ in range(300)] + [" ".join(f) for f in FRAGMENTS.values()]


def build(kind: str, directory: Path) -> Path:
    """`kind`'s tokenizer.json, trained on training_corpus(), in `directory` (its path)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    corpus, specials = training_corpus(), [EOS[kind], *CHAT]
    if kind == "bytelevel_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind in ("metaspace_bpe", "bytefallback_bpe"):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        if kind == "metaspace_bpe":
            tok.normalizer = normalizers.NFKC()
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
            tok.decoder = decoders.Metaspace()
        else:  # (Llama-2's: no pre-tokenizer, spaces made '▁' by the normalizer)
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", *specials], show_progress=False)
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]", *specials],
                                            show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=300, unk_token="<unk>", special_tokens=["<unk>", *specials],
                                          show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if kind in ("metaspace_bpe", "bytefallback_bpe"):
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if kind == "wordpiece":
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    path = directory / kind / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    if kind == "bytefallback_bpe":
        _add_byte_pieces(path)
    return path


def _add_byte_pieces(path: Path) -> None:
    """Llama-2's <0x00>..<0xFF> pieces added to the BPE vocabulary, byte_fallback on: a character the vocabulary
    lacks is its UTF-8 bytes, one token each."""
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    path.write_text(json.dumps(spec))


def byte_level_char(b: int) -> str:
    """GPT-2's ByteLevel alphabet: the character a byte is in the vocabulary (printable Latin-1 ones stand for
    themselves, the others shifted past 255, in order)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return chr(b) if b in keep else chr(256 + sorted(set(range(256)) - set(keep)).index(b))


def library(path: Path):
    """The reference: a fresh `tokenizers` Tokenizer of the file."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def ids_of(lib, text: str, special_as_text: bool = True, post: bool = False) -> list[int]:
    lib.encode_special_tokens = special_as_text
    try:
        return list(lib.encode(text, add_special_tokens=post).ids)
    finally:
        lib.encode_special_tokens = False


def prefix_of(lib) -> list[int]:
    """The ids the post-processor puts before a text (TemplateProcessing's single "<s> $A": [<s>])."""
    plain, full = ids_of(lib, "1"), ids_of(lib, "1", post=True)
    return next(full[:i] for i in range(len(full)) if full[i:i + len(plain)] == plain)


def document(lib, kind: str, text: str) -> list[int]:
    """A document's tokens in a store: prefix, its text's ids (special strings as text), EOS."""
    return [*prefix_of(lib), *ids_of(lib, text), lib.token_to_id(EOS[kind])]


def cut_points(text: str, offsets) -> tuple[list[int], list[int]]:
    """(breaks, strong): the tokens (by index) with one or two newlines between the previous token's first
    character and their own, as builder/tokenize.py's docstring states it."""
    starts = [a for a, _ in offsets]
    breaks, strong = [], []
    for i in range(1, len(starts)):
        n = text[starts[i - 1]:starts[i]].count("\n")
        breaks += [i] if n >= 1 else []
        strong += [i] if n >= 2 else []
    return breaks, strong


def store_text(text: str) -> str | None:
    """A jsonl record's text as the build reads it (BOM dropped, CRLF / CR -> LF, NFC), None where skipped."""
    text = text[1:] if text.startswith("\ufeff") else text
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    return text if text.strip() and "\x00" not in text else None


def transformers_tokenizer(path: Path):
    """transformers' fast tokenizer of the file (the pipeline's decode: special tokens skipped)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), clean_up_tokenization_spaces=False)


def continuation(hf, prompt_ids, new_ids) -> str:
    """The pipeline's text of `new_ids` after `prompt_ids`: decode(prompt + new) less decode(prompt); the new
    ids decoded alone where decode(prompt) is no prefix of the whole (docs/generate.md)."""
    whole = hf.decode([*prompt_ids, *new_ids], skip_special_tokens=True)
    head = hf.decode(list(prompt_ids), skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else hf.decode(list(new_ids), skip_special_tokens=True)


def stop_at(texts: list[str], new_ids, stops: list[str], special: dict[str, int]) -> tuple[int | None, str]:
    """(k, text): the first k (1-based) whose text texts[k - 1] (of new_ids[:k]) holds a stop string, or whose
    last token is a stop string's special token, and the text cut before the first stop string in it; (None,
    the whole text) where no stop ends the row."""
    stop_ids = {special[s] for s in stops if s in special}
    plain = [s for s in stops if s not in special]
    for k, text in enumerate(texts, start=1):
        found = [i for i in (text.find(s) for s in plain) if i >= 0]
        if found or new_ids[k - 1] in stop_ids:
            return k, text[:min(found)] if found else text
    return None, texts[-1] if texts else ""


def open_run(lib, new_ids) -> int:
    """The characters of the run of byte pieces (<0x..>; special tokens, which decode skips, inside it) that the
    new ids end with, where they are valid UTF-8: not final, a stray byte after them makes the ByteFallback
    decoder write the whole run as U+FFFD. (0 for other decoders: '<0x41>' is text to them.)"""
    if '"ByteFallback"' not in json.dumps(json.loads(lib.to_str())["decoder"]):
        return 0
    pieces, special = {f"<0x{b:02X}>": b for b in range(256)}, {i for i, t in lib.get_added_tokens_decoder().items()
                                                               if t.special}
    run = []
    for i in reversed(list(new_ids)):
        if i in special:
            continue
        if lib.id_to_token(i) not in pieces:
            break
        run.append(pieces[lib.id_to_token(i)])
    try:
        return len(bytes(run[::-1]).decode("utf-8"))
    except UnicodeDecodeError:
        return 0


def shown_at_most(text: str, stops: list[str], held: int = 0) -> str:
    """What a stream may show of `text` once every character of it is final but the last `held` (open_run):
    up to the first stop string, less the longest tail that a stop string begins with (more tokens may complete
    it)."""
    text = text[:len(text) - held]
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if found:
        return text[:min(found)]
    end = len(text)
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                end = min(end, len(text) - n)
                break
    return text[:end]
