"""Reading draft checkpoints (written by `longctx train --draft.target`, train/glide.py: a GliDe draft,
or with draft.kind = clover its Clover draft) for generation: `glide_manifest(path)` says
whether a checkpoint is a draft's (either kind: its record's "kind") and what it was trained against;
`load_glide_draft(path, target_model, device)` builds the draft of that kind beside a loaded target.

A draft checkpoint holds the draft's own weights only (state-dict keys `draft.*`); its manifest's
`model` is the target's config and its `draft` record names the kind, the target (resolved path and
model config) and the draft's layers, block and loss. The embedding and LM head are the target's,
read at decode time from the target model itself (models/glide.py GlideDraft.forward).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.checkpoint_paths import find_checkpoint
from ..errors import ConfigError
from ..models.clover import CloverDraft
from ..models.glide import GlideDraft
from .counted_read import read_counted
from .manager import _single_process
from .manifest import read_manifest, verify

# ModelConfig fields that do not change what the target computes: a draft trained against weights
# loaded under another preset name, path or initialisation, or another max_seq_len, still fits; and Ms-PoE's
# (generate and eval only, never trained with): it changes the target's positions at decode time, which a draft
# reads with plain RoPE (its acceptance may drop; verification keeps decoding lossless: docs/generate.md)
_NOT_COMPUTED = ("preset", "init_from", "init_std", "max_seq_len", "rope_ms_poe", "rope_ms_poe_min",
                 "rope_ms_poe_max", "rope_ms_poe_order", "rope_ms_poe_skip_layers",
                 "padding_idx")  # (which embedding row training leaves fixed: the target computes the same)
_PREFIX = "draft."
DRAFT_KINDS = ("glide", "clover")  # a record's "kind" (draft.kind)
_NAMES = {"glide": "GliDe", "clover": "Clover"}


def glide_manifest(path) -> dict | None:
    """The `draft` record of a draft checkpoint at `path` (a step-* directory, or a checkpoints
    directory for its latest), GliDe or Clover (its "kind", one of DRAFT_KINDS), with `checkpoint` (the
    step directory) and `tokenizer` added; None when `path` holds no complete checkpoint or a
    checkpoint that is not a draft's."""
    found = find_checkpoint(path)
    if found is None:
        return None
    manifest = read_manifest(found)
    record = manifest.get("draft")
    if not isinstance(record, dict) or record.get("kind") not in DRAFT_KINDS:
        return None
    return {**record, "checkpoint": str(found), "tokenizer": manifest.get("tokenizer"),
            "trained_positions": int(manifest.get("trained_positions") or 0)}


def target_differences(record: dict, target_cfg) -> list[str]:
    """What differs between the model config a draft was trained against and `target_cfg` (a
    ModelConfig): "field: draft's target X, given Y" per field that changes what the target computes."""
    saved, given = record["target"]["model"], vars(target_cfg)
    return [f"{k}: the draft's target {saved.get(k)!r}, given {v!r}" for k, v in given.items()
            if k not in _NOT_COMPUTED and k in saved and saved[k] != v]


def load_glide_draft(path, target_model, device=None) -> GlideDraft | CloverDraft:
    """The draft saved at `path` (a GlideDraft, or a CloverDraft where its record's kind says so), on
    `device` (default the target's) in the target's dtype, ready to draft for `target_model` (a
    models/llama.py Llama with the same model config as the one the draft was trained against; its
    `block` attribute is the speculation length it was trained for). Checksums are verified first. A
    ConfigError when `path` is not a draft's checkpoint or its target's model config differs from
    target_model.cfg."""
    record = glide_manifest(path)
    if record is None:
        what = "holds no complete checkpoint" if find_checkpoint(path) is None else \
            "is not a GliDe draft's checkpoint (nor a Clover draft's)"
        raise ConfigError(f"{path} {what} (a draft's manifest has a `draft` record); train one with `longctx train "
                          f"--config configs/glide.toml --draft.target TARGET`.")
    diffs = target_differences(record, target_model.cfg)
    if diffs:
        raise ConfigError(f"the {_NAMES[record['kind']]} draft {record['checkpoint']} was trained against another "
                          f"model ({record['target']['path']}): {'; '.join(diffs)}. Use it with that target, or "
                          f"train a draft against this one.")
    found = Path(record["checkpoint"])
    verify(found, checksums=True)
    weight = target_model.lm_head_weight
    device = weight.device if device is None else torch.device(device)
    draft = build_draft(record, target_model.cfg).to(device=device)
    read_draft_weights(found, draft)
    for p in draft.parameters():  # (not the buffers: the RoPE frequencies stay fp32)
        p.data = p.data.to(weight.dtype)
    draft.block = int(record["block"])
    # (0: a checkpoint from before it was recorded). Under train.stages the record holds the last stage's length,
    # which a checkpoint saved in an earlier stage never trained on: the manifest's trained_positions says how far
    trained = int(record.get("seq_len", 0))
    draft.trained_seq_len = min(trained, record["trained_positions"]) if record["trained_positions"] and trained \
        else trained
    return draft.eval()


def build_draft(record: dict, target_cfg) -> GlideDraft | CloverDraft:
    """The draft module a `draft` record describes (its kind, layers, vocabulary) for a target of model config
    `target_cfg`, its weights not yet read (read_draft_weights)."""
    vocab = int(record.get("vocab", 0))
    if record["kind"] == "clover":
        return CloverDraft(target_cfg, vocab)
    return GlideDraft(target_cfg, int(record["layers"]), vocab)


def read_draft_weights(found: Path, draft: GlideDraft | CloverDraft) -> None:
    """The draft's own tensors (state-dict keys `draft.*`: its parameters and its vocabulary's ids) from the
    checkpoint directory `found` (a step-* directory, verified by the caller) into `draft`: read as every
    checkpoint's tensors are (counted_read.py: the phase "checkpoint: reading PATH", its MB counted)."""
    state = {"model": {_PREFIX + k: v for k, v in draft.state_dict().items()}}
    with _single_process(True):
        read_counted(state, found, no_dist=True)
    draft.load_state_dict({k.removeprefix(_PREFIX): v for k, v in state["model"].items()})


def draft_words(record: dict, params: str = "") -> str:
    """What a draft is, in words, from its `draft` record (or a run's [draft]: kind, layers, block): "a 1-layer
    GliDe draft (block 4)", "a Clover draft (block 4)", with `params` (e.g. "0.23M parameters") in the brackets
    where given. The draft's own figures: its target is named apart, with its own."""
    said = f"block {record['block']}" + (f", {params}" if params else "")
    if record.get("kind") == "clover":
        return f"a Clover draft ({said})"
    return f"a {record['layers']}-layer GliDe draft ({said})"
