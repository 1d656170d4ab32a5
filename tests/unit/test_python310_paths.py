"""Paths that broke under Python 3.10, which pyproject.toml supports (requires-python >= 3.10): a device
machine's interpreter may be older than this one. Simulated here on a newer Python."""

import sys

from longctx.models import compiled_copies, static_decode
from longctx.train import report


def test_run_setting_reads_toml_without_the_stdlib_tomllib(tmp_path, monkeypatch):
    """train/report.py imported the stdlib's tomllib (3.11+) where config/load.py falls back to tomli."""
    (tmp_path / "config.toml").write_text('[checkpoint]\ndir = "ck"\n')
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` raises ImportError, as on 3.10
    assert report._run_setting(tmp_path, "checkpoint", "dir") == "ck"


def test_compiled_step_renames_a_code_object_without_co_qualname():
    """static_decode (now models/compiled_copies.py) renamed its per-bucket code with co_qualname=..., a keyword
    3.10's code.replace refuses (the compiled decode step, gpu_speed.sh's step 3, failed before its first token)."""
    class Code310:  # a code object as Python 3.10 has it: no co_qualname
        co_name = "static_hidden_states"

        def replace(self, **kw):
            if set(kw) - {"co_name"}:
                raise TypeError(f"{sorted(set(kw) - {'co_name'})} is an invalid keyword argument for replace()")
            return kw

    assert compiled_copies._renamed(Code310(), "f_64") == {"co_name": "f_64"}
    code = static_decode.static_hidden_states.__code__
    renamed = compiled_copies._renamed(code, "f_64")
    assert renamed.co_name == "f_64" and getattr(renamed, "co_qualname", "f_64") == "f_64"
