"""An output that is an existing file the process may write, in a directory that takes no new file (no write
permission on the directory, as a file shared in a read-only folder): `longctx generate --output` and `plan --out`
wrote it in place before outputs were probed (durable.py check_output_path) and generate's lines went to
FILE.partial (generate/output.py); since, both refused it ("no file can be created"). It is written in place
again, without FILE.partial; eval's --output, renamed over (write_text_durably), still needs the directory. The
directory is simulated (tests run as root, whom permissions do not stop): its probe file fails to be made."""

import errno
import json
import tempfile
from types import SimpleNamespace

import pytest

from longctx.data.tokenizer import load_tokenizer
from longctx.durable import check_output_path
from longctx.errors import ConfigError
from longctx.generate.output import Output
from longctx.generate.output_paths import partial_path


@pytest.fixture
def locked(tmp_path, monkeypatch):
    """tmp_path/locked: a directory where no new file can be made; it holds out.jsonl, writable."""
    d = tmp_path / "locked"
    d.mkdir()
    (d / "out.jsonl").write_text("earlier\n")
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and str(dir) == str(d):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return d


def test_an_existing_writable_file_is_accepted_and_written_in_place(locked):
    out = str(locked / "out.jsonl")
    check_output_path("--output", out, {})
    assert partial_path(out) == out
    result = SimpleNamespace(tokens=[104, 105], prompt_tokens=1, finish_reason="length", prefill_tokens_per_s=1.0,
                             decode_tokens_per_s=1.0)
    with Output(load_tokenizer("byte"), [], out, 1, 2, True) as output:
        output.write({"text": "x"}, result, speculative=False)
    assert json.loads((locked / "out.jsonl").read_text())["text"] == "hi"


def test_a_new_file_there_and_a_renamed_over_one_are_still_refused(locked):
    with pytest.raises(ConfigError, match="no file can be created in .*locked"):
        check_output_path("--output", str(locked / "new.jsonl"), {})
    with pytest.raises(ConfigError, match="no file can be created in .*locked"):
        check_output_path("--output", str(locked / "out.jsonl"), {}, renames=True)
