"""Synthetic retrieval sequences: a pass key (or k keyed numbers) hidden in filler, asked for at the end.

One builder serves both training and evaluation, so a model trained on the mixture is asked the
same question, in the same words and token layout, that `longctx eval` scores:

    filler[:cut] + needle + filler[cut:] + question + answer          (exactly `length` tokens)

- `passkey`: one needle "The pass key is 71432. Remember it. 71432 is the pass key.", question
  "What is the pass key? The pass key is", answer " 71432" (5 random digits by default);
- `needle`: the multi-key variant (RULER's niah_multikey): `needles` keyed numbers "The special
  magic number for <word> is: 4821937." at random depths, the asked one at `depth`; question
  "What is the special magic number for <word>? The special magic number for <word> is:".

Depth is where the (asked) needle starts, as a fraction of the filler: 0 = first thing, 1 = just
before the question; a needle goes in at the start of the line (else the word) that holds its depth,
never inside a word (`_boundary`). The filler is any token stream (the corpus, in practice), so the needle is
the only natural-language sentence in Python code and nothing but retrieval answers the question.

`SyntheticMixture` replaces a seeded fraction of a store's training samples by passkey (or
needle) sequences built from the sample's own text (repeated where its padding would follow), scored
on the answer and the full stop that ends it (as the needle's own sentence does):
`data.synthetic = "passkey:0.2"`. The stop is what teaches a model where the answer ends: trained on
the digits alone it never sees a label past the last digit, and free generation (`eval --mode
generate`) runs on with more digits after a right answer. Eval prompts end at the answer (no stop):
scoring is on the answer's tokens only, so a model that ends its answers otherwise (a newline, EOS)
is not marked down.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..config.data_rules import SYNTHETIC_TASKS
from ..errors import ConfigError, DataError
from .loader import SampleSet
from .samples import IGNORE
from .tokenizer import PROBE

TASKS = SYNTHETIC_TASKS
# keys of the needle task: short, distinct, one word each
KEY_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
             "kestrel", "lagoon", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
             "umber", "velvet", "willow", "xenon", "yarrow", "zephyr", "anchor", "bramble", "cobalt", "dune",
             "falcon", "glacier")


@dataclass
class RetrievalPrompt:
    tokens: np.ndarray   # [length] int64
    answer_start: int    # index of the answer's first token
    answer: str          # the answer text (what exact match compares)
    depth: float         # where the asked needle starts, as a fraction of the filler

    @property
    def labels(self) -> np.ndarray:
        """-100 everywhere but the answer (and its stop, when it has one): label[t] = tokens[t + 1] for
        the tokens that predict it."""
        labels = np.full(len(self.tokens), IGNORE, dtype=np.int64)
        s = self.answer_start
        labels[s - 1:len(self.tokens) - 1] = self.tokens[s:]
        return labels


def _digits(rng: np.random.Generator, n: int) -> str:
    return str(int(rng.integers(10 ** (n - 1), 10 ** n)))


@functools.lru_cache(maxsize=8)
def _probe_ids(tokenizer) -> list[int]:
    """The probe's own ids, once per tokenizer (a training run's synthetic samples encode several pieces
    each)."""
    return [int(t) for t in tokenizer.encode_batch([PROBE])[0]]


def _encode(tokenizer, text: str) -> np.ndarray:
    """`text`'s ids as they read inside a longer text (a needle after filler, an answer after its
    question): encoded after a probe, whose own ids are dropped. Encoded alone, a Llama-2 / Mistral
    tokenizer.json (its normalizer's Prepend('▁')) starts every piece with a word boundary of its own,
    so " 71432" read as '▁▁71432', not the '▁71432' that follows "is" in a text, and a model scored
    the answer it never sees. Plain encoding where the probe's ids are not a prefix."""
    probe = _probe_ids(tokenizer)
    after = [int(t) for t in tokenizer.encode_batch([PROBE + text])[0]]
    if after[:len(probe)] == probe:
        return np.asarray(after[len(probe):], dtype=np.int64)
    return np.asarray(tokenizer.encode_batch([text])[0], dtype=np.int64)


@functools.lru_cache(maxsize=4096)
def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _boundary(filler: np.ndarray, lo: int, cut: int, window: int, tokenizer) -> int:
    """Where a needle meant for filler position `cut` goes: the start of the line that holds `cut` (just
    after the last newline within `window` tokens before it), else the start of the word (a token
    after whitespace or beginning with it), else `cut` itself; never before `lo` (the previous
    needle's place). As RULER and needle-in-a-haystack put needles between sentences: spliced
    mid-word ('de The pass key is ... f f(x):'), a needle breaks a token of the filler in two and
    the model reads a word it never saw. The move is at most `window` tokens (1/32 of the filler, at
    most 512), so the depth stays within 3% of the one asked."""
    if cut <= lo:
        return cut
    start = max(lo, cut - window)
    texts = [_token_text(tokenizer, int(t)) for t in filler[start:cut + 1]]  # texts[i]: filler[start + i]
    texts += [""] * (cut + 1 - start - len(texts))  # (at the filler's end the question follows: its own line)
    for i in range(cut - start, 0, -1):
        if texts[i - 1].endswith("\n"):
            return start + i
    for i in range(cut - start, 0, -1):
        if texts[i - 1][-1:].isspace() or texts[i][:1].isspace():
            return start + i
    return cut


ANSWER_STOP = "."  # what ends a training sequence's answer (the needle sentence's own full stop)


def retrieval_prompt(task: str, filler: np.ndarray, length: int, depth: float, rng: np.random.Generator,
                     tokenizer, *, needles: int = 4, digits: int = 5, words=None, stop: str = "") -> RetrievalPrompt:
    """A `task` sequence of exactly `length` tokens, its filler the first tokens of `filler`; with
    `stop`, the answer is followed by it (and `labels` cover it too)."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; choose one of {TASKS}")
    if task == "passkey":
        key = _digits(rng, digits)
        inserts = [(depth, _encode(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. "))]
        question, answer = "\nWhat is the pass key? The pass key is", f" {key}"
    else:
        if words is None:  # (given: the worst case check_room measures)
            words = rng.choice(len(KEY_WORDS), size=min(needles, len(KEY_WORDS)), replace=False)
        values = [_digits(rng, 7) for _ in words]
        asked = KEY_WORDS[words[0]]
        inserts = [(depth if i == 0 else float(rng.random()),
                    _encode(tokenizer, f" The special magic number for {KEY_WORDS[w]} is: {v}. "))
                   for i, (w, v) in enumerate(zip(words, values))]
        question = f"\nWhat is the special magic number for {asked}? The special magic number for {asked} is:"
        answer = f" {values[0]}"
    q, a = _encode(tokenizer, question), _encode(tokenizer, answer + stop)
    n = length - sum(len(t) for _, t in inserts) - len(q) - len(a)
    if n < 0:
        raise DataError(f"a {task} sequence of {length} tokens has no room for filler: the needle, question "
                        f"and answer alone take {length - n} tokens; use a longer length.")
    if len(filler) < n:
        raise DataError(f"a {task} sequence of {length} tokens needs {n} filler tokens, got {len(filler)}.")
    pieces, last = [], 0
    # the needles go in by depth order; ties keep the asked needle first
    for d, t in sorted(inserts, key=lambda dt: dt[0]):
        cut = _boundary(filler[:n], last, int(round(d * n)), max(1, min(n // 32, 512)), tokenizer)
        pieces += [filler[last:cut], t]
        last = cut
    pieces += [filler[last:n], q, a]
    tokens = np.concatenate(pieces).astype(np.int64)
    return RetrievalPrompt(tokens, length - len(a), answer.strip(), depth)


def check_room(task: str, seq_len: int, tokenizer, where: str = "train.seq_len") -> None:
    """A ConfigError, before any work, when a `task` sequence of seq_len tokens may have no room for
    filler: measured with the longest key words, plus a margin for tokenizers that split numbers
    into a varying number of tokens (none for the byte tokenizer)."""
    longest = sorted(range(len(KEY_WORDS)), key=lambda w: -len(KEY_WORDS[w]))[:4]
    margin = 0 if getattr(tokenizer, "name", "") == "byte" else 16
    try:
        retrieval_prompt(task, np.zeros(seq_len, dtype=np.int64), seq_len - margin, 0.5, np.random.default_rng(0),
                         tokenizer, words=np.asarray(longest), stop=ANSWER_STOP)
    except DataError as e:
        raise ConfigError(f"data.synthetic = {task}:... at {where} = {seq_len}: {e}") from None


class SyntheticMixture(SampleSet):
    """A store split (PackedSamples) with a seeded fraction of its samples turned into retrieval
    sequences: sample i is synthetic for every epoch and every layout alike (its own seeded draw),
    built from its own text as filler, one document with positions 0..L-1, labelled on the answer
    and its stop only, and beginning with the special tokens the store's documents begin with (its
    text_prefix, e.g. BOS), as the model is prompted in `longctx eval` and `longctx generate`.
    (Labelled on every token, the answer is 6 of the sample's L labels and its signal drowns
    in the language-model loss: the debug model at 128 tokens with half the samples synthetic stayed
    at chance on the answer for 300 steps, where answer-only labels learned it.)"""

    def __init__(self, samples, task: str, fraction: float, seed: int, tokenizer):
        self.samples, self.task, self.fraction, self.seed, self.tokenizer = samples, task, fraction, seed, tokenizer
        check_room(task, samples.seq_len, tokenizer)
        self.seq_len, self.doc_mask = samples.seq_len, samples.doc_mask
        draws = np.random.default_rng([seed, 0x5EED]).random(len(samples))
        self.synthetic = draws < fraction
        self.real_tokens = np.where(self.synthetic, self.seq_len, samples.real_tokens)
        self.sq_tokens = np.where(self.synthetic, float(self.seq_len) ** 2, samples.sq_tokens)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokenizer_spec(self) -> str:
        return self.samples.tokenizer_spec

    @property
    def text_prefix(self) -> list[int]:
        return self.samples.text_prefix

    def sample(self, i: int):
        if not self.synthetic[i]:
            return self.samples.sample(i)
        tokens, _, _, _ = self.samples.sample(i)
        rng = np.random.default_rng([self.seed, int(i)])
        prefix = np.asarray(self.text_prefix, dtype=np.int64)
        L, k = self.seq_len, len(prefix)
        # the filler is the sample's text, repeated where it is shorter than the sequence: its padding (pad
        # tokens to seq_len) is no text, and a run of it before the question is what no eval prompt holds
        text = tokens[:int(self.samples.real_tokens[i])]
        if k and len(text) > k and np.array_equal(text[:k], prefix):  # (its first document's BOS: the prefix's)
            text = text[k:]
        filler = np.resize(text, L)
        prompt = retrieval_prompt(self.task, filler, L - k, float(rng.random()), rng, self.tokenizer, stop=ANSWER_STOP)
        tokens = np.concatenate([prefix, prompt.tokens])
        labels = np.concatenate([np.full(k, IGNORE, dtype=np.int64), prompt.labels])
        return tokens, labels, np.arange(L), (np.zeros(L, dtype=np.int64) if self.doc_mask else None)

