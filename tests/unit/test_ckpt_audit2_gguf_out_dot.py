"""`longctx checkpoint import FILE.gguf --out .` (into the directory one is in, empty) imports there. The output
was kept as the relative '.', so the whole import ran and then failed at its rename ("Device or resource busy:
'.' -> '..replaced-...'", a raw OSError), leaving a stray hidden directory behind; the export made OUT absolute
for that reason, the import did not."""

import pytest

pytest.importorskip("gguf")
from test_gguf_import import TOL, max_err, tiny_llama, write_gguf  # noqa: E402

from longctx.checkpoint.gguf_import import import_gguf  # noqa: E402


def test_out_dot_imports_into_the_current_directory(tmp_path, monkeypatch):
    model = tiny_llama()
    source = write_gguf(model, tmp_path / "tiny.gguf")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = import_gguf(source, ".")
    assert result.out == here
    assert (here / "config.json").is_file() and max_err(here, model) <= TOL
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left beside it
    assert not [p.name for p in here.iterdir() if p.name.startswith(".")]
