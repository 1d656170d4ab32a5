"""What a mis-written override or value most likely meant, added to the refusal that fields.py and load.py
raise: `--steps=5` is `--train.steps=5`, `--train.steps=1e3` is `--train.steps=1000`, a TOML list is one
comma-separated string, None is no config value. Each hint is a sentence (with its leading space) or ''."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# the string keys that hold comma-separated lists (a TOML list or [brackets] on the command line is neither)
COMMA_LIST_KEYS = frozenset({"model.moe.dense_layers", "parallel.zero_pp", "train.stages", "data.path",
                             "data.weights", "checkpoint.on_signal"})
# words other languages and formats write for "no value"; the config has none: a string key unset is ''
NO_VALUE_WORDS = ("none", "null", "nil", "~")
EMPTY = '""'  # a TOML empty string


def toml_line(key: str, value: str) -> str:
    """How `key` = `value` is written in a config file: `steps = 5` under [train]; a sub-table's key both ways,
    `moe.experts = 8` under [model] or `experts = 8` in a [model.moe] table (the way docs/moe.md writes it, where
    `moe.experts = 8` would name model.moe.moe.experts)."""
    section, name = key.split(".", 1)
    if "." not in name:
        return f"{name} = {value}"
    table, last = name.rsplit(".", 1)
    return f"{name} = {value} under [{section}] (or {last} = {value} in a [{section}.{table}] table)"


def flag_hint(arg: str, sections: dict[str, type], fields_by_key) -> str:
    """' Did you mean --train.steps=5?' for an argument that is a config override written wrong: without its
    section (--steps=5), without its dashes (train.steps=5, -train.steps=5) or with a dash or an underscore
    for the dot (--train-steps=5, --train_steps=5); '' for anything else."""
    body = arg.lstrip("-")
    name, eq, text = body.partition("=")
    value = f"{eq}{text}"
    known = {f"{s}.{k}": s for s, cls in sections.items() for k in fields_by_key(cls)}
    meant = []
    if name in known:  # (the dashes alone are wrong)
        meant = [name]
    elif "." not in name:
        for spelling in dict.fromkeys((name, name.replace("-", "_"))):
            meant += [f"{s}.{spelling}" for s in sections if f"{s}.{spelling}" in known]  # (a key of every section)
            for s in sections:  # --train-steps, --train_steps: the section joined by a dash or an underscore
                for joint in ("-", "_"):
                    if spelling.startswith(s + joint) and f"{s}.{spelling[len(s) + 1:]}" in known:
                        meant.append(f"{s}.{spelling[len(s) + 1:]}")
    meant = list(dict.fromkeys(meant))
    if not meant:
        return ""
    return " Did you mean " + " or ".join(f"--{m}{value}" for m in meant) + "?"


def whole_number_hint(key: str, value: Any, cli: bool) -> str:
    """' 1e3 is 1000: write --train.steps=1000.' for an integer key given a float with no fraction (TOML's 1e3
    and 5.0 are floats, as is 1e3 on the command line); ' (10.5 has a fraction)' otherwise; '' for no number."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return ""
    if isinstance(value, bool) or not math.isfinite(number):
        return ""
    if not number.is_integer():
        return f" ({value} has a fraction: give a whole number.)"
    write = f"--{key}={int(number)}" if cli else toml_line(key, str(int(number)))
    return f" {value} is {int(number)}: write {write}."


def no_number_hint(key: str, text: str, default: Any, fraction: bool) -> str:
    """The hint for a number or a boolean given no value (`--train.steps=`, `--train.steps=None`: the config has no
    None; leaving the flag out is the default) or, for a number with a `fraction`, a decimal comma (`--train.lr=1,5`);
    '' otherwise."""
    if not text.strip() or text.strip().lower() in NO_VALUE_WORDS:
        return f" The config has no empty or None value: leave --{key} out for its default, {default}."
    if fraction and text.count(",") == 1 and "." not in text:
        try:
            return f" Write the decimal point as '.': --{key}={float(text.replace(',', '.'))!r}."
        except ValueError:
            return ""
    return ""


def list_hint(key: str, value: Any) -> str:
    """' Write the items in one string, comma-separated: path = "a,b".' for a TOML list given to a key that
    holds a comma-separated list; '' otherwise."""
    if key not in COMMA_LIST_KEYS or not isinstance(value, list):
        return ""
    if not value:
        return f' No items are written "": {toml_line(key, EMPTY)}.'
    return f' Write the items in one string, comma-separated: {toml_line(key, _quoted(",".join(map(str, value))))}.'


def no_value_problem(key: str, value: Any, f: dataclasses.Field) -> str | None:
    """The refusal of 'None' or 'null' for a string key whose unset value is '' (a run directory, a path): read
    as text, it named a directory 'None' that the run created (train.run_dir, checkpoint.dir, metrics.file) or a
    file that was not there. None for any other value."""
    if not isinstance(value, str) or value.strip().lower() not in NO_VALUE_WORDS or f.default != "":
        return None
    return (f"{key} = {value!r}: the config has no None or null; {key} unset is '' (its default): leave it out, "
            f"or give --{key}= (empty), or in TOML {toml_line(key, EMPTY)}. (A path named {value}: write "
            f"./{value}.)")


def bracket_problem(key: str, value: Any) -> str | None:
    """The refusal of a comma list in brackets (`--data.path=[a,b]`: read as the stores '[a' and 'b]')."""
    if key not in COMMA_LIST_KEYS or not isinstance(value, str):
        return None
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    return (f"{key} = {value!r}: write the items comma-separated, without brackets: --{key}={text[1:-1].strip()}; "
            f"in TOML, {toml_line(key, _quoted(text[1:-1].strip()))}.")


def not_text_problem(key: str, value: str) -> str | None:
    """The refusal of a string holding a lone surrogate: Python's stand-in for a byte that is not UTF-8 (a Latin-1
    file name on the command line, `--train.run_dir $'caf\\xe9'`). It was accepted and written into config.toml as
    an escape no TOML reader takes, so the run's own config.toml, and any resume of the run, failed to load."""
    bad = next((c for c in value if "\ud800" <= c <= "\udfff"), None)
    if bad is None:
        return None
    byte = f" (byte 0x{ord(bad) - 0xDC00:02x} of another encoding)" if ord(bad) >= 0xDC80 else ""
    return (f"{key} = {value!r} is not UTF-8 text{byte}: a config.toml is UTF-8 and could not record it, so the run "
            f"could not be resumed; give the name in UTF-8 (rename the file or directory, e.g. with convmv).")


def quoted_problem(key: str, text: str) -> str | None:
    """The refusal of a command-line value wrapped in quotes that reached longctx (a script or a launcher's
    argument list that quoted it twice): kept, `--train.run_dir="'runs/a'"` made a directory with quotes in its
    name, and `--train.lr='1e-4'` was 'must be a number'."""
    if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0]:
        return None
    return (f"--{key}={text}: the value is wrapped in quotes, which reached longctx as part of it (a script or "
            f"launcher that quoted it twice); pass it without them: --{key}={text[1:-1]}.")


def _quoted(text: str) -> str:
    return f'"{text}"'
