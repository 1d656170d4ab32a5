"""The chat template a store's conversations were rendered with (`longctx data build --messages-field`),
recorded in its manifest, and the check that a run training on them keeps it.

A model fine-tuned on conversations answers in the format it was trained on. `longctx generate --chat`
renders prompts with the template beside the run's tokenizer, and `longctx checkpoint export` carries that
template to transformers (`AutoTokenizer.apply_chat_template`). The tokenizer check (train/setup.py) compares
tokenizer.json files only, and two directories often hold the same tokenizer.json with different templates
(a base model and its instruct release, a template edited since): a store rendered with one and a run whose
tokenizer sits beside another trained a model on one format and served it with the other, without a word
(until 2026-12-06). Such a run is refused before any work, naming both templates.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, DataError
from .chat_template import load_chat_template


def template_record(tokenizer_spec: str) -> dict:
    """What a store of conversations records of the template that rendered them (in its manifest's
    `tokenizer.chat_template`): where it was read, and a digest of what the rendering depends on."""
    template = load_chat_template(tokenizer_spec, "--messages-field")
    return {"source": template.source, "digest": template.digest()}


def check_store_template(store: str, recorded: dict | None, run_tokenizer: str) -> None:
    """A ConfigError when the store's conversations were rendered by another chat template than the one
    beside the run's tokenizer `run_tokenizer` (None recorded: plain text, or a store built before 2026-12-06)."""
    if not recorded or run_tokenizer in ("auto", "byte"):
        return
    try:
        ours = load_chat_template(run_tokenizer, "data.path")
    except ConfigError:
        ours = None
    if ours is not None and ours.digest() == recorded["digest"]:
        return
    folder = Path(run_tokenizer) if Path(run_tokenizer).is_dir() else Path(run_tokenizer).parent
    said = (f"the chat template {ours.source}" if ours is not None
            else f"no chat template ({folder} has no chat_template.jinja, no chat_template in tokenizer_config.json)")
    if ours is not None and ours.source == recorded["source"]:  # (one file named twice read as two templates)
        said += " as it is now, edited since the store was built (its template or the special tokens it reads)"
    raise ConfigError(
        f"the data store {store} holds conversations rendered by the chat template {recorded['source']}, but the "
        f"run's tokenizer {run_tokenizer} has {said}: the model would be trained on one chat format while "
        f"`longctx generate --chat` and the exported tokenizer (`checkpoint export`) prompt it in "
        f"{'another' if ours is not None else 'none'}. To fix: build the store with the run's tokenizer "
        f"(longctx data build --messages-field ... --tokenizer {run_tokenizer}), or put the template you train "
        f"on beside it ({folder / 'chat_template.jinja'}).")


def check_append_template(root, old: dict, tokenizer_spec: str) -> None:
    """A DataError before an append of conversations (`--append --messages-field`) to a store whose conversations
    were rendered by another chat template than the one beside `tokenizer_spec` now (edited since the build): its
    manifest records one template for all of them, and the store would hold two formats under it."""
    recorded = old["tokenizer"].get("chat_template")
    if not recorded:  # (plain text, or a store from before templates were recorded)
        return
    now = template_record(tokenizer_spec)
    if now["digest"] != recorded["digest"]:
        raise DataError(f"the store '{root}' holds conversations rendered by the chat template {recorded['source']} "
                        f"as it was when the store was built, and {now['source']} is another now (edited since?); an "
                        f"--append would store conversations of two chat formats under one record. Restore that "
                        f"template, or rebuild the store (all its inputs) into a new --out.")
