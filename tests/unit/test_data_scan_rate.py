"""docs/data.md: 'Each stage prints its counts and MB/s'. The scan's line had no MB/s: its input's bytes are
known only once it has read them, and the stage was timed with 0 bytes. Whole builds and --shard scans."""

import re

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store


def _scan_line(tmp_path, **kw) -> str:
    src = tmp_path / "in"
    src.mkdir()
    for i in range(6):
        (src / f"d{i}.txt").write_text(f"document {i} " + "some words of text " * 200 + "\n")
    lines: list[str] = []
    build_store(BuildOptions(inputs=[str(src)], out=str(tmp_path / "out"), seq_len=64, progress=False, workers=1,
                             **kw), log=lambda *a: lines.append(" ".join(map(str, a))))
    return next(line for line in lines if line.strip().startswith("scan ") and "s " in line)


def _rate(line: str) -> float:
    found = re.search(r"([0-9.]+) MB/s", line)
    assert found, line
    return float(found.group(1))


def test_a_build_says_its_scan_rate(tmp_path):
    assert _rate(_scan_line(tmp_path)) > 0


def test_a_shard_scan_says_its_rate(tmp_path):
    assert _rate(_scan_line(tmp_path, shard=(0, 1))) > 0
