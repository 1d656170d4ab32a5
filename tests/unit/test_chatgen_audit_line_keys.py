"""A --prompts line holding what another API feeds a chat template beside the messages (a top-level "system" prompt,
OpenAI's and transformers' "tools", transformers' "documents", vLLM's "chat_template_kwargs", ...) is refused, naming
where it belongs: longctx renders the template from "messages" alone, and such a line was rendered without its system
prompt or its tools, without a word (the generation answered another conversation)."""

import json
from types import SimpleNamespace

import pytest

from longctx.errors import ConfigError
from longctx.generate.prompts import read_prompts

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _read(path, chat=True):
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=chat))


@pytest.mark.parametrize("row, key, said", [
    ({"messages": MESSAGES, "system": "You are a pirate."}, "system", 'as the first of "messages"'),
    ({"prompt": "What is 2 + 2?", "system_prompt": "Be brief."}, "system_prompt", 'as the first of "messages"'),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "add"}}]}, "tools",
     "renders the chat template from the messages alone"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
     "renders the chat template from the messages alone"),
])
def test_a_chat_templates_input_beside_the_messages_is_refused(tmp_path, row, key, said):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"line 2 has '{key}'") as e:
        _read(path)
    assert said in str(e.value)


def test_a_system_prompt_beside_a_plain_prompt_is_refused_without_chat_too(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "system": "Be brief."}) + "\n")
    with pytest.raises(ConfigError, match="line 1 has 'system'.*--chat"):
        _read(path, chat=False)


def test_a_system_message_and_metadata_still_read(tmp_path):
    path = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    path.write_text(json.dumps({"messages": messages, "id": 1, "source": "x"}) + "\n")
    assert _read(path) == [{"text": "", "line": 1, "id": 1, "messages": messages}]
