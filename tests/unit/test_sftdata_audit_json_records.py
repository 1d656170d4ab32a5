"""A `.json` input to an instruction build (`data build --messages-field` / `--response-field`): longctx reads
records from .jsonl, .parquet and .arrow files, and a .json file as one plain text document (TEXT_SUFFIXES: a
code corpus' package.json). A JSON array of conversations or pairs (alpaca_data.json, ShareGPT's exports) was
thus stored as one document trained on whole, its prompts, its role names and its JSON syntax alike, the build
saying "1 documents, nothing skipped". Refused now before any record is read, naming the file and how to convert it;
a plain build still reads a .json file as text."""

import json

import pytest

pytest.importorskip("transformers")
from test_data_build import opts, quiet  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402

from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.errors import DataError  # noqa: E402

CONVERSATIONS = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]
                 for i in range(4)]
PAIRS = [{"prompt": f"What is {i} + {i}?", "response": str(2 * i)} for i in range(4)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    _chat_tokenizer(d)
    return d


def _build(tmp_path, inputs, folder, **kw):
    return build_store(opts(inputs, tmp_path / "store", dedup="none", strategy="bfd", eval_fraction=0.0,
                            tokenizer=str(folder / "tokenizer.json"), seq_len=256, **kw), log=quiet)


@pytest.mark.parametrize("kind", ["messages", "pairs"])
@pytest.mark.parametrize("layout", ["array", "lines"])
def test_a_json_file_of_records_is_refused_not_trained_whole(tmp_path, folder, kind, layout):
    records = [{"messages": c} for c in CONVERSATIONS] if kind == "messages" else PAIRS
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(records, indent=1) if layout == "array" else
                    "".join(json.dumps(r) + "\n" for r in records))
    kw = {"messages_field": "messages"} if kind == "messages" else {"text_field": "prompt",
                                                                     "response_field": "response"}
    with pytest.raises(DataError, match=r"chats\.json.* JSON Lines"):
        _build(tmp_path, [path], folder, **kw)
    # (as JSON Lines, the same records are conversations or pairs, trained on their answers)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = _build(tmp_path / "lines", [tmp_path / "chats.jsonl"], folder, **kw)
    assert manifest["parts"][0]["counts"]["response_only_documents"] == 4


def test_a_json_file_in_an_input_directory_is_refused_too(tmp_path, folder):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    (data / "b.json.gz").write_bytes(__import__("gzip").compress(json.dumps([{"messages": CONVERSATIONS[0]}]).encode()))
    with pytest.raises(DataError, match=r"b\.json\.gz"):
        _build(tmp_path, [data], folder, messages_field="messages")


def test_a_plain_build_still_reads_a_json_file_as_text(tmp_path, folder):
    path = tmp_path / "package.json"
    path.write_text(json.dumps({"name": "x", "version": "1.0.0", "description": "a package"}, indent=1))
    manifest = _build(tmp_path, [path], folder)
    assert manifest["parts"][0]["counts"]["documents_kept"] == 1
