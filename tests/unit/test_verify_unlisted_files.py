"""A manifest without its own checksum (as written before manifests had one, or edited by hand) with a shard's
entry removed: `longctx checkpoint verify` said "all files intact" and the export (and a resume) loaded the
unlisted shard unchecked, a flipped byte in it and all (checkpoint/manifest.py unlisted_problems)."""

import json

import pytest

pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import CheckpointError, verify  # noqa: E402
from longctx.checkpoint.verify_command import verify_lines  # noqa: E402


def _unlist(step, name):
    """Remove `name`'s entry and the manifest's checksum (the hand edit), and flip a byte of the file."""
    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("checksum")
    manifest["files"] = [e for e in manifest["files"] if e["path"] != name]
    path.write_text(json.dumps(manifest))
    data = bytearray((step / name).read_bytes())
    data[len(data) // 2] ^= 0x40
    (step / name).write_bytes(data)


def test_a_shard_the_manifest_does_not_list_is_damage_naming_it(tmp_path):
    step = checkpoint(tmp_path, "byte")
    (step / "README.md").write_text("a note of the user's: not read by a load, not damage")
    shard = next(p.name for p in step.iterdir() if p.name.endswith(".distcp"))
    _unlist(step, shard)
    lines, problems = verify_lines(step)
    assert list(problems) == [shard] and "not listed in manifest.json" in problems[shard]
    assert any(line.startswith("  DAMAGED") and shard in line for line in lines)
    assert lines[-1].startswith("DAMAGED: 1 of")
    with pytest.raises(CheckpointError, match=f"{shard} is not listed"):
        verify(step)
    with pytest.raises(CheckpointError, match=f"{shard} is not listed"):
        export_hf(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [".___0_0.distcp", "__0_0 copy.distcp", "backup/rng-rank0.pt",
                                   "backup/__0_0.distcp", "hf/trainer_state.json"])
def test_a_file_no_load_reads_is_no_damage(tmp_path, extra):
    """macOS's '._' attribute copy of a shard (a copy onto exFAT or SMB), a Finder duplicate, a sub-folder's files
    (an old step or a Hugging Face training output kept inside): DCP opens only the top-level shards .metadata
    names, the manager only its own names there, so none of them is read; they were damage, the checkpoint
    refused by verify, export and generate, and skipped by resume auto."""
    step = checkpoint(tmp_path, "byte")
    (step / extra).parent.mkdir(parents=True, exist_ok=True)
    (step / extra).write_bytes(b"\0" * 4096)
    assert verify(step)["step"] == 1
    lines, problems = verify_lines(step)
    assert problems == {} and not any("DAMAGED" in line for line in lines)
