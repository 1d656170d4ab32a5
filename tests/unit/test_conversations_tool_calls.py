"""`data build --messages-field` on tool use: an assistant's message that only calls a tool (transformers' and
OpenAI's form: `tool_calls` [...], content None or "") is an answer, trained on as the template renders it (the
call and its end of turn), as transformers' apply_chat_template renders it and TRL's assistant-only loss trains
it; the tool's reply is read, not trained on. (It was: content None, the conversation skipped as not one;
content "", the call read as prompt, never trained.)"""

import json

import pytest

pytest.importorskip("transformers")
from test_conversations import _build  # noqa: E402
from test_data_build import store_documents  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.loader import PackedSamples  # noqa: E402

# (Qwen2.5's way: the content if any, then each call, then the end of the turn)
TOOLS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] %}{{ m['content'] }}"
         "{% endif %}{% for c in m['tool_calls'] or [] %}{{ '<tool_call>' + c['function']['name'] + '</tool_call>' }}"
         "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
         "{% endif %}")
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    _chat_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _trained(root):
    (doc,) = store_documents(root).values()
    found, _ = _targets(PackedSamples(root, "train"))
    return doc, sorted(j for _, j in found)


@pytest.mark.parametrize("content", [None, ""])
@pytest.mark.parametrize("last", [False, True])
def test_an_answer_that_calls_a_tool_is_trained_on(tmp_path, folder, content, last):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": CALL}]
    if not last:
        messages += [{"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    manifest = _build(tmp_path, folder, [{"messages": messages}])
    assert manifest["parts"][0]["counts"]["skipped"] == {}
    doc, trained = _trained(tmp_path / "store")
    said = tok.decode([doc[j] for j in trained], skip_special_tokens=False)
    tail = "" if last else "It is sunny.<|im_end|>\n"
    assert said == f"<tool_call>get_weather</tool_call><|im_end|>\n{tail}<|endoftext|>"


def test_a_message_without_content_that_calls_no_tool_is_still_no_conversation(tmp_path, folder):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    ok = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    manifest = _build(tmp_path, folder, [{"messages": messages}, {"messages": ok}])
    assert manifest["parts"][0]["counts"]["skipped"] == {"bad_conversation": 1}


def test_a_call_the_template_does_not_render_is_no_answer(tmp_path):
    """A template that leaves tool_calls out (SmolLM2's) renders a call with no content as an empty turn: not
    trained on (its end of turn alone would teach the model to say nothing), skipped as empty where it is last."""
    plain = tmp_path / "plain"
    plain.mkdir()
    _chat_tokenizer(plain)
    call = {"role": "assistant", "content": "", "tool_calls": CALL}
    messages = [{"role": "user", "content": "Weather?"}, call, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Sunny."}]
    manifest = _build(tmp_path / "a", plain, [{"messages": messages}, {"messages": messages[:2]}])
    assert manifest["parts"][0]["counts"]["skipped"] == {"empty": 1}
    doc, trained = _trained(tmp_path / "a" / "store")
    from tokenizers import Tokenizer

    said = Tokenizer.from_file(str(plain / "tokenizer.json")).decode([doc[j] for j in trained],
                                                                      skip_special_tokens=False)
    assert said == "Sunny.<|im_end|>\n<|endoftext|>"


def test_a_call_with_content_none_is_not_trained_as_the_text_none(tmp_path):
    """A template that leaves tool_calls out and prints the content as it is (Gemma's `content | trim`) renders
    content None as "None": the call is no answer (skipped as empty), not the answer "None" trained on."""
    from collections import Counter

    from longctx.data.builder.conversations import Conversations

    gemma = ("{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] | trim + "
             "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>assistant\n' }}"
             "{% endif %}")
    _chat_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = gemma
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    conv, skipped = Conversations(str(tmp_path), "messages"), Counter()
    call = {"role": "assistant", "content": None, "tool_calls": CALL}
    assert conv.pieces([{"role": "user", "content": "Weather?"}, call], skipped) is None
    assert skipped == {"empty": 1}
    pieces = conv.pieces([{"role": "user", "content": "Weather?"}, call, {"role": "user", "content": "And?"},
                          {"role": "assistant", "content": "Sunny."}], skipped)
    assert "None" not in "".join(pieces) and pieces[-1] == "Sunny.<end_of_turn>\n"
