"""Conversations as instruction data (`longctx data build --messages-field FIELD [--answers all|last]`).

A record's FIELD holds a conversation, `[{"role": ..., "content": ...}, ...]` ending with the
assistant's answer (or in ShareGPT's form, `[{"from": "human" | "gpt" | "system", "value": ...}, ...]`),
and the tokenizer's own chat template (data/chat_template.py: chat_template.jinja or
tokenizer_config.json, beside the build's tokenizer.json) renders it whole. What is trained on is
each answer as the model writes it: for the assistant's message i, the rendering of the conversation up
to it (messages[:i + 1]) after the rendering of what it answers with the generation prompt (messages[:i],
the text the model reads when it answers; `longctx generate --chat` renders the same), so the answer and
the template's end of its turn, not the template's header of the turn. The rest (system and user
turns, the headers) is read, not trained on.

`--answers all` (the default; what TRL's assistant-only loss and ArcticTraining's SFT train on) trains
every answer that has a message before it and some text or a tool call, except one of OpenAI's fine-tuning
`"weight": 0` (read as history; the turns after the last answer trained on are dropped, as nothing learns from
them; weight other than 0 or 1, or on another role's message: `bad_conversation`); `--answers last` only the
last one trained on, the earlier ones read as the prompt (LLaMA-Factory's mask_history). A template whose
renderings of those prefixes are not prefixes of the whole conversation's (Qwen3's, which writes an empty thinking block
in the last turn only, or one that drops earlier reasoning from the history) cannot be split at the
earlier answers: such a conversation is trained on its last answer only, and counted
(`last_answer_only`, not a skip); where even the last answer's prefix is none, it is skipped and
counted (`chat_template_not_prefix`), as is a conversation that is not a
list of role / content strings with a message before the assistant's last, or that the template
refuses or fails on (`bad_conversation`), and one whose last answer is empty (`empty`).
"""

from __future__ import annotations

from collections import Counter

from ...errors import ConfigError
from ..chat_template import BUILD_DAY, load_chat_template

FLAG = "--messages-field"


ANSWERS = ("all", "last")  # --answers
LONG_CONVERSATIONS = ("truncate", "drop")  # --long-conversations: one longer than a sample
# not a skip: a conversation kept, trained on its last answer only (its template renders earlier answers otherwise
# in the history); taken out of the scan's skip counts by the build (assembly.py) and said on its own
LAST_ONLY = "last_answer_only"
# how a conversation is cut into its answers, in each scan's digest (scan.py plan_digest): 2, an answer that
# calls a tool (tool_calls, content "" or None), and an eos_token that closes the conversation (Phi-3's); 3, rendered
# on chat_template.BUILD_DAY (a template that writes the date wrote the build's own day); 4, OpenAI's per-message
# weight (an answer of weight 0 read, not trained: it was trained; turns after the last trained answer dropped)
RULES = 4


class Conversations:
    """The trained answers of one build's conversations, by its tokenizer's chat template."""

    def __init__(self, tokenizer_spec: str, field: str, answers: str = "all"):
        self.field, self.answers = field, answers
        self.template = load_chat_template(tokenizer_spec, FLAG)

    def _render(self, messages, add_generation_prompt: bool) -> str:
        """The template's rendering on the build's fixed day (chat_template.BUILD_DAY)."""
        return self.template.render(messages, add_generation_prompt, day=BUILD_DAY)

    def pieces(self, messages, skipped: Counter) -> list[str] | None:
        """The conversation's rendering cut into prompt, answer, turns between, answer, ..., last answer
        (the answers trained on), or None (counted in `skipped`)."""
        messages = from_sharegpt(messages)
        if not _is_conversation(messages):
            skipped["bad_conversation"] += 1
            return None
        # a call's missing content (None) rendered as no text: a template that leaves tool_calls out and prints
        # the content as it is (Gemma's `content | trim`) would write "None" and train the model to say it
        messages = [{**m, "content": ""} if m.get("content") is None else m for m in messages]
        weighted = [i for i, m in enumerate(messages) if i and m["role"] == "assistant" and m.get("weight", 1)]
        if not weighted:  # (every answer weight 0: nothing to train on)
            skipped["empty"] += 1
            return None
        # the turns after the last answer trained on are dropped: read after every trained token, they change
        # nothing the model learns, and kept they would have to be a trained last answer (the cut below)
        messages = messages[:weighted[-1] + 1]
        last = len(messages) - 1
        try:
            if not self._answers(messages, last):
                skipped["empty"] += 1  # (nothing to train on but the template's end of turn)
                return None
            earlier = [i for i in weighted[:-1] if self.answers == "all" and self._answers(messages, i)]
            whole = self._render(messages, add_generation_prompt=False)
            ends = self._ends(messages, [*earlier, last], whole)
            if ends is None and earlier:
                # a template that renders an answer otherwise once it is history (Qwen3's empty thinking block,
                # written for the last turn only): the last answer alone, counted
                ends = self._ends(messages, [last], whole)
                if ends is not None:
                    skipped[LAST_ONLY] += 1
        except ConfigError:  # (the template's raise_exception: roles that do not alternate, a system message...)
            skipped["bad_conversation"] += 1
            return None
        if ends is None:
            skipped["chat_template_not_prefix"] += 1
            return None
        cuts = [0, *_merged(ends[:-1]), len(whole)]
        return [whole[a:b] for a, b in zip(cuts, cuts[1:])]

    def _ends(self, messages, trained: list[int], whole: str) -> list[int] | None:
        """Where each trained answer starts and ends in the whole rendering (the renderings of what it answers,
        with the generation prompt, and of itself), or None where one of those is not a prefix of it."""
        bounds = []
        for i in trained:
            bounds.append(self._render(messages[:i], add_generation_prompt=True))
            bounds.append(self._history(messages[:i + 1], whole) if i < len(messages) - 1 else whole)
        ends = [len(b) for b in bounds]
        return ends if all(whole.startswith(b) for b in bounds) and ends == sorted(ends) else None

    def _answers(self, messages: list[dict], i: int) -> bool:
        """Whether the assistant's message i is an answer the model is trained to write: some text, or a call of a
        tool (what a tool-use model must learn to write) that the template renders (one that leaves tool_calls out
        would train the end of the turn alone)."""
        m = messages[i]
        if (m.get("content") or "").strip():
            return True
        if not _calls_tools(m):
            return False
        bare = {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": ""}
        return (self._render([*messages[:i], bare], add_generation_prompt=False)
                != self._render(messages[:i + 1], add_generation_prompt=False))

    def _history(self, messages, whole: str) -> str:
        """The rendering of `messages` (up to an earlier answer) as the whole conversation holds it: without the
        eos_token a template writes after the last message when no answer is asked for (Phi-3's `{% else %}{{
        eos_token }}`), which closes the whole conversation, not each answer."""
        text = self._render(messages, add_generation_prompt=False)
        eos = self.template.special_tokens.get("eos_token")
        if (eos and text.endswith(eos) and not whole.startswith(text) and whole.endswith(eos)
                and whole.startswith(text[:-len(eos)])):
            return text[:-len(eos)]
        return text


# ShareGPT's speakers (`{"from": ..., "value": ...}` messages) as chat templates name them; others kept as given
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def from_sharegpt(messages):
    """A conversation in ShareGPT's form (each message `{"from": "human" | "gpt" | "system" | ..., "value":
    text}`, as LLaMA-Factory and Axolotl read it) as role / content messages; anything else as it is."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "from" in m and "value" in m
                                                  and "role" not in m and "content" not in m for m in messages):
        return messages
    return [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"],
             **{k: v for k, v in m.items() if k not in ("from", "value")}} for m in messages]


def turn_cut(gaps, seq_len: int) -> int:
    """Where a conversation longer than a sample is cut (`--long-conversations truncate`): after its last
    answer that ends with room for the EOS within `seq_len` tokens, as a conversation that ended with that
    answer is stored; 0 where no answer but the last ends (a pair, --answers last) or none fits. `gaps` are
    its training's off / on offsets (tokenize_answers): each answer but the last ends where training turns off."""
    ends = [int(g) for g in gaps[0::2] if g < seq_len]
    return ends[-1] if ends else 0


def _merged(cuts: list[int]) -> list[int]:
    """Answer boundaries with each answer that ends where the next begins joined to it (no turn between)."""
    out: list[int] = []
    for cut in cuts:
        if out and out[-1] == cut:
            out.pop()
        else:
            out.append(cut)
    return out


def _is_conversation(messages) -> bool:
    """A list of messages with role and content strings (other keys go to the template as they are, as
    transformers passes them), the last the assistant's, after one at least (the prompt). An assistant's
    message that calls tools (`tool_calls`, OpenAI's and transformers' form) may have no content (None), and
    may have OpenAI's fine-tuning `weight`, 0 (read, not trained) or 1; no other message has one."""
    return (isinstance(messages, list) and len(messages) > 1
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and (isinstance(m.get("content"), str) or (m.get("content") is None and _calls_tools(m)))
                    and _weight_ok(m) for m in messages)
            and messages[-1]["role"] == "assistant")


def _weight_ok(message: dict) -> bool:
    if "weight" not in message:
        return True
    w = message["weight"]
    return message["role"] == "assistant" and not isinstance(w, bool) and isinstance(w, (int, float)) and w in (0, 1)


def _calls_tools(message: dict) -> bool:
    return isinstance(message.get("tool_calls"), list) and len(message["tool_calls"]) > 0
