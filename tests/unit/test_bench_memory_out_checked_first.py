"""`longctx bench memory --out FILE` writes FILE once the measurement has run (minutes at long lengths): a FILE in a
missing directory failed then, after the work, with a traceback. It is refused before any measurement."""

import pytest

import longctx.bench.memory as bench_memory
from longctx.cli import main
from longctx.errors import ConfigError


def test_an_out_in_a_missing_directory_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    measured = []
    monkeypatch.setattr(bench_memory, "_measure_all", lambda args: measured.append(args) or {})
    out = tmp_path / "missing" / "mem.json"
    with pytest.raises(ConfigError, match="does not exist"):
        bench_memory.main(type("A", (), {"probe": "", "out": str(out), "policies": "none"})())
    assert measured == []
    assert main(["bench", "memory", "--seq-len", "256", "--policies", "none", "--out", str(out)]) != 0
    assert "cannot be written" in " ".join(capsys.readouterr().err.split()) and measured == []
