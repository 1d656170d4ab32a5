"""`longctx eval --data FILE` reads a text file as one document. A file that is not text was read anyway, as
UTF-8 with every undecodable byte replaced: a compressed file (.gz / .zst, which `longctx data build` reads),
a .jsonl / .parquet / .arrow file (records, which the builder reads by field) or a binary file became a
document of replacement characters and JSON syntax, and ppl's loss and passkey's filler were measured on it,
silently. Each is refused before any work, naming the builder as the way to read it (the glob form too); a
text file reads as the builder reads a text document (data/builder/readers.py decode: CRLF line ends as LF)."""

import gzip
import json

import pytest

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError, DataError
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 12  # ~900 bytes


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("notext")
    return save_hf(build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1),
                   tmp / "hf")


def _prepare(hf, data, task):
    more = ["--depths", "0.5"] if task != "ppl" else []
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--lengths", "256",
         "--samples", "1", "--data", str(data), *more])
    return prepare(args, rest, 1)


def _not_text(tmp_path):
    """Files `longctx data build` reads but that are not text, each holding TEXT's bytes in its own way."""
    (tmp_path / "a.py.gz").write_bytes(gzip.compress(TEXT.encode()))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.split("\n")))
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02" * 400)  # (NUL bytes: binary)
    (tmp_path / "d.py").write_bytes(TEXT.encode() + b"\xff\xfe" + TEXT.encode())  # (not UTF-8)
    return ["a.py.gz", "b.jsonl", "c.bin", "d.py"]


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_a_file_that_is_not_text_is_refused_before_work(hf, tmp_path, task):
    for name in _not_text(tmp_path):
        with pytest.raises((DataError, ConfigError), match="longctx data build") as e:
            _prepare(hf, tmp_path / name, task)
        assert name in str(e.value), (name, str(e.value))


def test_a_glob_holding_a_file_that_is_not_text_is_refused(hf, tmp_path):
    (tmp_path / "ok.py").write_text(TEXT * 2)
    _not_text(tmp_path)
    with pytest.raises((DataError, ConfigError), match="longctx data build"):
        _prepare(hf, f"{tmp_path}/*", "ppl")


def test_a_text_file_reads_as_the_builder_reads_it(hf, tmp_path):
    """Still read (the refusal is not of text): its spans are its UTF-8 bytes (the byte tokenizer), CRLF line
    ends read as LF as a store built from it holds them."""
    (tmp_path / "lf.py").write_text(TEXT)
    (tmp_path / "crlf.py").write_bytes(TEXT.replace("\n", "\r\n").encode())
    expected = list(TEXT.encode()[:256])
    for name in ("lf.py", "crlf.py"):
        (span,) = _prepare(hf, tmp_path / name, "ppl").sequences[256]
        assert span.tokens.tolist() == expected, name
