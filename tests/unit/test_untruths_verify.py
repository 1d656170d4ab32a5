"""`longctx checkpoint verify` says what it checked in readable lines (issue 53 item 10): the
checkpoint, its step and layout, each file's result and a one-line summary; never a raw dict."""

import pytest

from longctx.checkpoint.manifest import write_manifest
from longctx.checkpoint.verify_command import layout_text, run, verify_lines
from longctx.config.checkpoint_paths import CheckpointError

LAYOUT = {"world": 4, "dp_replicate": 1, "dp_shard": 1, "head": 2, "ctx": 2, "window": 0, "placement": "head-first"}


def _checkpoint(tmp_path):
    step = tmp_path / "checkpoints" / "step-00000007"
    step.mkdir(parents=True)
    for name, size in (("__0_0.distcp", 3000), ("__1_0.distcp", 3000), ("trainer_state.json", 40)):
        (step / name).write_bytes(b"x" * size)
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    write_manifest(step, step=7, layout=LAYOUT, model={"preset": "debug", "family": "llama", "layers": 4, "dim": 128},
                   tokenizer="byte", trained_positions=512)
    return step


def test_an_intact_checkpoint_reads_as_lines_with_a_summary(tmp_path, capsys):
    step = _checkpoint(tmp_path)
    assert run(tmp_path / "checkpoints") == 0
    out = capsys.readouterr().out
    assert "{" not in out and "': " not in out  # (the manifest's layout dict used to be printed raw)
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {step} (the latest complete one in {tmp_path / 'checkpoints'})"
    assert "4 ranks: dp_replicate 1 x dp_shard 1 x head 2 x ctx 2, head-first" in lines[1] and "step 7" in lines[1]
    assert "tokenizer byte" in lines[2] and "512 positions" in lines[2]
    assert lines[3].startswith("checked: manifest.json's own checksum (matches)")
    per_file = [line.split() for line in lines[4:-1]]
    assert [f[:2] for f in per_file] == [["ok", "__0_0.distcp"], ["ok", "__1_0.distcp"], ["ok", "trainer_state.json"]]
    assert lines[-1] == "OK: step 7, all 3 files intact (5.9 KiB): sizes and sha256 checksums match."


def test_every_damaged_file_is_named_then_an_error(tmp_path, capsys):
    step = _checkpoint(tmp_path)
    (step / "__0_0.distcp").write_bytes(b"x" * 10)
    (step / "__1_0.distcp").write_bytes(b"y" * 3000)
    lines, problems = verify_lines(step)
    assert set(problems) == {"__0_0.distcp", "__1_0.distcp"}
    assert lines[4].split()[:2] == ["DAMAGED", "__0_0.distcp"] and "has 10 bytes, the manifest says 3000" in lines[4]
    assert lines[5].split()[:2] == ["DAMAGED", "__1_0.distcp"] and "sha256" in lines[5]
    assert lines[6].split()[:2] == ["ok", "trainer_state.json"]
    assert lines[-1].startswith("DAMAGED: 2 of 3 files of step 7 fail the check")
    with pytest.raises(CheckpointError, match="is damaged"):
        run(step)
    assert "DAMAGED" in capsys.readouterr().out  # the lines come first


def test_no_checkpoint_is_said_in_verify_words(tmp_path):
    with pytest.raises(CheckpointError, match="holds no complete checkpoint") as e:
        verify_lines(tmp_path)
    assert "--checkpoint.resume" not in str(e.value)


def test_layout_text():
    assert layout_text({"world": 1}) == "1 process"
    assert layout_text({**LAYOUT, "window": 2, "expert": 2}) == (
        "4 ranks: dp_replicate 1 x dp_shard 1 x head 2 x ctx 2 (window 2), head-first (expert 2 folded over them)")
