"""Audit (data path): a conversation rendered by a chat template that writes the date (Llama 3.2's system header,
"Today Date: {{ strftime_now('%d %b %Y') }}") is the same document whichever day the build runs. Rendered on each
build's own day, an append of the same conversations on another day found none of them (their exact hashes
differed by the date) and stored every one twice; a rebuild, a resumed scan or a shard scan on another day held
other text."""

import datetime as dt
import json

import pytest

pytest.importorskip("transformers")
from test_data_build import opts, quiet, store_documents  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402

from longctx.data import chat_template  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.errors import DataError  # noqa: E402

DATED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.first %}Today Date: "
         "{{ strftime_now('%d %b %Y') }}\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RECORDS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                         {"role": "assistant", "content": f"{2 * i}, since {i} + {i} = {2 * i}."}]} for i in range(12)]


@pytest.fixture
def dated(tmp_path, monkeypatch):
    """A chat tokenizer whose template writes today's date, and a clock set to a day of December (`.day`)."""
    _chat_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(DATED)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))

    class Clock(dt.datetime):
        day = 1

        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2026, 12, cls.day, 12, 0)

    monkeypatch.setattr(chat_template, "datetime", Clock)
    return tmp_path, Clock


def _build(folder, out, **kw):
    kw = {"tokenizer": str(folder / "tokenizer.json"), "messages_field": "messages", "strategy": "bfd",
          "dedup": "exact", "seq_len": 256, **kw}
    return build_store(opts([folder / "chats.jsonl"], folder / out, **kw), log=quiet)


def test_an_append_on_another_day_finds_the_conversations_already_stored(dated):
    folder, clock = dated
    assert _build(folder, "store")["totals"]["documents"] == len(RECORDS)
    clock.day = 2
    with pytest.raises(DataError, match="every document is a duplicate"):
        _build(folder, "store", append=True)


def test_builds_on_two_days_hold_the_same_documents(dated):
    folder, clock = dated
    _build(folder, "day1")
    clock.day = 2
    _build(folder, "day2")
    assert store_documents(folder / "day1") == store_documents(folder / "day2")
