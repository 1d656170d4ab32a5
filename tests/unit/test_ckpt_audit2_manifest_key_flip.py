"""`longctx checkpoint verify` detects one flipped bit anywhere in manifest.json. A flip inside the name of
the manifest's own "checksum" key ("checksuo") left a manifest that read as one written before manifests had
a checksum: verify said "none recorded ... OK", and from then on nothing checked the manifest at all. A
manifest without its checksum holding a key longctx never writes is now damaged; one whose checksum was
removed by hand (the keys longctx writes, edited) still reads as it is, as documented."""

import json

import pytest

from longctx.checkpoint.manifest import MANIFEST_KEYS, DamagedManifest, read_manifest, write_manifest
from longctx.checkpoint.verify_command import verify_lines
from longctx.config.checkpoint_paths import CheckpointError


def _checkpoint(tmp_path):
    step = tmp_path / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    for name, size in (("__0_0.distcp", 300), (".metadata", 40), ("trainer_state.json", 20)):
        (step / name).write_bytes(b"x" * size)
    write_manifest(step, step=3, layout={"world": 1}, model={"preset": "debug", "family": "llama"}, tokenizer="byte",
                   tokenizer_identity="byte", draft={"kind": "glide"}, trained_positions=64, run_dir="/r",
                   holdout_tokens=8, text_prefix=[1], parent={"name": "step-00000002", "checksum": "ab"})
    return step


def _detected(step) -> bool:
    try:
        return bool(verify_lines(step)[1])
    except CheckpointError:  # (DamagedManifest, or a format no longer its own)
        return True


def test_every_one_bit_flip_of_the_manifest_is_detected(tmp_path):
    step = _checkpoint(tmp_path)
    manifest = step / "manifest.json"
    original = manifest.read_bytes()
    assert not _detected(step)
    missed = []
    for i in range(len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 0x01
        manifest.write_bytes(bytes(flipped))
        if not _detected(step):
            missed.append(original[max(0, i - 8):i + 8].decode())
    assert missed == []


def test_a_checksum_removed_by_hand_still_reads_and_the_writer_keys_are_known(tmp_path):
    step = _checkpoint(tmp_path)
    written = json.loads((step / "manifest.json").read_text())
    assert set(written) <= MANIFEST_KEYS  # (a key write_manifest gains must be known here too)
    del written["checksum"]
    written["step"] = 4  # (edited by hand: the documented way, read as it is)
    (step / "manifest.json").write_text(json.dumps(written))
    assert read_manifest(step)["step"] == 4
    written["stepp"] = 4
    (step / "manifest.json").write_text(json.dumps(written))
    with pytest.raises(DamagedManifest, match="'stepp', which longctx never writes"):
        read_manifest(step)
