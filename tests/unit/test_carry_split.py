"""benchmarks/carry_split.py: a file carried to a device machine in parts over two calls (the SmolLM2 wheel, 93 MB,
over a call's 64 MiB) is joined back byte for byte from parts lying in different folders, and a missing, damaged
or foreign part is an error that names it, with nothing left at the output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from carry_split import CarryError, join_parts, main, split_file  # noqa: E402


@pytest.fixture
def blob(tmp_path):
    path = tmp_path / "src" / "model-0.1-py3-none-any.whl"
    path.parent.mkdir()
    path.write_bytes(os.urandom(100_003))  # (not a multiple of the part count: the last part is shorter)
    return path


def test_parts_in_two_folders_join_to_the_same_bytes(blob, tmp_path):
    parts = split_file(blob, 3, tmp_path / "parts")
    assert [p.name for p in parts] == [f"{blob.name}.part{i}" for i in range(3)]
    assert sum(p.stat().st_size for p in parts) == blob.stat().st_size
    stash, carried = tmp_path / "stash", tmp_path / "carried"  # (the first call's /tmp, the second's .carry)
    stash.mkdir(), carried.mkdir()
    parts[0].rename(stash / parts[0].name)
    for p in parts[1:]:
        p.rename(carried / p.name)
    (tmp_path / "parts" / f"{blob.name}.sha256").rename(carried / f"{blob.name}.sha256")
    out = join_parts(blob.name, [stash, carried], tmp_path / "out" / blob.name)
    assert out.read_bytes() == blob.read_bytes()


def test_the_checksum_file_is_sha256sum_format(blob, tmp_path):
    split_file(blob, 2, tmp_path / "parts")
    r = subprocess.run(["sha256sum", "-c", f"{blob.name}.sha256", "--ignore-missing"], cwd=tmp_path / "parts",
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("OK") == 2, r.stdout + r.stderr


def test_a_missing_part_is_named(blob, tmp_path):
    split_file(blob, 2, tmp_path / "parts")
    (tmp_path / "parts" / f"{blob.name}.part1").unlink()
    with pytest.raises(CarryError, match=r"part 1 of .*\.part1\) is in none of"):
        join_parts(blob.name, [tmp_path / "parts"], tmp_path / "out.whl")
    assert not (tmp_path / "out.whl").exists()


def test_a_damaged_part_is_named_and_nothing_is_written(blob, tmp_path):
    split_file(blob, 2, tmp_path / "parts")
    part = tmp_path / "parts" / f"{blob.name}.part0"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CarryError, match=r"part0 does not match its sha256"):
        join_parts(blob.name, [tmp_path / "parts"], tmp_path / "out.whl")
    assert not list(tmp_path.glob("*out.whl*"))


def test_parts_of_another_split_fail_the_whole_files_hash(blob, tmp_path):
    """Each part's own hash rewritten to match (a checksum file copied from another split): the joined file's
    hash still tells."""
    split_file(blob, 2, tmp_path / "parts")
    sums = tmp_path / "parts" / f"{blob.name}.sha256"
    lines = sums.read_text().splitlines()
    sums.write_text("\n".join(["0" * 64 + "  " + blob.name, *lines[1:]]) + "\n")
    with pytest.raises(CarryError, match=r"joined from 2 parts does not match its sha256"):
        join_parts(blob.name, [tmp_path / "parts"], tmp_path / "out.whl")
    assert not list(tmp_path.glob("*out.whl*"))


def test_no_checksum_file_is_an_error(blob, tmp_path):
    split_file(blob, 2, tmp_path / "parts")
    (tmp_path / "parts" / f"{blob.name}.sha256").unlink()
    with pytest.raises(CarryError, match=r"no .*\.sha256 in"):
        join_parts(blob.name, [tmp_path / "parts"], tmp_path / "out.whl")


def test_the_command_line_reports_errors_with_exit_code_1(blob, tmp_path, capsys):
    assert main(["split", str(blob), "--parts", "2", "--dir", str(tmp_path / "p")]) == 0
    assert main(["join", blob.name, "--from", str(tmp_path / "p"), "--out", str(tmp_path / "j")]) == 0
    assert (tmp_path / "j").read_bytes() == blob.read_bytes()
    assert main(["join", blob.name, "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "k")]) == 1
    assert "carry_split: no " in capsys.readouterr().err
