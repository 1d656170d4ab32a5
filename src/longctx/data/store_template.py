"""The chat template a store's conversations were rendered with (`longctx data build --messages-field`),
recorded in its manifest, and the check that a run training on them keeps it.

A model fine-tuned on conversations answers in the format it was trained on. `longctx generate --chat`
renders prompts with the template beside the run's tokenizer, and `longctx checkpoint export` carries that
template to transformers (`AutoTokenizer.apply_chat_template`). The tokenizer check (train/setup.py) compares
tokenizer.json files only, and two directories often hold the same tokenizer.json with different templates
(a base model and its instruct release, a template edited since): a store rendered with one and a run whose
tokenizer sits beside another trained a model on one format and served it with the other, without a word
(until 2026-12-06). Such a run is refused before any work, naming both templates.

What is not known is not claimed. A store's record names the template of the conversations it covers; those of
parts written before templates were recorded (a store built, or a shard scan made, before 2026-12-06) are listed
apart (`unrecorded_parts`, or for a store with no record at all its parts of conversations), never put under the
template of a later append or of the merge that packed them: train checks what the record covers and says, in
one line, what it could not check. A merge records the template its scans were rendered with (each scan's plan
records its own), not the one beside the tokenizer when it merges, and refuses scans rendered by two.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, DataError
from .chat_template import NoChatTemplate, load_chat_template

# the first day a build recorded which of its parts hold conversations (a part's `answer_rules`): a part of
# instruction data written before may hold conversations too (or pairs, which no template renders)
ANSWER_RULES_SINCE = "2026-12-02"


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
    try:  # (a template file there but unreadable is that error, naming the file: never checked as no template)
        ours = load_chat_template(run_tokenizer, f"the chat template the store {store} is checked against")
    except NoChatTemplate:
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


def holds_conversations(part: dict) -> bool:
    """Whether a store's part may hold conversations rendered by a chat template: one of --messages-field (its
    `answer_rules`), or one of instruction data from before parts recorded that (conversations or pairs)."""
    instruction = part.get("counts", {}).get("response_only_documents", 0)
    return "answer_rules" in part or bool(instruction and part.get("created", "") < ANSWER_RULES_SINCE)


def unrecorded_parts(manifest: dict) -> list[str]:
    """The parts of a store whose conversations' chat template is not recorded (see the module's docstring)."""
    recorded = manifest["tokenizer"].get("chat_template")
    if recorded:
        return list(recorded.get("unrecorded_parts", []))
    return [p["dir"] for p in manifest.get("parts", []) if holds_conversations(p)]


def store_record(rendered_by: dict | None, old: dict | None) -> dict | None:
    """The record of a store after a build, append or merge of conversations rendered by `rendered_by` (the scan's
    record; None: not recorded, scans of a longctx before 2026-12-06), `old` the store's manifest before it (None:
    a new store); None for no record (every part of conversations then counts as unrecorded)."""
    if rendered_by is None:
        return old["tokenizer"].get("chat_template") if old else None
    earlier = unrecorded_parts(old) if old else []
    return {**rendered_by, **({"unrecorded_parts": earlier} if earlier else {})}


def unchecked_note(manifest: dict) -> str:
    """train's line for a store whose parts' template could not be checked ('': every one could)."""
    parts = unrecorded_parts(manifest)
    if not parts:
        return ""
    return (f"the chat template that rendered the conversations of {', '.join(parts)} was not recorded (written before "
            f"longctx recorded templates, 2026-12-06), so it could not be checked against the run's tokenizer's: "
            f"were they rendered by another, the model trains on one chat format and is prompted in another; "
            f"rebuild the store (all its inputs) to have it checked")


def merged_template(plans: list[tuple[dict, object]], log) -> dict | None:
    """The template record of the scans `plans` ((plan, dir), of one `data build --shard i/n` run) that a merge
    writes: the scans' own (each rendered its conversations when it was made; the template beside the tokenizer
    now rendered none of them); None for no record. A DataError for scans rendered by two templates, or of
    conversations and of plain text (a merge is one build of all the inputs, made on several machines: one
    build reads its inputs one way; train mixes stores of each, data.path=A,B, each checked for its own)."""
    first, first_dir = plans[0]
    for plan, d in plans[1:]:
        ours, theirs = first["build"].get("messages_field"), plan["build"].get("messages_field")
        if bool(ours) != bool(theirs):
            chats, text = (first_dir, d) if ours else (d, first_dir)
            raise DataError(f"the scan '{chats}' holds conversations (--messages-field) and '{text}' plain text: a "
                            f"merge packs the scans of one `data build --shard i/n` run, which reads its inputs one "
                            f"way. Build a store of each and train on both (data.path=A,B; data.weights).")
        a, b = first.get("chat_template"), plan.get("chat_template")
        if a and b and a["digest"] != b["digest"]:
            raise DataError(f"the scans '{first_dir}' and '{d}' hold conversations rendered by two chat templates "
                            f"({a['source']}, digest {a['digest'][:12]}; {b['source']}, digest {b['digest'][:12]}): "
                            f"the store would hold two chat formats under one record. Put the same template beside "
                            f"the tokenizer on every machine and scan again the shards rendered by the other "
                            f"(`longctx data build --shard i/n`).")
    if not first["build"].get("messages_field"):
        return None
    missing = [str(d) for p, d in plans if not p.get("chat_template")]
    if missing:
        log(f"  note      the scans {', '.join(missing)} were made before longctx recorded chat templates: the "
            f"store records none for their conversations (train says it cannot check them)")
        return None
    return first["chat_template"]
