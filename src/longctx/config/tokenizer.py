"""Which tokenizer a run's token ids mean: the model's own, a store's, or the one given.

A pretrained model's embeddings mean its own tokenizer's ids, so the tokenizer follows the model
(`data.tokenizer = auto`), and an explicit one that is not the model's is refused before any data
is built. Tokenizers are compared by content (the sha256 of their tokenizer.json), so a copy of the
file elsewhere is the same tokenizer and an edited file at the same path is not. Pure files and
JSON, no torch: the config resolves data.tokenizer while it loads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import ConfigError
from .data_mix import first_store
from .hf import HFFormatError, checkpoint_manifest, hf_dir, initial_hf


def tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json a spec names (a file, or a directory holding one); None for `byte`."""
    if spec == "byte":
        return None
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


def tokenizer_identity(spec: str) -> str:
    """What makes two tokenizers the same: `byte`, or the sha256 of the tokenizer.json's bytes (so
    a copy of the file elsewhere is the same tokenizer, and an edited file at the same path is not)."""
    path = tokenizer_file(spec)
    if path is None:
        return "byte"
    if not path.is_file():
        raise ConfigError(f"tokenizer file '{path}' does not exist; pass data.tokenizer=byte or a path to a "
                          f"tokenizer.json.")
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def stored_identity(tokenizer: dict) -> str | None:
    """The identity a store's (or checkpoint's) tokenizer record holds: its recorded hash, else (a
    store written before hashes were recorded) the hash of the file its spec names, if it exists."""
    if tokenizer.get("identity"):
        return tokenizer["identity"]
    try:
        return tokenizer_identity(tokenizer["spec"])
    except ConfigError:
        return None


def same_tokenizer(a: str, b: str) -> bool:
    """Two tokenizer specs name the same tokenizer (by content, see tokenizer_identity)."""
    return a == b or tokenizer_identity(a) == tokenizer_identity(b)


def model_tokenizer(init_from: str) -> str | None:
    """The tokenizer the weights of `init_from` were trained with: hf:DIR's tokenizer.json, or the
    tokenizer a longctx checkpoint's manifest records; None when they name none (or there are no
    weights to start from)."""
    if not init_from:
        return None
    if init_from.startswith("hf:"):
        path = hf_dir(init_from) / "tokenizer.json"
        return str(path.resolve()) if path.is_file() else None
    return checkpoint_manifest(init_from)[1].get("tokenizer")


def vocab_refusal(init_from: str, given_as: str, spec: str, tokens: int, vocab: int) -> str:
    """Why the tokenizer `spec`, of `tokens` ids, cannot read text for the weights of `init_from` (given on the
    command line as `given_as`, e.g. "--checkpoint DIR"), whose embedding has `vocab` rows (generate, eval and
    bench decode say the same). When it is the weights' own (checkpoint_tokenizer took no other), the checkpoint's
    two files disagree and no --tokenizer helps: advising one looped, as every other was refused as not the
    weights' own. When the weights name none (a --tokenizer taken unchecked), it may be another one."""
    if model_tokenizer(init_from) is None:
        return (f"the tokenizer {spec} has {tokens} tokens but the model's vocabulary is {vocab}; pass the tokenizer "
                f"the model was trained with (--tokenizer).")
    said = ("its config.json's vocab_size (the rows of its embedding)" if init_from.startswith("hf:") else
            "its manifest's model.vocab_size")
    return (f"{given_as}: its own tokenizer {spec} has {tokens} tokens but {said} is {vocab}: the checkpoint's "
            f"tokenizer and weights disagree (ids {vocab} and up have no embedding row), and no other --tokenizer is "
            f"the weights' own. Use the tokenizer published with these weights, or weights whose embedding has a row "
            f"for every token (transformers' resize_token_embeddings({tokens}), saved once).")


def recorded_identity(init_from: str) -> str | None:
    """The identity (tokenizer_identity) of the tokenizer the manifest of the longctx checkpoint `init_from`
    records beside its path; None for hf:DIR and for checkpoints written before longctx recorded one."""
    if not init_from or init_from.startswith("hf:"):
        return None
    return checkpoint_manifest(init_from)[1].get("tokenizer_identity")


def checkpoint_tokenizer(init_from: str, given: str | None, own: str | None) -> str | None:
    """The tokenizer `longctx generate` and `longctx eval` read text with for the weights of `init_from`,
    which name `own` (model_tokenizer): --tokenizer `given` when it is the weights' own (compared by
    content: a copy, or the recorded file moved elsewhere, is the same tokenizer), else `own`; None when
    neither names one. Another tokenizer than the weights' own is refused: the model would read its ids as
    other text and write garbage without an error. The content is the one the manifest records
    (recorded_identity): the recorded file edited since is refused too. Weights that record no content name
    `own` only by its path, compared as it is now; weights that name none (a checkpoint written before longctx
    recorded one, hf:DIR without tokenizer.json), or whose recorded file has moved and whose content is not
    recorded, take `given` unchecked (unchecked_tokenizer says so)."""
    own_file = tokenizer_file(own) if own else None
    recorded = recorded_identity(init_from) if own else None
    if not given:
        if own_file is not None and not own_file.is_file():
            raise ConfigError(f"--checkpoint {init_from} was trained with the tokenizer {own}, which no longer "
                              f"exists; pass --tokenizer PATH/tokenizer.json, that file where it is now.")
        if recorded and tokenizer_identity(own) != recorded:
            raise _not_its_tokenizer(init_from, own, own, recorded)
        return own
    given_file = tokenizer_file(given)
    if given_file is not None and not given_file.is_file():
        raise ConfigError(f"--tokenizer {given}: no such file; pass a tokenizer.json (or a directory holding one), "
                          f"or byte.")
    if recorded:  # (by content, wherever the file is now)
        if tokenizer_identity(given) != recorded:
            raise _not_its_tokenizer(init_from, given, own, recorded)
        return given
    if own is None or (own_file is not None and given_file is not None and not own_file.is_file()):
        return given  # (nothing to compare with: said by unchecked_tokenizer)
    if not (given == own if "byte" in (given, own) else same_tokenizer(given, own)):
        raise _not_its_tokenizer(init_from, given, own)
    return given


def _not_its_tokenizer(init_from: str, given: str, own: str, recorded: str | None = None) -> ConfigError:
    """The refusal of a tokenizer that is not the one the weights trained with (`recorded`: its content, as the
    manifest records it); `given` is `own` when the recorded file itself has changed since."""
    said = f"--tokenizer {given} is not" if given != own else f"the tokenizer file {own} has changed since it was"
    content = (f", whose content the checkpoint records as {recorded} ({given} holds {tokenizer_identity(given)})"
               if recorded and recorded.startswith("sha256:") and given != "byte" else "")
    if given == own:
        fix = "Pass --tokenizer PATH/tokenizer.json, the file the run trained with (the content above)"
    elif own == "byte" or tokenizer_file(own).is_file():
        fix = f"Drop --tokenizer (the checkpoint's own is used), or pass --tokenizer {own}"
    else:
        fix = f"Pass --tokenizer PATH/tokenizer.json, the file {own} moved to"
    return ConfigError(f"{said} the tokenizer the weights of --checkpoint {init_from} were trained with ({own})"
                       f"{content}: the model would read its token ids as other text and write garbage without an "
                       f"error. {fix}.")


def unchecked_tokenizer(init_from: str, given: str | None) -> str:
    """The note for a --tokenizer checkpoint_tokenizer took without comparing it with the weights' own
    (they name none, or the file they name has moved and its content is not recorded); '' when it was
    compared or not given."""
    own = model_tokenizer(init_from) if given else None
    if given and own is None:
        where = ("its directory has no tokenizer.json" if init_from.startswith("hf:") else
                 "its manifest records no tokenizer (written before longctx recorded one)")
        return (f"--tokenizer {given} is taken unchecked: --checkpoint {init_from} names no tokenizer ({where}), so "
                f"nothing says it is the one the model was trained with")
    if (given and given != "byte" and own != "byte" and not tokenizer_file(own).is_file()
            and not recorded_identity(init_from)):
        return (f"--tokenizer {given} is taken as the tokenizer --checkpoint {init_from} records, {own}, which no "
                f"longer exists there to compare it with")
    return ""


def source_hf(init_from: str, tokenizer: str | None = None, depth: int = 16, identity: str | None = None) -> str:
    """The hf:DIR the weights of `init_from` started from, through the longctx checkpoints that started
    from one another, when the ids still mean DIR's tokenizer's (`tokenizer`, default the weights' own,
    is DIR's tokenizer.json; compared by `identity`, the content a manifest records for it, when there is
    one, so a moved or edited file says nothing either way): its generation_config.json, chat files and
    special ids then still hold. '' when there is none (from scratch, another tokenizer, a directory gone)."""
    if init_from.startswith("hf:") and not (tokenizer or identity):  # (the weights' own: DIR's, as it is now)
        return init_from if hf_dir(init_from).is_dir() else ""
    own = tokenizer or (model_tokenizer(init_from) if init_from else None)
    if not init_from.startswith("hf:"):  # (a run from hf:DIR is compared too: DIR's tokenizer.json edited since)
        identity = identity or (recorded_identity(init_from) if own and not tokenizer else None)
        init_from = initial_hf(init_from, depth)
    if not init_from or not hf_dir(init_from).is_dir():
        return ""
    theirs = hf_dir(init_from) / "tokenizer.json"
    try:
        want = identity or (tokenizer_identity(own) if own else None)
        return init_from if want and theirs.is_file() and tokenizer_identity(str(theirs)) == want else ""
    except ConfigError:  # (a recorded tokenizer file since deleted: nothing says the ids still match)
        return ""


def model_text_prefix(init_from: str, tokenizer) -> list[int]:
    """The special tokens a prompt to the weights of `init_from` begins with, as their training
    documents did: for hf:DIR with a Hugging Face tokenizer, those its post-processing puts before a
    text (e.g. BOS: transformers' tokenizer(text)); for a longctx checkpoint, those its manifest
    records its documents began with (data/builder/tokenize.py; none before they were recorded);
    none for the byte tokenizer. `tokenizer` is the one the prompt is encoded with."""
    if not init_from or getattr(tokenizer, "name", "") == "byte":
        return []
    if init_from.startswith("hf:"):
        return tokenizer.text_prefix()
    return [int(t) for t in checkpoint_manifest(init_from)[1].get("text_prefix", [])]


def resolve_tokenizer(init_from: str, tokenizer: str, store: str = "") -> str:
    """data.tokenizer as the run uses it. The tokenizer follows the model: `auto` is the weights'
    own (model_tokenizer), else a store's (data.path), else `byte` for a model trained from scratch;
    it stays `auto` when the weights name none (unknown_tokenizer says why, where data is built).
    An explicit tokenizer that is not the weights' own is refused: a pretrained model trained on
    another tokenizer's ids is a silent wrong result (its step-1 loss only looks high). Tokenizers
    are compared by content (a checkpoint's: what its manifest records, so its file may have moved), not by
    path."""
    own = model_tokenizer(init_from)
    recorded = recorded_identity(init_from) if own else None  # (by content: the recorded file may have moved)
    if tokenizer == "auto":
        if own or init_from:
            return own or "auto"
        if first := first_store(store):  # (a mix's stores share one tokenizer: train/setup.py checks it)
            try:  # (a missing or damaged store is reported by the data checks, with its own fix)
                return json.loads((Path(first) / "manifest.json").read_text())["tokenizer"]["spec"]
            except (OSError, ValueError, KeyError, TypeError):
                return "auto"
        return "byte"
    if own and not (tokenizer_identity(tokenizer) == recorded if recorded else same_tokenizer(tokenizer, own)):
        raise HFFormatError(
            f"data.tokenizer = {tokenizer!r} is not the tokenizer of model.init_from = {init_from!r}, which was "
            f"trained with {own!r}: its embeddings mean that tokenizer's ids. Drop data.tokenizer (the model's own "
            f"is used), or start from weights trained with {tokenizer!r}.")
    return tokenizer if tokenizer == "byte" else str(tokenizer_file(tokenizer).resolve())


def unknown_tokenizer(init_from: str) -> HFFormatError:
    """The error for data.tokenizer = auto when the weights of init_from name no tokenizer."""
    if init_from.startswith("hf:"):
        return HFFormatError(
            f"model.init_from = {init_from!r}: {hf_dir(init_from)} has no tokenizer.json, so the tokenizer its "
            f"weights were trained with is unknown and no data can be built for it. Copy the model's tokenizer.json "
            f"there, or pass --data.tokenizer PATH/tokenizer.json (--data.tokenizer byte only if the model was "
            f"trained on bytes).")
    return HFFormatError(
        f"model.init_from = {init_from!r}: its manifest records no tokenizer (written before longctx recorded one); "
        f"pass the one it was trained with: --data.tokenizer byte or --data.tokenizer PATH/tokenizer.json.")
