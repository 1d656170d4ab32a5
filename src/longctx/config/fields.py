"""The configuration's keys as fields: each section's fields by config name (`fields_by_key`, `SECTIONS`), a
value checked against its field's type and choices (`coerce`) or parsed from a flag (`parse_cli_value`),
keys that were renamed (`RENAMED_KEYS`), and a value written as TOML (`toml_value`). Every refusal here is a
ConfigError that names the key, what was expected and, where one is close, the word meant."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Any

from ..errors import ConfigError
from .override_hints import (
    bracket_problem,
    list_hint,
    no_number_hint,
    no_value_problem,
    quoted_problem,
    toml_line,
    whole_number_hint,
)
from .schema import Config


def fields_by_key(section_cls) -> dict[str, dataclasses.Field]:
    return {f.metadata.get("key", f.name): f for f in dataclasses.fields(section_cls)}


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def suggest(word: str, options) -> str:
    options = list(options)  # (the same word in other capitals first: difflib finds no 'bf16' for 'BF16')
    close = [o for o in options if o.lower() == word.lower()] or difflib.get_close_matches(word, options, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _type_name(t: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _or_words(f: dataclasses.Field) -> str:
    """" or 'auto'" for a number field that also takes words (the message once said only "a number")."""
    return "".join(f" or '{w}'" for w in f.metadata.get("words", ()))


def _base_type(f: dataclasses.Field) -> str:
    """The field's type name: 'int', 'float', 'bool' or 'str'. A field typed `float | str` is a number
    that also takes the words in its metadata (e.g. "auto"); its base type is the number."""
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return name.split("|")[0].strip()


TOML_INT = 2**63  # (TOML integers: -2**63 .. 2**63 - 1)


def coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Check a TOML value (or a CLI string, already parsed) against the field's type and choices."""
    if isinstance(value, str) and value in f.metadata.get("words", ()):
        return value
    typ = {"int": int, "float": float, "bool": bool, "str": str}[_base_type(f)]
    ok = (
        (typ is bool and isinstance(value, bool))
        or (typ is int and isinstance(value, int) and not isinstance(value, bool))
        or (typ is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (typ is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{key} must be {_type_name(typ)}{_or_words(f)}, got {value!r} ({type(value).__name__})."
                          + (suggest(value, f.metadata.get("words", ())) if isinstance(value, str) else "")
                          + _unquoted(key, value, f) + list_hint(key, value)
                          + (whole_number_hint(key, value, cli=False) if typ is int and isinstance(value, float)
                             else ""))
    # (a string that is not UTF-8 is refused where a config is written, load.py check_recordable: generate and
    # eval read a checkpoint by such a name and write no config.toml)
    problem = (no_value_problem(key, value, f) or bracket_problem(key, value)) if typ is str else None
    if problem:
        raise ConfigError(problem)
    if typ is int and not -TOML_INT <= value < TOML_INT:  # (else written into a config.toml other TOML readers refuse)
        raise ConfigError(f"{key} = {value} is past a TOML integer's range, -2**63 to 2**63 - 1, in which the run's "
                          f"config.toml records it: give a value within it (a count this large is a typo).")
    if typ is float:
        try:
            value = float(value)
        except OverflowError:  # (a TOML integer past a float's range: a raw traceback)
            value = math.inf if value > 0 else -math.inf
        if not math.isfinite(value):  # (no knob means anything by nan or inf: a NaN lr trains nothing, silently)
            raise ConfigError(f"{key} must be a finite number, got {value!r}"
                              + (" (a number beyond a float's range reads as inf)." if math.isinf(value) else "."))
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{key} = {value!r} is not one of the valid choices: {', '.join(map(str, choices))}."
            + suggest(str(value), map(str, choices))
        )
    return value


def _unquoted(key: str, value: Any, f: dataclasses.Field) -> str:
    """' In TOML a quoted value is a string: write it without the quotes, compile = true.' for a TOML string
    that reads as the field's number or boolean ('must be true or false, got 'true'' gave no fix), else ''."""
    if not isinstance(value, str) or _base_type(f) == "str":
        return ""
    try:
        typed = parse_cli_value(key, value.strip(), f)
    except ConfigError:
        return ""
    if isinstance(typed, float) and not math.isfinite(typed):  # ("nan" unquoted is refused in turn)
        return ""
    return f" In TOML a quoted value is a string: write it without the quotes, {toml_line(key, toml_value(typed))}."


def parse_cli_value(key: str, text: str, f: dataclasses.Field) -> Any:
    typ = _base_type(f)
    if text in f.metadata.get("words", ()):
        return text
    quoted = quoted_problem(key, text)
    if quoted:
        raise ConfigError(quoted)
    hint = no_number_hint(key, text, toml_value(f.default), typ == "float")  # (what '', None or 1,5 meant)
    if typ == "bool":
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} must be true or false (or 1/0, yes/no, on/off), got '{text}'.{hint}")
    if typ in ("int", "float"):
        number = int if typ == "int" else float
        try:
            return number(text)
        except ValueError:
            raise ConfigError(f"{key} must be {_type_name(number)}{_or_words(f)}, got '{text}'."
                              + suggest(text, f.metadata.get("words", ())) + hint
                              + (whole_number_hint(key, text, cli=True) if number is int else "")) from None
    return text


# keys that were renamed: {(section, old name): new name}. An old name a user gives, as a flag or in
# a config file, is an error that names the new one, before any work; only a run's own saved
# config.toml, written before the rename, is read as if it used the new name, so that a resume goes on.
RENAMED_KEYS = {("parallel", "split"): "seq_balance"}  # 'split' means the data store's train/eval split


def renamed(section: str, values: dict[str, Any], path, saved_run: bool) -> dict[str, Any]:
    """`values` of [section] in the file `path` with renamed keys under their new names (saved_run), or
    a ConfigError naming the first old key and its new name."""
    for k in values:
        if (section, k) in RENAMED_KEYS and not saved_run:
            new = RENAMED_KEYS[section, k]
            raise ConfigError(f"{section}.{k} in '{path}' is now called {section}.{new} (the same values); "
                              f"write {new} = ... in its [{section}] table instead.")
    return {RENAMED_KEYS.get((section, k), k): v for k, v in values.items()}


def lookup(section: str, name: str) -> dataclasses.Field:
    if (section, name) in RENAMED_KEYS:
        new = RENAMED_KEYS[section, name]
        raise ConfigError(f"{section}.{name} is now called {section}.{new} (the same values); "
                          f"use --{section}.{new}=... instead.")
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section '{section}'. Valid sections: {', '.join(SECTIONS)}." + suggest(section, SECTIONS)
        )
    fields = fields_by_key(SECTIONS[section])
    if name not in fields:
        raise ConfigError(
            f"unknown config key '{section}.{name}'. Valid keys in [{section}]: {', '.join(fields)}."
            + (_sub_table(section, name, fields) or _elsewhere(section, name) or suggest(name, fields))
        )
    return fields[name]


def _sub_table(section: str, name: str, fields) -> str:
    """The hint for a key that names a sub-table or goes through one: `--model.moe=8` (model.moe is the keys
    moe.experts, moe.top_k, ...) and `[train.extra]` or `[model.mo]` in a file (no such sub-table); '' otherwise."""
    inside = [k for k in fields if k.startswith(name + ".")]
    if inside:
        return (f" {section}.{name} is a sub-table of keys ({', '.join(inside[:4])}, ...): give one of them, e.g. "
                f"--{section}.{inside[0]}=VALUE, or [{section}.{name}] {inside[0].split('.', 1)[1]} = VALUE in TOML.")
    if "." not in name:
        return ""
    head, tail = name.split(".", 1)
    tables = sorted({k.split(".", 1)[0] for k in fields if "." in k})
    if head in tables:
        return ""  # (a sub-table that is there: its key is misspelled, which suggest() says)
    said = f" [{section}] has no sub-table '{head}'" + (f" (its sub-tables: {', '.join(tables)})." if tables else ".")
    return said + (suggest(head, tables) or (f" Did you mean '{section}.{tail}'?" if tail in fields else ""))


def _elsewhere(section: str, name: str) -> str:
    """' Did you mean 'memory.recompute' (a key of [memory])?' for a key of other sections, '' for none: the
    closest key of [section] was a wrong guess ('train.recompute' suggested 'compile', 'model.seq_len' the
    model's max_seq_len)."""
    others = [s for s, cls in SECTIONS.items() if s != section and name in fields_by_key(cls)]
    return " Did you mean " + " or ".join(f"'{s}.{name}' (a key of [{s}])" for s in others) + "?" if others else ""



def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return {math.inf: "inf", -math.inf: "-inf"}.get(v, "nan")
        return repr(v)
    if isinstance(v, int):
        return str(v)
    # a JSON string is a TOML basic string but for JSON's surrogate pairs (a path with an emoji wrote a config.toml
    # no resume could read): every character past ASCII as TOML's own \uXXXX or \UXXXXXXXX, so the file stays ASCII
    return "".join(c if ord(c) < 0x7F else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"
                   for c in json.dumps(v, ensure_ascii=False))
