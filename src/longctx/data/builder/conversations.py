"""Conversations as instruction pairs (`longctx data build --messages-field FIELD`).

A record's FIELD holds a conversation, `[{"role": ..., "content": ...}, ...]` ending with the
assistant's answer, and the tokenizer's own chat template (data/chat_template.py: chat_template.jinja
or tokenizer_config.json, beside the build's tokenizer.json) renders it. The pair is then
- the prompt: the conversation before its last message, rendered with the generation prompt, the text
  the model reads when it answers (`longctx generate --chat` renders the same);
- the response: the rest of the whole conversation's rendering, the last answer and the template's end
  of its turn, which the model learns to write.

Only the last answer is trained on; the earlier ones are prompt (a conversation of several answers to
learn is several records, one per answer). A template whose rendering of the whole conversation does
not begin with the prompt's (one that drops earlier reasoning from the history, say) cannot be split
so: such a record is skipped and counted (`chat_template_not_prefix`), as is a conversation that is not
a list of role / content strings with a message before the assistant's last, or that the template
refuses or fails on (`bad_conversation`), and one whose last answer is empty (`empty`).
"""

from __future__ import annotations

from collections import Counter

from ...errors import ConfigError
from ..chat_template import MESSAGE_KEYS, load_chat_template

FLAG = "--messages-field"


class Conversations:
    """The pairs of one build's conversations, by its tokenizer's chat template."""

    def __init__(self, tokenizer_spec: str, field: str):
        self.field = field
        self.template = load_chat_template(tokenizer_spec, FLAG)

    def pair(self, messages, skipped: Counter) -> tuple[str, str] | None:
        """(prompt, response) of a conversation, or None (counted in `skipped`)."""
        if not _is_conversation(messages):
            skipped["bad_conversation"] += 1
            return None
        if not messages[-1]["content"].strip():
            skipped["empty"] += 1  # (nothing to train on but the template's end of turn)
            return None
        try:
            prompt = self.template.render(messages[:-1], add_generation_prompt=True)
            whole = self.template.render(messages, add_generation_prompt=False)
        except ConfigError:  # (the template's raise_exception: roles that do not alternate, a system message...)
            skipped["bad_conversation"] += 1
            return None
        if not whole.startswith(prompt):
            skipped["chat_template_not_prefix"] += 1
            return None
        return prompt, whole[len(prompt):]


def _is_conversation(messages) -> bool:
    """A list of messages with role and content strings (other keys go to the template as they are, as
    transformers passes them), the last the assistant's, after one at least (the prompt)."""
    return (isinstance(messages, list) and len(messages) > 1
            and all(isinstance(m, dict) and all(isinstance(m.get(k), str) for k in MESSAGE_KEYS) for m in messages)
            and messages[-1]["role"] == "assistant")
