"""An error a chat template raises (its raise_exception, or one of its expressions) for one conversation of a --prompts
file names that prompt: it said only that "the messages" could not be rendered, leaving the line among thousands to
be found by hand."""

import json

import pytest
import test_generate_chat as chat

from longctx.errors import ConfigError


def test_the_prompt_a_template_refuses_is_named(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    chat._chat_tokenizer(folder, jinja_file=True)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (folder / "config.json").write_text(json.dumps(chat.test_hf.hf_config("llama")))
    f = tmp_path / "m.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": role, "content": "hi"}]}) + "\n"
                         for role in ("user", "user", "assistant", "user")))
    with pytest.raises(ConfigError, match="prompt 3 .*could not render the messages: Conversations must start"):
        chat._prepare("--checkpoint", f"hf:{folder}", "--chat", "--prompts", str(f))
