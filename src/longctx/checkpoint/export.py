"""`longctx checkpoint export PATH --to hf OUT`: a complete checkpoint -> a Hugging Face directory.

The manifest records the run's `[model]` (for `init_from = hf:DIR` runs: the imported family,
shapes and RoPE, with the extension overrides), so the export is the same family transformers
loads. The tokenizer goes along: the tokenizer files of the imported Hugging Face directory when it
still exists, else the tokenizer.json the run recorded; when there is none, the caller is told why.
config.json carries the special token ids (bos / eos / pad_token_id) the weights mean: those of the
Hugging Face config.json the run started from (through any longctx checkpoints in between), else
the recorded tokenizer's (the byte tokenizer's 256 / 257; a tokenizer.json's end-of-document token,
the one training separated documents with, and the BOS / pad its tokenizer_config.json declares).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config.hf import hf_dir, initial_hf_config, model_config
from ..config.hf_export import SPECIAL_TOKEN_KEYS, declared_special_ids, export_notes
from ..config.hf_families import family_window
from ..config.tokenizer import tokenizer_file
from ..data.tokenizer import load_tokenizer
from ..models.hf import copy_tokenizer_files, save_hf
from ..models.llama import build_model
from .manager import load_model_weights, resolve_checkpoint
from .manifest import CheckpointError, read_manifest


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30) -> tuple[Path, list[str], str, list[str]]:
    """(the written directory, the tokenizer files copied, why none were when none were, what config.json
    says differently from how the model trained: config/hf_export.py export_notes)."""
    path = resolve_checkpoint(str(checkpoint), Path(checkpoint))
    if path is None:
        raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export.")
    manifest = read_manifest(path)
    cfg = model_config(manifest["model"])  # (recorded by config key: "moe.experts")
    model = build_model(cfg, device="cpu", seed=None)
    load_model_weights(path, model)
    out = save_hf(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype)
    copied, why = _copy_tokenizer(cfg.init_from, manifest.get("tokenizer"), out)
    ids, unknown = special_token_ids(manifest)
    config_file = out / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **ids, **_source_window(cfg)},
                                      indent=2) + "\n")
    return out, copied, why, export_notes(cfg) + ([unknown] if unknown else [])


def _source_window(cfg) -> dict:
    """{"sliding_window": W} when the weights started from a Mistral whose attention was windowed (W >= the
    run's max_seq_len, or the import is refused): transformers then runs the export as the source ran."""
    hf = initial_hf_config(cfg.init_from)
    window = family_window(hf) if hf and hf.get("model_type") == cfg.family else None
    return {} if window is None else {"sliding_window": window}


def special_token_ids(manifest: dict) -> tuple[dict, str]:
    """({bos_token_id, eos_token_id, pad_token_id}: each an id, a list of ids or None, the ones written
    to config.json), and a note when the checkpoint records nothing they could be taken from."""
    hf = initial_hf_config(manifest["model"].get("init_from", ""))
    if hf is not None and any(k in hf for k in SPECIAL_TOKEN_KEYS):
        return {k: hf.get(k) for k in SPECIAL_TOKEN_KEYS}, ""
    recorded = manifest.get("tokenizer")
    path = tokenizer_file(recorded) if recorded else None
    if recorded != "byte" and (path is None or not path.is_file()):
        return {k: None for k in SPECIAL_TOKEN_KEYS}, (
            "config.json names no BOS / EOS / pad token ids (null): " + (
                f"the run's tokenizer {recorded} no longer exists" if recorded else
                "the checkpoint records no tokenizer") + ", and the run started from no Hugging Face config.json that "
            "names them; set them in config.json before generating with transformers")
    tokenizer = load_tokenizer(recorded)
    # EOS: the token training ended documents with (and `longctx generate` stops at)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": None}
    if path is not None:
        declared = declared_special_ids(path)
        ids.update({k: v for k, v in declared.items() if k != "eos_token_id"})
    return ids, ""


def _copy_tokenizer(init_from: str, recorded: str | None, out: Path) -> tuple[list[str], str]:
    if init_from.startswith("hf:") and hf_dir(init_from).is_dir():
        copied = copy_tokenizer_files(hf_dir(init_from), out)
        if copied:
            return copied, ""
    if recorded == "byte":
        return [], ("the run used longctx's byte tokenizer, which has no tokenizer files: transformers loads the "
                    "weights, but text must be encoded as UTF-8 bytes (256 = BOS, 257 = EOS)")
    if not recorded:
        return [], "the checkpoint records no tokenizer (written before longctx recorded one)"
    source = Path(recorded)
    if not (source / "tokenizer.json" if source.is_dir() else source).is_file():
        return [], f"the run's tokenizer {recorded} no longer exists"
    return copy_tokenizer_files(source, out), ""
