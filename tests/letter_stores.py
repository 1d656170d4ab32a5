"""Stores whose every document is made of one letter and spaces, so that each sample says which store it came from:
the data of the mix tests, built by the real store builder (one worker, no dedup, bfd packing)."""

from __future__ import annotations

import random
from pathlib import Path

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store


def letter_store(tmp: Path, letter: str, n_docs: int, *, seq_len: int = 64, eval_fraction: float = 0.0,
                 chars: int | tuple[int, int] = 40, seed: int | str | None = None, numbered: bool = False,
                 name: str | None = None, src_name: str | None = None) -> Path:
    """The store `tmp`/`name` (default: the letter) of `n_docs` documents of `letter` and spaces, read from
    `tmp`/`src_name` (default in-`name`). `chars`: each document's length, or a (low, high) range drawn per
    document; `seed`: the texts' random seed (default ord(letter)); `numbered`: each document ends with its
    number, so no two are alike."""
    src = tmp / (src_name or f"in-{name or letter}")
    src.mkdir(parents=True)
    rng = random.Random(ord(letter) if seed is None else seed)
    for i in range(n_docs):
        length = rng.randint(*chars) if isinstance(chars, tuple) else chars
        text = "".join(rng.choice(letter * 4 + " ") for _ in range(length))
        (src / f"{letter}{i:03d}.txt").write_text(text + (f" {i}" if numbered else ""))
    out = tmp / (name or letter)
    build_store(BuildOptions([str(src)], str(out), seq_len, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=eval_fraction, progress=False, stats=False), log=lambda *a, **k: None)
    return out


def store_mix(stores, weights, seed: int = 0):
    """The mix (data/store_mix.py StoreMix) of the stores at paths `stores` at `weights`, as training reads it."""
    from longctx.data.loader import PackedSamples
    from longctx.data.store_mix import StoreMix

    return StoreMix([PackedSamples(str(p)) for p in stores], [str(p) for p in stores], list(weights), seed)
