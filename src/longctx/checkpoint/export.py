"""`longctx checkpoint export PATH OUT --to hf`: a complete checkpoint -> a Hugging Face directory.

The manifest records the run's `[model]` (for `init_from = hf:DIR` runs: the imported family,
shapes and RoPE, with the extension overrides), so the export is the same family transformers
loads. The tokenizer goes along: the tokenizer files of the imported Hugging Face directory when it
still exists, else the tokenizer.json the run recorded; when there is none, the caller is told why.
config.json carries the special token ids (bos / eos / pad_token_id) the weights mean: those of the
Hugging Face config.json the run started from (through any longctx checkpoints in between), else
the recorded tokenizer's (the byte tokenizer's 256 / 257; a tokenizer.json's end-of-document token,
the one training separated documents with, and the BOS / pad its tokenizer_config.json declares). A tokenizer
with a chat template whose end of turn config.json leaves out also gets a generation_config.json (unless its
source brought one) naming the ids `longctx generate --chat` stops at: end of turn, then end of document.

OUT is written whole or not at all: everything goes into a temporary directory beside it, synced, and
is renamed into place when complete (a full disk or a kill mid-write leaves OUT as it was, never a
directory that looks like an export and lacks its ids or weights). A previous export in OUT is
replaced whole, so none of its files (another model's tokenizer.json or generation_config.json) stays
beside the new weights. An export says it is one (longctx_export.json: the checkpoint and step it came
from), and only a directory that says so is replaced: a downloaded Hugging Face model holds the same
file names, and replacing it would delete a model the user may not have elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..config.checkpoint_paths import find_checkpoint, moved_aside_note
from ..config.hf import hf_dir, initial_hf_config, manifest_model, model_config
from ..config.hf_export import SPECIAL_TOKEN_KEYS, check_exportable, declared_special_ids, export_notes
from ..config.hf_families import MOE_DEFAULTS, QWEN_FAMILIES, family_window
from ..config.hf_rope import config_reach
from ..config.tokenizer import source_hf, tokenizer_file, tokenizer_identity
from ..data.chat_template import ChatTemplate, NoChatTemplate, load_chat_template, turn_end_id
from ..data.tokenizer import load_tokenizer
from ..durable import fsync_path, publish, scratch_dir
from ..models.hf import TOKENIZER_FILES, copy_tokenizer_files, save_hf
from ..models.llama import build_model
from ..models.moe_eval_routing import dropless_note
from .manifest import CheckpointError, read_manifest
from .weights_only import load_model_weights


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30) -> tuple[Path, list[str], str, list[str]]:
    """(the written directory, the tokenizer files copied, why none were when none were, what config.json
    says differently from how the model trained: config/hf_export.py export_notes)."""
    path = find_checkpoint(checkpoint)
    if path is None:
        raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export (a step-* directory with "
                              f"manifest.json, or a checkpoints directory holding them; a save that was interrupted "
                              f"has none).{moved_aside_note(checkpoint)}")
    manifest = read_manifest(path)
    if manifest.get("draft"):  # (its manifest's [model] is the target's: the weights are not that model's)
        draft = manifest["draft"]
        raise CheckpointError(f"{path} holds a {draft.get('kind', 'glide')} draft trained against "
                              f"{draft.get('target', {}).get('path')!r}, not a model: a draft has no Hugging Face "
                              f"form (it runs beside its target: longctx generate --draft). Export the target "
                              f"instead.")
    cfg = model_config(manifest_model(manifest, path))  # (recorded by config key: "moe.experts")
    check_exportable(cfg)  # (before the whole model is built and read: minutes and its size in memory)
    out = Path(os.path.abspath(Path(out).expanduser()))  # (a name to rename, also for OUT '.')
    check_output(out, cfg.init_from)
    source, why = _tokenizer_source(cfg.init_from, manifest.get("tokenizer"), manifest.get("tokenizer_identity"))
    template = _read_template(source)  # (before the weights' read: minutes for a large model)
    model = build_model(cfg, device="cpu", seed=None)
    load_model_weights(path, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = scratch_dir(out, "exporting")
    trained = int(manifest.get("trained_positions") or 0)  # (0: a checkpoint older than the record)
    try:
        save_hf(model, work, max_shard_bytes=max_shard_bytes, dtype=dtype, trained_positions=trained)
        copied = copy_tokenizer_files(source, work) if source is not None else []
        ids, unknown = special_token_ids(manifest)
        ids, pad_note = _pad_token(cfg, ids)
        config_file = work / "config.json"
        config = {**json.loads(config_file.read_text()), **ids, **_source_window(cfg), **_source_router_coef(cfg)}
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        tokenizer_note = _tokenizer_reach(work, config_reach(config))
        turn_note = _chat_stops(work, config, template)
        (work / EXPORT_MARK).write_text(json.dumps({"format": "longctx-hf-export/1", "checkpoint": str(path),
                                                    "step": manifest.get("step")}, indent=2) + "\n")
        _publish(work, out)
    except (OSError, SafetensorError) as e:  # (a full disk, a quota: safetensors raises its own error, no OSError)
        raise _write_error(e, model, work, out, dtype) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes = (unknown, tokenizer_note, turn_note, _capacity_note(cfg), pad_note)
    return out, copied, why, export_notes(cfg, trained) + [n for n in notes if n]


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_error(e: Exception, model, work: Path, out: Path, dtype: torch.dtype) -> CheckpointError:
    """A write into the temporary directory that failed, said as what it is (with the space the weights need and
    what is free there, where space ran out), not a traceback; OUT is as it was. Another error (a tokenizer file
    the export cannot read, a directory it may not rename) is said as itself: the space advice misled there."""
    if isinstance(e, OSError) and e.errno not in _NO_SPACE:
        return CheckpointError(f"export: {out} could not be written ({e}). Nothing was written to {out} (it is as it "
                               f"was). Fix what the error names (a file's permissions, a read-only directory), or "
                               f"export into another directory.")
    need = sum(t.numel() for t in model.state_dict().values()) * dtype.itemsize
    free = shutil.disk_usage(work).free
    return CheckpointError(f"export: writing {out} failed ({e}); the weights need about {need / 2**20:,.1f} MiB "
                           f"in {str(dtype).removeprefix('torch.')} and {free / 2**20:,.1f} MiB is free in "
                           f"{out.parent}. Nothing was written to {out} (it is as it was). Free space there, or "
                           f"export into a directory on another disk.")


def _capacity_note(cfg) -> str | None:
    """A MoE capacity (moe.capacity_factor) has no config.json key: transformers runs the export dropless, as
    longctx's eval and generate run the checkpoint; the run's training forwards dropped choices, so where they
    did the export's logits are not the ones training computed (~10 apart on a tiny top-1 Mixtral at capacity 1)."""
    return dropless_note(cfg.moe_capacity_factor if cfg.is_moe else 0.0, "transformers runs the export",
                         "a token's output depend on the other tokens of its call; config.json has no key for it, "
                         "and longctx's eval and generate run the checkpoint dropless too")


def _chat_stops(work: Path, config: dict, template: ChatTemplate | None) -> str:
    """Write generation_config.json with the ids `longctx generate --chat` stops at, the chat template's end of
    turn first, then config.json's EOS ids (the end of document, for a run from scratch), when the exported
    tokenizer has a chat template (`template`: _read_template's, of the files copied; None: none, a base
    tokenizer, for which config.json's EOS is generate's stop too) whose end of turn config.json leaves out and no
    generation_config.json came with the source (an hf: source's own is copied unchanged). transformers' generate
    stops at generation_config.json's eos_token_id: with config.json's alone, an answer ran on past <|im_end|>.
    The note says what was written ('': nothing)."""
    tokenizer_json = work / "tokenizer.json"
    if template is None or (work / "generation_config.json").exists() or not tokenizer_json.is_file():
        return ""
    eos = config.get("eos_token_id")
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    turn = turn_end_id(template, load_tokenizer(str(tokenizer_json)))
    if turn is None or turn in eos:
        return ""
    stops = [turn, *eos]
    generation = {k: config.get(k) for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    (work / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": stops}, indent=2) + "\n")
    return (f"generation_config.json's eos_token_id is {stops}: the chat template's end of turn "
            f"{template.special_tokens['eos_token']} (id {turn}), then config.json's EOS {eos}, the ids "
            f"`longctx generate --chat` stops at (transformers' generate stops at them)")


def _tokenizer_reach(work: Path, reach: int) -> str:
    """Raise a copied tokenizer_config.json's model_max_length to the export's reach when it is shorter (a
    source's own length, e.g. 4,096, copied beside weights extended to 16,384): transformers' tokenizer
    truncates to it when asked (truncation=True, pipelines), so inputs the model now reads would be cut
    silently. A longer one (or transformers' unset sentinel, 1e30) is kept. The note says what changed."""
    file = work / "tokenizer_config.json"
    if not file.is_file():
        return ""
    try:
        settings = json.loads(file.read_text())
    except ValueError:
        return ""
    length = settings.get("model_max_length") if isinstance(settings, dict) else None
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length >= reach:
        return ""
    file.write_text(json.dumps({**settings, "model_max_length": reach}, indent=2) + "\n")
    return (f"tokenizer_config.json's model_max_length is {reach}, the positions this export reaches, not the "
            f"starting model's {length:g}: transformers' tokenizers truncate to it when asked")


# what an export writes (save_hf's weights and index, the tokenizer files, its mark): a directory holding
# only these, the mark among them, is a previous export, which a new one replaces whole
EXPORT_MARK = "longctx_export.json"
_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def check_output(out: Path, init_from: str) -> None:
    """Refuse an OUT that is a file, the Hugging Face directory the run started from, a directory holding
    files an export does not write, or one without the mark of an export (replacing it would delete them)."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export: {out} is a file; pass a directory to write (it is created).")
    if not out.is_dir():
        return
    if init_from.startswith("hf:") and hf_dir(init_from).is_dir() and out.resolve() == hf_dir(init_from).resolve():
        raise CheckpointError(f"export: {out} is the Hugging Face directory the run started from "
                              f"(model.init_from={init_from}); export into another directory.")
    own = {"config.json", "model.safetensors.index.json", EXPORT_MARK, *TOKENIZER_FILES}
    held = sorted(p.name for p in out.iterdir())
    other = [name for name in held if name not in own and not _WEIGHT_FILE.match(name)]
    if other:
        raise CheckpointError(f"export: {out} holds files an export does not write ({', '.join(other[:4])}"
                              f"{', ...' if len(other) > 4 else ''}); an export replaces its directory whole. "
                              f"Choose a new or empty directory (or a previous export's).")
    if held and EXPORT_MARK not in held:
        raise CheckpointError(f"export: {out} holds a model longctx did not export ({', '.join(held[:3])}"
                              f"{', ...' if len(held) > 3 else ''}; no {EXPORT_MARK}); an export replaces its "
                              f"directory whole and would delete it. Choose a new or empty directory, or remove "
                              f"{out} first if it is an old export you no longer need.")


def _publish(work: Path, out: Path) -> None:
    """Sync the finished `work` and rename it to `out`; a previous export in `out` is replaced whole."""
    mask = os.umask(0)
    os.umask(mask)
    for file in work.iterdir():  # (safetensors writes its files 0600: the weights, unlike config.json, were
        os.chmod(file, 0o666 & ~mask)  # unreadable to any other user, a serving account or a colleague)
        fsync_path(file)
    os.chmod(work, 0o777 & ~mask)  # (mkdtemp's 0700 -> the usual permissions)
    if not out.exists():
        publish(work, out)
        return
    old = scratch_dir(out, "replaced")
    out.rename(old)  # (onto the empty directory made for it: no name a crashed export left can collide)
    try:
        publish(work, out)
    except BaseException:  # (the previous export back under OUT, as the error says: not left in a hidden folder)
        if not out.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _source_window(cfg) -> dict:
    """The window keys of the config.json the weights started from when its attention was windowed (the
    window >= the run's max_seq_len, or the import is refused): Mistral's sliding_window; Qwen's also
    use_sliding_window and which layers (max_window_layers, layer_types). transformers then runs the
    export as the source ran, past that length too."""
    hf = initial_hf_config(cfg.init_from)
    window = family_window(hf) if hf and hf.get("model_type") == cfg.family else None
    if window is None:
        return {}
    if cfg.family not in QWEN_FAMILIES:
        return {"sliding_window": window}
    return {"use_sliding_window": True, "sliding_window": window,
            **{k: hf[k] for k in ("max_window_layers", "layer_types") if k in hf}}


def _source_router_coef(cfg) -> dict:
    """router_aux_loss_coef of the config.json the weights started from (its family's default where it has none)
    when the run trained without a balancing loss: config.json then says output_router_logits=false, and the
    0.0 hf_config_from_model writes would leave whoever turns it on for the export (a transformers fine-tune)
    with no balancing loss, where the source model has its own coefficient."""
    hf = initial_hf_config(cfg.init_from) if cfg.is_moe and not cfg.moe_aux_loss else None
    if not hf or hf.get("model_type") != cfg.family:
        return {}
    coef = {**MOE_DEFAULTS.get(cfg.family, {}), **{k: v for k, v in hf.items() if v is not None}}
    return {"router_aux_loss_coef": coef["router_aux_loss_coef"]} if "router_aux_loss_coef" in coef else {}


def _pad_token(cfg, ids: dict) -> tuple[dict, str]:
    """(the special ids with pad_token_id as the model trained: model.padding_idx where it is set, the source's own
    value kept where it names the same row, e.g. -1; a note where none is set but an id is written, the source's or
    the tokenizer's, whose row transformers' embedding (padding_idx) gives no gradient and the run trained)."""
    pad = ids.get("pad_token_id")
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
    if cfg.padding_idx >= 0:
        return (ids if pad is not None and pad % cfg.vocab_size == cfg.padding_idx else
                {**ids, "pad_token_id": cfg.padding_idx}), ""
    if pad is None:
        return ids, ""
    return ids, (f"config.json's pad_token_id is {pad}, the row transformers' embedding gives no gradient (its "
                 f"padding_idx); this run trained that row (model.padding_idx -1), so a transformers fine-tune of the "
                 f"export keeps it fixed where longctx moved it")


def special_token_ids(manifest: dict) -> tuple[dict, str]:
    """({bos_token_id, eos_token_id, pad_token_id}: each an id, a list of ids or None, the ones written
    to config.json), and a note when the checkpoint records nothing they could be taken from."""
    hf = initial_hf_config(manifest["model"].get("init_from", ""))
    if hf is not None and any(k in hf for k in SPECIAL_TOKEN_KEYS):
        # (only the ones it names: one it leaves out, transformers' class default, is what the source read as)
        return {k: hf[k] for k in SPECIAL_TOKEN_KEYS if k in hf}, ""
    recorded, identity = manifest.get("tokenizer"), manifest.get("tokenizer_identity")
    path = tokenizer_file(recorded) if recorded else None
    why = ("the checkpoint records no tokenizer" if not recorded else "" if recorded == "byte" else
           f"the run's tokenizer {recorded} no longer exists" if not path.is_file() else
           # (an edited file's ids are another tokenizer's: not the ones the run's documents began and ended with)
           f"the run's tokenizer {recorded} has changed since the run ({identity} then, not this content)"
           if identity and tokenizer_identity(recorded) != identity else "")
    if why:
        return {k: None for k in SPECIAL_TOKEN_KEYS}, (
            f"config.json names no BOS / EOS / pad token ids (null): {why}, and the run started from no Hugging Face "
            f"config.json that names them; set them in config.json before generating with transformers")
    tokenizer = load_tokenizer(recorded)
    # EOS: the token training ended documents with (and `longctx generate` stops at)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": None}
    if path is not None:
        declared = declared_special_ids(path)
        ids.update({k: v for k, v in declared.items() if k != "eos_token_id"})
    return ids, ""


def _tokenizer_source(init_from: str, recorded: str | None, identity: str | None = None) -> tuple[Path | None, str]:
    """Where the export copies its tokenizer files from (the source Hugging Face directory's, else the run's
    recorded tokenizer), or None and why none. `identity`: the content the manifest records for `recorded`
    (config/tokenizer.py), which the files copied must have: the recorded file edited since the run is not its
    tokenizer."""
    init_from = source_hf(init_from, recorded, identity=identity)  # (through checkpoints that kept its tokenizer)
    if init_from.startswith("hf:") and any((hf_dir(init_from) / name).is_file() for name in TOKENIZER_FILES):
        return hf_dir(init_from), ""
    if recorded == "byte":
        return None, ("the run used longctx's byte tokenizer, which has no tokenizer files: transformers loads the "
                      "weights, but text must be encoded as UTF-8 bytes (256 = BOS, 257 = EOS)")
    if not recorded:
        return None, "the checkpoint records no tokenizer (written before longctx recorded one)"
    source = Path(recorded)
    if not (source / "tokenizer.json" if source.is_dir() else source).is_file():
        return None, f"the run's tokenizer {recorded} no longer exists"
    if identity and tokenizer_identity(recorded) != identity:
        return None, f"the run's tokenizer {recorded} has changed since the run ({identity} then, not this content)"
    return source, ""


def _read_template(source: Path | None) -> ChatTemplate | None:
    """The chat template beside the tokenizer the export copies (None: no tokenizer, or one without a template),
    read once: _chat_stops takes it, the copy's files being these. A ConfigError naming the file when it cannot be
    read (data/chat_template.py). Read in the copy only, the error named `--chat`, a flag the export has none of,
    and a scratch directory the failed export removes; and a chat_template.jinja linking to nothing was not copied,
    so the copy's generation stops came from tokenizer_config.json's template, without a word."""
    if source is None:
        return None
    try:
        return load_chat_template(str(source), "checkpoint export (its generation_config.json's end-of-turn stop)")
    except NoChatTemplate:  # (a base tokenizer: _chat_stops writes no stop of its own)
        return None
