"""A conversation turned into the text an instruction-tuned model was trained on, by the tokenizer's own
chat template, as transformers' `apply_chat_template(messages, add_generation_prompt=...)` renders it:
the prompt of `longctx generate --chat` (with the generation prompt), and the conversations of
`longctx data build --messages-field` (builder/conversations.py: the last answer apart from the rest).

- Where the template is: beside the tokenizer.json in use, `chat_template.jinja` first, else
  tokenizer_config.json's `chat_template` (a string, or a list of named templates, of which
  "default"), the order transformers reads them in. One there that cannot be read (a link to nothing, not
  UTF-8, empty) or a malformed tokenizer_config.json is an error naming the file, never taken for none
  (NoChatTemplate: the tokenizer has none) nor passed over for the next place.
- How it renders: Jinja in a sandbox (templates come from model hubs: untrusted code), blocks
  trimmed as transformers does (trim_blocks, lstrip_blocks, loop controls), with its helpers
  (raise_exception, tojson without HTML escaping, strftime_now, the `{% generation %}` block) and the
  tokenizer's special tokens (bos_token, eos_token, ...) as variables: tokenizer_config.json's, and
  for a tokenizer saved in the older layout (no added_tokens_decoder there) special_tokens_map.json's
  over them, as transformers reads them.
- The rendered text holds its special tokens already, so it is tokenized without adding more (as
  transformers tokenizes a rendered chat).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..errors import ConfigError

MESSAGE_KEYS = ("role", "content")  # what a message holds (generate's prompts file: all it may hold)
# the day a data build renders its conversations on, where a template writes the date (Llama 3.2's system header:
# "Today Date: {{ strftime_now('%d %b %Y') }}"): one fixed day, so that a conversation is the same document in every
# build, append, resumed or shard scan (each rendered on its own day, an append on another day found none of the
# conversations already stored, their exact hashes differing by the date, and stored them again). Llama 3.1's
# templates' own default date. `longctx generate --chat` renders today's, as transformers does at inference.
BUILD_DAY = datetime(2024, 7, 26)


@dataclass(frozen=True)
class ChatTemplate:
    source: str            # the file it was read from (said in errors)
    template: str
    special_tokens: dict   # bos_token, eos_token, ...: variables the template may read

    def render(self, messages: list[dict], add_generation_prompt: bool = True, day: datetime | None = None) -> str:
        """The rendering of `messages`; `day`: the date strftime_now gives (None: today's)."""
        import jinja2

        dated = {} if day is None else {"strftime_now": lambda fmt: day.strftime(fmt)}  # (over the global)
        try:  # (tools and documents are None, as transformers passes them without tools or documents)
            return _compile(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  tools=None, documents=None, **self.special_tokens, **dated)
        except (jinja2.TemplateError, ArithmeticError, LookupError, RecursionError, TypeError, ValueError) as e:
            # (a template is code from a model hub: its own raise_exception, or any error of its expressions)
            raise ConfigError(f"the chat template of {self.source} could not render the messages: {e}") from None

    def check(self, flag: str) -> None:
        """A ConfigError now for a template that does not compile (rather than for every record later)."""
        import jinja2

        try:
            _compile(self.template)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{flag}: the chat template of {self.source} is not a Jinja template this longctx "
                              f"reads ({e}).") from None

    def digest(self) -> str:
        """What the rendering depends on: the template and the special tokens it may read."""
        return hashlib.sha256(json.dumps([self.template, self.special_tokens], sort_keys=True).encode()).hexdigest()


class NoChatTemplate(ConfigError):
    """The tokenizer has no chat template (none beside it, or the byte tokenizer): what a caller for which that is
    an answer (train's store check, an export) catches; a template file that is there but cannot be read, or a
    malformed tokenizer_config.json, is a plain ConfigError naming the file, never read as none."""


def load_chat_template(tokenizer_spec: str, flag: str = "--chat") -> ChatTemplate:
    """The chat template beside the tokenizer.json `tokenizer_spec` names; a NoChatTemplate saying what
    to do when there is none (naming `flag`, the option that asked for it), a ConfigError naming the file
    and why when one is there but cannot be read (a template read as none would be checked as none)."""
    if tokenizer_spec == "byte":
        raise NoChatTemplate(f"{flag} applies the tokenizer's chat template, and the byte tokenizer has none; use a "
                             f"model whose tokenizer comes with one (tokenizer_config.json's chat_template, or "
                             f"chat_template.jinja), or drop {flag}.")
    spec = Path(tokenizer_spec)
    folder = spec if spec.is_dir() else spec.parent  # (--tokenizer DIR names the folder holding tokenizer.json)
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file, flag) if _present(config_file) else {}
    jinja_file = folder / "chat_template.jinja"
    if _present(jinja_file):  # (one that cannot be read is said, not passed over for tokenizer_config.json's)
        template, source = _read_jinja(jinja_file, flag), str(jinja_file)
    else:
        template, source = _named_default(config.get("chat_template"), config_file, flag), str(config_file)
    if not template:
        raise NoChatTemplate(f"{flag}: the tokenizer in {folder} has no chat template (no chat_template.jinja, and "
                             f"no chat_template in tokenizer_config.json); its model was not tuned for chat. Drop "
                             f"{flag}, or pass --tokenizer PATH/tokenizer.json of a tokenizer with one.")
    specials = _special_tokens(config)
    # a tokenizer saved without added_tokens_decoder (the older layout) keeps its special tokens in
    # special_tokens_map.json, which transformers reads over tokenizer_config.json's: Llama-2-style
    # templates write {{ bos_token }}, which would render as nothing without it
    map_file = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and _present(map_file):
        specials.update(_special_tokens(_read_json(map_file, flag)))
    return ChatTemplate(source, template, specials)


def _present(path: Path) -> bool:
    """A name in the folder, whatever it is: a file, a directory, a link to nothing."""
    return path.exists() or path.is_symlink()


def _read_jinja(path: Path, flag: str) -> str:
    """chat_template.jinja's text; a ConfigError when it is not a readable, non-empty UTF-8 file."""
    if not path.is_file():
        what = "a link to a missing file" if path.is_symlink() and not path.exists() else "not a file"
        raise ConfigError(f"{flag}: {path} is {what}, so the tokenizer's chat template cannot be read; restore it "
                          f"(or remove it to use tokenizer_config.json's chat_template).")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: {path} cannot be read as UTF-8 text ({e}); restore it.") from None
    if not text.strip():
        raise ConfigError(f"{flag}: {path} is empty (a download or a copy cut short?), so the tokenizer's chat "
                          f"template cannot be read; restore it (or remove it to use tokenizer_config.json's "
                          f"chat_template).")
    return text


def turn_end_id(template: ChatTemplate, tokenizer) -> int | None:
    """The token that ends the template's turns: the tokenizer's eos_token (tokenizer_config.json's, the
    `eos_token` the template reads: transformers' tokenizer.eos_token; <|im_end|>, <|eot_id|> for an instruct
    tokenizer) when it is one token of `tokenizer`; None otherwise (a text of several tokens is no token to stop
    at). `longctx generate --chat` stops at it (generate/prompts.py with_turn_end), and an export says so to
    transformers (checkpoint/export.py)."""
    text = template.special_tokens.get("eos_token")
    ids = [int(t) for t in tokenizer.encode(text)] if text else []
    return ids[0] if len(ids) == 1 else None


def _special_tokens(declared: dict) -> dict[str, str]:
    """The `*_token` entries of a tokenizer_config.json or special_tokens_map.json, as their text."""
    return {k: token_text(v) for k, v in declared.items() if k.endswith("_token") and token_text(v) is not None}


def check_messages(messages, where: str) -> list[dict]:
    """A prompts file's "messages": a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                          f"objects.")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: message {i} is not an object; each is {{\"role\": ..., \"content\": ...}}.")
        unknown = sorted(set(m) - set(MESSAGE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: message {i} has {', '.join(repr(k) for k in unknown)}, which the chat "
                              f"template is not given; a message holds {' and '.join(MESSAGE_KEYS)} only.")
        for key in MESSAGE_KEYS:
            if not isinstance(m.get(key), str):
                raise ConfigError(f"{where}: message {i} needs a \"{key}\" string.")
    return messages


def _read_json(path: Path, flag: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}: {path} cannot be read ({e}); restore it.") from None
    if not isinstance(value, dict):  # (read as {}, its chat template was taken for none)
        raise ConfigError(f"{flag}: {path} holds a JSON {type(value).__name__}, not the object of a tokenizer's "
                          f"settings; restore it.")
    return value


def _named_default(template, where: Path, flag: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{"name", "template"}, ...] whose "default"."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise ConfigError(f"{flag}: {where}'s chat_template is a list whose entries are not all "
                              f"{{\"name\": ..., \"template\": ...}} objects; restore it.")
        named = {t["name"]: t.get("template") for t in template}
        if "default" not in named:
            raise ConfigError(f"{flag}: {where} names chat templates {sorted(named)} but none is \"default\", the "
                              f"one longctx applies.")
        if not isinstance(named["default"], str) or not named["default"]:
            raise ConfigError(f"{flag}: {where}'s \"default\" chat template is {named['default']!r}, not the text "
                              f"of a template; restore it.")
        return named["default"]
    raise ConfigError(f"{flag}: {where}'s chat_template is neither a string nor a list of named templates.")


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


_COMPILED: dict[str, object] = {}


def _compile(template: str):
    if template not in _COMPILED:
        _COMPILED[template] = _environment().from_string(template)
    return _COMPILED[template]


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; here
        it renders its body and nothing more."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
