"""What `longctx eval` reads, checked against the model before any rank starts: the tokenizer (--tokenizer,
else the checkpoint's), the text (--data, else the default corpus) and each length's sequences (text
windows for ppl, keys hidden at each depth for passkey/needle; eval/tasks.py builds them).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config.tokenizer import checkpoint_tokenizer, model_tokenizer, same_tokenizer
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
        raise DataError(f"the tokenizer {spec} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                        f"{cfg.model.vocab_size}; pass the tokenizer the model was trained with (--tokenizer).")
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

    source = load_source(args.data, args.split, tokenizer, default_store)
    if source.meta.get("vocab_size", 0) > cfg.model.vocab_size:
        raise ConfigError(f"--data {args.data}: its tokenizer has {source.meta['vocab_size']} tokens but the model's "
                          f"vocabulary is {cfg.model.vocab_size}; pass a store built with the model's tokenizer.")
    if source.tokenizer_spec and spec and not same_tokenizer(source.tokenizer_spec, spec):
        raise DataError(f"--data {args.data or '(default corpus)'} was tokenized with {source.tokenizer_spec} but "
                        f"the checkpoint's tokenizer is {spec}; pass a store built with it, or a text file.")
    return source


def _sequences(args, source, tokenizer, lengths: list[int], depths: list[float]) -> dict[int, list[Sequence]]:
    """Each length's sequences: text windows (ppl), or keys hidden at each depth (passkey/needle)."""
    from .tasks import ppl_sequences, retrieval_sequences

    sequences = {}
    for length in lengths:
        if args.task == "ppl":
            sequences[length] = ppl_sequences(source, length, args.samples or 8)
            continue
        try:
            sequences[length] = retrieval_sequences(args.task, source, tokenizer, length, depths, args.samples or 5,
                                                    args.seed)
        except DataError as e:
            raise ConfigError(f"--lengths {length}: {e}") from None
    return sequences
