"""What `longctx eval` reads, checked against the model before any rank starts: the tokenizer (--tokenizer,
else the checkpoint's), the text (--data, else the default corpus) and each length's sequences (text
windows for ppl, keys hidden at each depth for passkey/needle; eval/tasks.py builds them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.tokenizer import (
    checkpoint_tokenizer,
    model_tokenizer,
    stored_identity,
    tokenizer_identity,
    vocab_refusal,
)
from ..errors import ConfigError, DataError
from ..progress import say

if TYPE_CHECKING:
    from .tasks import Sequence


def _load_tokenizer(args, cfg):
    """(the tokenizer's spec, the tokenizer), both None when there is none and the task needs no text; a
    --tokenizer that is not the one the checkpoint's weights were trained with is refused
    (config/tokenizer.py checkpoint_tokenizer)."""
    from ..data.tokenizer import load_tokenizer
    from .tasks import is_glob  # (lazy, as this module's other task imports)

    # --tokenizer, else the checkpoint's
    spec = checkpoint_tokenizer(cfg.model.init_from, args.tokenizer, model_tokenizer(cfg.model.init_from))
    text_needed = args.task != "ppl" or not args.data or Path(args.data).is_file() or is_glob(args.data)
    if spec is None and text_needed:
        where = ("its directory has no tokenizer.json" if cfg.model.init_from.startswith("hf:") else
                 "its manifest records no tokenizer (written before longctx recorded one)")
        raise ConfigError(f"--checkpoint {args.checkpoint}: {where}, and the {args.task} task turns text into "
                          f"tokens. Pass --tokenizer byte (longctx's default) or --tokenizer PATH/tokenizer.json, "
                          f"the one the model was trained with.")
    tokenizer = load_tokenizer(spec) if spec else None
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(vocab_refusal(cfg.model.init_from, f"--checkpoint {args.checkpoint}", spec,
                                      tokenizer.vocab_size, cfg.model.vocab_size))
    return spec, tokenizer


def _load_source(args, cfg, spec: str | None, tokenizer):
    """The text to evaluate on (--data, or the default corpus), checked against the model's tokenizer."""
    from .tasks import load_source

    def default_store():
        from ..config import DataConfig
        from ..data.default_store import default_store as build
        from ..data.default_store import trained_grid

        # held out on the grid of the model's own training data: none of it trained on
        return build(DataConfig(tokenizer=spec or "byte"), 1024, progress=False, log=say, announce_cached=False,
                     holdout_tokens=trained_grid(args.checkpoint))

    from ..config.tokenizer import model_text_prefix

    # (ppl: a text document begins with the special tokens the model's documents began with, as a store's do, so
    # a span at its start reads as training read it; retrieval's filler is left as it was)
    prefix = model_text_prefix(cfg.model.init_from, tokenizer) if tokenizer is not None and args.task == "ppl" else []
    source = load_source(args.data, args.split, tokenizer, default_store, prefix)
    if source.meta.get("vocab_size", 0) > cfg.model.vocab_size:
        raise ConfigError(f"--data {args.data}: its tokenizer has {source.meta['vocab_size']} tokens but the model's "
                          f"vocabulary is {cfg.model.vocab_size}; pass a store built with the model's tokenizer.")
    if source.tokenizer_spec and spec:
        check_store_tokenizer(args.data or "(default corpus)", source, spec)
    return source


def check_store_tokenizer(data: str, source, spec: str) -> None:
    """A store's token ids mean the model's tokenizer `spec`, compared by content (config/tokenizer.py): the
    identity the store records, so its tokenizer file may have moved since (and an edit to it since says
    nothing); a store built before identities were recorded, by the file its record names as it is now."""
    theirs = source.tokenizer_spec
    record = source.meta.get("tokenizer") or {"spec": theirs}
    have, want = stored_identity(record), tokenizer_identity(spec)
    if have is None:  # (a store without the record whose file has moved: nothing to compare)
        raise DataError(f"--data {data} was tokenized with {theirs}, which no longer exists, and the store records "
                        f"not its content (built before longctx recorded it): nothing says its ids mean the "
                        f"checkpoint's tokenizer {spec}. Put that file back at {theirs}, rebuild the store with "
                        f"--tokenizer {spec}, or pass a text file.")
    if have != want:
        content = f" ({have}; the checkpoint's is {want})" if "byte" not in (have, want) else ""
        raise DataError(f"--data {data} was tokenized with {theirs}{content} but the checkpoint's tokenizer is "
                        f"{spec}: the model would read the store's ids as other text. Pass a store built with it "
                        f"(longctx data build --tokenizer {spec}), or a text file.")


class LengthSequences(Mapping):
    """Each length's sequences, built when that length is asked for and not kept: a run holds one length's
    at a time (a caller drops them before asking for the next), not every length's (at 1M tokens the default
    25 passkey prompts' tokens and labels are 400 MiB). Building is deterministic and a sequence's draws come
    from (seed, length, sample) alone (tasks.py), so a length built again, in any order, is the same.
    `counts`: each length's number of sequences, found when prepare checked it."""

    def __init__(self, build: Callable[[int], list[Sequence]], lengths: list[int]):
        self._build = build
        # (each built once here so bad input stops the command now; then dropped)
        self.counts = {length: len(build(length)) for length in lengths}

    def __getitem__(self, length: int) -> list[Sequence]:
        if length not in self.counts:
            raise KeyError(length)
        return self._build(length)

    def __iter__(self) -> Iterator[int]:
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)


def _sequences(args, source, tokenizer, lengths: list[int], depths: list[float]) -> LengthSequences:
    """Each length's sequences, built on demand: text windows (ppl), or keys hidden at each depth (passkey/needle)."""
    from .tasks import ppl_sequences, retrieval_sequences

    def build(length: int) -> list[Sequence]:
        if args.task == "ppl":
            return ppl_sequences(source, length, args.samples or 8)
        try:
            return retrieval_sequences(args.task, source, tokenizer, length, depths, args.samples or 5, args.seed)
        except DataError as e:
            raise ConfigError(f"--lengths {length}: {e}") from None
    return LengthSequences(build, lengths)
