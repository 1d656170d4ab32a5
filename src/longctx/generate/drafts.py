"""The draft of speculative decoding (`--draft DIR|hf:DIR` of `longctx generate` and `bench decode`):
checked against the target before any weight is read, then loaded.

A draft is either a plain model with its own cache (its longctx or Hugging Face config), or a GliDe or
Clover draft trained by `longctx train --draft.target` (its checkpoint's `draft` record,
checkpoint/glide.py), which reads the target's cache (GliDe) or final hidden states (Clover: one device
only). `draft_config` returns the one or the other.
"""

from __future__ import annotations

from ..errors import ConfigError


def draft_config(draft: str, checkpoint: str, speculate: int, cfg, spec: str, confidence_stop: float = 0.0,
                 window: int | None = None, compile: bool = False):
    """The draft's config (a GliDe draft: its `draft` record), refused before any weight is read when it
    cannot draft for the target `checkpoint` (config `cfg`, tokenizer `spec`): another vocabulary or
    tokenizer, a GliDe draft trained against another target, `speculate` below 1, a confidence stop
    outside [0, 1) or a negative draft window; a Clover draft under head x ctx ranks or `compile`."""
    from ..checkpoint.glide import glide_manifest, target_differences
    from ..config import load_config
    from ..config.checkpoint_paths import check_weights_flag
    from ..config.tokenizer import model_tokenizer, recorded_identity

    if speculate < 1:
        raise ConfigError(f"--speculate must be >= 1 (tokens the draft proposes per target pass), got {speculate}.")
    if not 0 <= confidence_stop < 1:
        raise ConfigError(f"--confidence-stop must be in [0, 1) (a draft probability below which a round's proposals "
                          f"end; 0 = never), got {confidence_stop}.")
    if window is not None and window < 0:
        raise ConfigError(f"--draft-window must be >= 0 (the last N prompt tokens of the draft's own pass; 0 = all), "
                          f"got {window}.")
    check_weights_flag(draft, "--draft")  # (in the flag's words: a missing one was `model.init_from = ...`'s)
    glide = glide_manifest(draft)
    if glide is not None:
        _check_clover_layout(glide, draft, cfg, compile)
        _check_target_identity(glide, draft, checkpoint)
        diffs = target_differences(glide, cfg.model)
        if diffs:
            raise ConfigError(f"--draft {draft} is a GliDe draft trained against {glide['target']['path']}, not "
                              f"--checkpoint {checkpoint}: {'; '.join(diffs)}. Use it with its own target, or "
                              f"train a draft against this one (longctx train --config configs/glide.toml "
                              f"--draft.target {checkpoint}).")
        found, theirs, recorded = glide, glide.get("tokenizer"), recorded_identity(glide["checkpoint"])
    else:
        if window is not None:
            raise ConfigError(f"--draft-window {window} is the prompt window of a GliDe or Clover draft's own pass; "
                              f"--draft {draft} is a plain draft model, which reads the whole prompt with its own "
                              f"cache: drop --draft-window.")
        found = load_config(None, {"model": {"init_from": draft}, "train": {
            "seq_len": 2, "eval_interval": 0, **{k: getattr(cfg.train, k) for k in ("device", "dtype")}}})
        if found.model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(f"--draft {draft} has a vocabulary of {found.model.vocab_size} tokens but the target "
                              f"{checkpoint} has {cfg.model.vocab_size}: a draft must share the target's tokenizer.")
        theirs = model_tokenizer(found.model.init_from)
        recorded = recorded_identity(found.model.init_from) if theirs is not None else None
    _check_draft_tokenizer(draft, theirs, recorded, spec)
    from .loading import check_weight_files  # (its files whole, before the target's weights are read)

    check_weight_files(glide["checkpoint"] if glide is not None else found.model.init_from, "--draft")
    # (the draft keeps its own config: nothing in decoding reads its max_seq_len, and raising it to the
    # target's refused a windowed draft, whose max_seq_len may not pass its window, at any length;
    # draft_notes says where a generation runs past the draft's reach)
    return found


def draft_notes(draft_cfg, positions: int) -> list[str]:
    """The note on a plain draft model (`draft_config`'s config; a GliDe or Clover draft reads the target's
    cache or states instead) run over `positions` (a prompt and its new tokens, the longest) past the positions
    it reaches (config/positions.py: what it trained on, or its sliding window, which longctx does not apply):
    there its proposals are not its model's. The output stays the target's (every token is verified), so it
    is said, not refused: fewer proposals may be kept."""
    if isinstance(draft_cfg, dict) or draft_cfg is None:
        return []
    from ..config.positions import model_reach

    reach = model_reach(draft_cfg.model)
    if positions <= reach.positions:
        return []
    return [f"a prompt and its new tokens take {positions:,} positions, past the {reach.positions:,} the draft "
            f"reaches ({reach.said()}): its proposals there are not its model's. The output is still the target's "
            f"(it verifies every token), but fewer proposals may be kept; a draft trained on longer sequences "
            f"(without a sliding window) drafts better there"]


def _check_draft_tokenizer(draft: str, theirs: str | None, recorded: str | None, spec: str) -> None:
    """A draft shares the target's tokenizer `spec` (its token ids are what the target verifies), compared by
    content (config/tokenizer.py tokenizer_identity): `recorded`, the content the draft's manifest records for
    its tokenizer `theirs`, so that file may have moved (and an edit to it since says nothing); a draft without
    the record (hf:DIR, or written before longctx recorded it) by its file as it is now. A draft that names no
    tokenizer is checked by its vocabulary alone."""
    from ..config.tokenizer import stored_identity, tokenizer_identity

    if theirs is None:
        return
    want = stored_identity({"spec": theirs, "identity": recorded})  # (None: no record, and the file has gone)
    if want is None:
        raise ConfigError(f"--draft {draft} was trained with the tokenizer {theirs}, which no longer exists, and its "
                          f"manifest records not its content (written before longctx recorded it): nothing says it is "
                          f"the target's ({spec}), which a draft must share. Put that tokenizer.json back at {theirs}, "
                          f"or use a draft trained with the target's tokenizer.")
    given = tokenizer_identity(spec)
    if want != given:
        content = f" ({want}; the target's is {given})" if "byte" not in (want, given) else ""
        raise ConfigError(f"--draft {draft} was trained with the tokenizer {theirs}{content}, the target with {spec}: "
                          f"a draft must share the target's tokenizer (its token ids are what the target verifies). "
                          f"Use a draft trained with the target's tokenizer, or the target the draft was made for.")


def _check_clover_layout(record: dict, draft: str, cfg, compile: bool) -> None:
    """A Clover draft decodes on one device, eagerly (generate/drafters.py CloverDrafter): it reads the
    target's final hidden states of every verified token, through a hook on the target's final norm
    (which a compiled step skips), and a cache sharded over head x ctx ranks does not gather them."""
    if record.get("kind") == "clover" and compile:
        raise ConfigError(f"--draft {draft} is a Clover draft, which decodes eagerly (it reads the target's final "
                          f"hidden states through a hook on the target's final norm, which a compiled step skips): "
                          f"drop --compile, or use a GliDe draft.")
    ranks = cfg.parallel.head * cfg.parallel.ctx
    if record.get("kind") == "clover" and ranks > 1:
        raise ConfigError(f"--draft {draft} is a Clover draft, which decodes on one device (it reads the target's "
                          f"final hidden states of every verified token; a cache sharded over head x ctx = {ranks} "
                          f"ranks does not gather them): run with --nproc 1, or use a GliDe draft.")


def _check_target_identity(glide: dict, draft: str, checkpoint: str) -> None:
    """A GliDe draft is used beside the very weights it was trained against (checkpoint/identity.py):
    a target of the same shape, a later step of its run or a fine-tune of it, is another target. A
    draft trained before the identity was recorded is checked by its target's config alone."""
    from ..checkpoint.identity import same_weights, weights_identity

    recorded = glide["target"].get("identity")
    if not recorded:
        return
    given = weights_identity(checkpoint)
    if not same_weights(recorded, given):
        raise ConfigError(f"--draft {draft} is a GliDe draft trained against {glide['target']['path']} (weights "
                          f"{recorded}), but --checkpoint {checkpoint} holds other weights ({given}), although of the "
                          f"same shape it may be: a draft predicts the target it learned from. Use it with its own "
                          f"target, or train a draft against this one (longctx train --config configs/glide.toml "
                          f"--draft.target {checkpoint}).")


def load_draft(draft_cfg, target, device, dtype):
    """The draft model `draft_config` describes: a GliDe draft beside the loaded target, or a model."""
    if isinstance(draft_cfg, dict):
        from ..checkpoint.glide import load_glide_draft

        return load_glide_draft(draft_cfg["checkpoint"], target, device)
    from .loading import load_model

    return load_model(draft_cfg, device, dtype)


def draft_label(draft_cfg, spec: str = "", draft=None) -> str:
    """What the draft is, in words: a GliDe or Clover draft's kind, layers and block (checkpoint/glide.py
    draft_words), and its parameters where the loaded `draft` is given; a plain draft model's name and parameters
    (config/model_name.py); with `spec` (--draft) where it was read: "... from runs/g/checkpoints step 4" (not for
    hf:DIR, whose name says its directory already)."""
    from ..config.model_name import count_words, model_name, weights_read

    if isinstance(draft_cfg, dict):
        from ..checkpoint.glide import draft_words

        count = sum(p.numel() for p in draft.parameters()) if draft is not None else 0
        said = draft_words(draft_cfg, f"{count_words(count)} parameters" if count else "")
    elif draft is None and not spec:
        return draft_cfg.model.label
    else:
        from ..costs.model_states import params_text

        said = f"{model_name(draft_cfg.model)} ({params_text(draft_cfg.model)})"
    where = spec and (weights_read(spec) or ("" if spec.startswith("hf:") else spec))  # (hf:DIR: named by it)
    return said + (f" from {where}" if where else "")
