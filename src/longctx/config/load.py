"""Loading and writing the run configuration: TOML plus `--section.key=value` overrides -> Config.

Loading is strict: an unknown section or key, a value of the wrong type, a value outside its
choices or an impossible combination (rules.py) stops the run with a `ConfigError` that names the
key and says what was expected, before any work starts.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .data_mix import normal_path
from .draft_rules import check_draft_target
from .fields import SECTIONS, coerce, fields_by_key, lookup, parse_cli_value, renamed, toml_value
from .hf import check_run_window, resolve_init_from
from .override_hints import flag_hint, not_text_problem
from .presets import MODEL_PRESETS
from .rules import parse_stages, validate
from .schema import Config, DraftConfig, ModelConfig, TrainConfig
from .tokenizer import resolve_tokenizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ----------------------------------------------------------------------------------------------
# Loading


def parse_overrides(args: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Turn `--section.key=value` / `--section.key value` arguments into {section: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument '{arg}'. Config overrides look like --section.key=value "
                f"(sections: {', '.join(SECTIONS)})." + flag_hint(arg, SECTIONS, fields_by_key)
            )
        body = arg[2:]
        if "=" in body:
            dotted, text = body.split("=", 1)
            i += 1
        else:
            dotted = body
            nxt = args[i + 1] if i + 1 < len(args) else None
            f_probe = lookup(*dotted.split(".", 1)) if "." in dotted else None
            is_bool = f_probe is not None and (f_probe.type in ("bool", bool))
            if nxt is None or nxt.startswith("--"):  # (a value missing before the next option: not that option)
                if not is_bool:
                    raise ConfigError(f"--{dotted} needs a value, e.g. --{dotted}=VALUE"
                                      + (f"; '{nxt}' after it is the next option." if nxt else "."))
                text, i = "true", i + 1
            else:
                text, i = nxt, i + 2
        section, name = dotted.split(".", 1)  # a sub-table's key keeps its dot: model + moe.experts
        f = lookup(section, name)
        out.setdefault(section, {})[name] = parse_cli_value(dotted, text, f)
    return out


def read_toml(path: str | Path, what: str, hint: str) -> dict:
    """A TOML file's contents, or a ConfigError naming `what` and how to fix it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} '{path}' " + ("is a directory, not a file" if p.is_dir() else "does not exist")
                          + f". {hint}")
    try:  # (TOML is UTF-8: a file in another encoding, UTF-16 say, or unreadable was a raw traceback; a UTF-8
        # byte-order mark, as Windows editors write it, was "Invalid statement (at line 1, column 1)": skipped)
        return tomllib.loads(p.read_text(encoding="utf-8-sig"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML: {e}.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML: TOML files are UTF-8 text, and byte {e.start} is "
                          f"not (another encoding, such as UTF-16, or not a text file). Save it as UTF-8.") from None
    except OSError as e:
        raise ConfigError(f"{what} '{path}' cannot be read: {e.strerror or e}.") from None


def _toml_text(text: str, where) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}.") from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] | dict | None = None) -> Config:
    """Build a validated Config from an optional TOML file and overrides (CLI strings or a dict)."""
    return build_config(read_raw(path, overrides))


def read_raw(path: str | Path | None = None, overrides: Sequence[str] | dict | None = None, *,
             saved_run: bool = False, text: str | None = None) -> dict:
    """{section: {key: value}} as given by an optional TOML file and overrides on top, unresolved.
    `saved_run`: the file is a run's own saved config.toml (renamed keys read under their new names).
    `text`: that file's TOML text, read in place of the file `path` names (a checkpoint's record of its run's
    config.toml: config/resume_source.py); `path` then names it in messages."""
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        data = (read_toml(path, "config file", "Pass an existing TOML file, e.g. configs/debug.toml.") if text is None
                else _toml_text(text, path))
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"top-level key '{section}' in '{path}' must be a [section] table; "
                    f"valid sections: {', '.join(SECTIONS)}."
                )
            keys = set(fields_by_key(SECTIONS[section])) if section in SECTIONS else set()
            flat = _flatten_tables(values, keys, section, path)
            raw.setdefault(section, {}).update(renamed(section, flat, path, saved_run))
    if overrides:
        parsed = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
        if "model" in raw and "preset" in parsed.get("model", {}):
            raw["model"] = drop_restated_model_keys(raw["model"], parsed["model"]["preset"])
        for section, values in parsed.items():
            raw.setdefault(section, {}).update(values)
    return raw


def drop_restated_model_keys(file_model: dict[str, Any], preset: Any) -> dict[str, Any]:
    """A written config's [model] (a run's saved config.toml: it lists every key, its preset's all among
    them) under a flag naming another preset: its keys that only restate its own preset or the default are
    dropped, so that the flag's preset decides them; the keys it changed stay on top. Kept, they overrode the
    flag's preset (file over preset): the run built the file's model under the flag's preset's name. A
    hand-written file (not every key of its preset listed) keeps every key it gives: each is meant."""
    fields = fields_by_key(ModelConfig)
    own = file_model.get("preset", fields["preset"].default)
    if own == preset or own not in MODEL_PRESETS or file_model.get("init_from"):
        return file_model
    if not set(MODEL_PRESETS[own]) <= set(file_model):
        return file_model
    restated = {**{k: f.default for k, f in fields.items()}, **MODEL_PRESETS[own]}
    kept = {}
    for key, value in file_model.items():
        if key != "preset" and key in restated:  # (every field's key: its default, or the preset's value)
            try:
                if coerce(f"model.{key}", value, fields[key]) == restated[key]:
                    continue
            except ConfigError:
                pass  # (a bad value is kept, to be refused with the rest)
        kept[key] = value
    return kept


def _flatten_tables(values: dict[str, Any], keys: set[str], section: str, path, prefix: str = "") -> dict[str, Any]:
    """A section's keys with its sub-tables flattened: [model.moe] experts = 8 -> "moe.experts": 8
    (how a key of a sub-table is named in code and on the command line too). A table given for one of
    the section's `keys` stays a value, for its type to be refused (`steps = {a = 1}` was "unknown key
    train.steps.a"); a key written twice, quoted ("moe.experts" = 4) and as a sub-table's, is refused
    (the later one won, unsaid)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in keys:
            flat = _flatten_tables(value, keys, section, path, f"{name}.")
        else:
            flat = {name: value}
        twice = sorted(set(flat) & set(out))
        if twice:
            raise ConfigError(f"{section}.{twice[0]} is set twice in '{path}': as \"{twice[0]}\" and in a [{section}."
                              f"{twice[0].rsplit('.', 1)[0]}] table, which name the same key; keep one.")
        out.update(flat)
    return out


def _model_values(values: dict[str, Any], fields: dict[str, dataclasses.Field]) -> dict[str, Any]:
    """[model] as given -> every field the run uses: from the preset, or from the Hugging Face
    config.json of model.init_from (hf.py), with the user's values on top."""
    if values.get("init_from"):
        typed = {k: coerce(f"model.{k}", v, fields[k]) for k, v in values.items()}
        resolved, _ = resolve_init_from(typed)
        return resolved
    preset = coerce("model.preset", values.get("preset", "debug"), fields["preset"])
    if preset == "hf":
        raise ConfigError("model.preset=hf means 'the shapes of model.init_from'; set model.init_from=hf:DIR "
                          "(a local Hugging Face model directory) or pick a named preset.")
    return {**MODEL_PRESETS[preset], **values}


def _staged_train_values(values: dict[str, Any]) -> dict[str, Any]:
    """train.stages decides train.steps (their sum) and train.seq_len (the last stage's length); the
    same values given explicitly are fine (a written config.toml has them), other ones are refused."""

    stages = parse_stages(coerce("train.stages", values["stages"], fields_by_key(TrainConfig)["stages"]))
    derived = {"steps": sum(s for _, s, _ in stages), "seq_len": stages[-1][0]}
    why = {"steps": "the sum of the stages' steps", "seq_len": "the last stage's length"}
    wrong = [key for key, value in derived.items() if key in values and values[key] != value]
    if wrong:
        # every contradiction at once, and the overrides that agree: a --config file (configs/debug.toml) sets
        # both, so "drop train.steps" alone named a key the command line did not hold and hid the next refusal
        said = "; ".join(f"train.{k} = {values[k]} contradicts train.stages = {values['stages']!r}, which makes it "
                         f"{derived[k]} ({why[k]})" for k in wrong)
        raise ConfigError(f"{said}. Drop {' and '.join(f'train.{k}' for k in wrong)} where set (a --config file or "
                          f"the command line), or give {' '.join(f'--train.{k}={derived[k]}' for k in wrong)}.")
    return {**values, **derived}


def _draft_target(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """With draft.target set the model is the target's: the target's weights become model.init_from,
    so its shapes, RoPE and tokenizer are read as init_from reads them (hf.py, tokenizer.py)."""
    target = raw.get("draft", {}).get("target", "")
    if not target:
        return raw
    target = coerce("draft.target", target, fields_by_key(DraftConfig)["target"])
    check_draft_target(target)
    model = dict(raw.get("model", {}))
    given = model.get("init_from")
    if given and given != target:
        raise ConfigError(f"draft.target = {target!r} makes the model the target's (it sets model.init_from), but "
                          f"model.init_from = {given!r} is given too; drop model.init_from.")
    model["init_from"] = target
    return {**raw, "model": model}


def build_config(raw: dict[str, dict[str, Any]]) -> Config:
    """A validated Config from {section: {key: value}} (unset keys take their defaults)."""
    for section in raw:
        if section not in SECTIONS:
            lookup(section, "")
    raw = _finetune_lr(_draft_target(raw))
    sections: dict[str, Any] = {}
    for section in SECTIONS:  # model first: data.tokenizer follows the model's weights
        sections[section] = _build_section(section, dict(raw.get(section, {})), sections)
    cfg = Config(**sections)
    stage_lengths = [length for length, _, _ in parse_stages(cfg.train.stages)] if cfg.train.stages else []
    # (before validate's rule of train.seq_len against model.max_seq_len: the window's words)
    check_run_window(cfg.model.init_from, max([cfg.train.seq_len, *stage_lengths]))
    validate(cfg)
    return cfg


# Fine-tuning trained weights takes a learning rate ~100x below pretraining's: Position Interpolation
# and YaRN extend Llama at 2e-5. The from-scratch default (3e-3, right for the debug models) would
# undo what the weights learned in a few steps, so a run from model.init_from that names no rate
# takes this one, written into its config.toml as any value is.
FINETUNE_LR = 2e-5


def _finetune_lr(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """train.lr = FINETUNE_LR for a run from trained weights (model.init_from, not a GliDe draft,
    which trains from random weights beside them) whose config and command line give no rate."""
    starts_trained = raw.get("model", {}).get("init_from") and not raw.get("draft", {}).get("target")
    if not starts_trained or "lr" in raw.get("train", {}):
        return raw
    return {**raw, "train": {**raw.get("train", {}), "lr": FINETUNE_LR}}


def lr_note(cfg: Config) -> str:
    """What the setup line says of the learning rate: where it came from, and a note when a run from
    trained weights uses a from-scratch rate."""
    said = f"lr {cfg.train.lr:g}"
    if not cfg.model.init_from or cfg.draft.target:
        return said
    if cfg.train.lr == FINETUNE_LR:
        return f"{said} (the fine-tuning default of a run from model.init_from; --train.lr sets another)"
    if cfg.train.lr >= 50 * FINETUNE_LR:
        return (f"{said} (note: a from-scratch rate for weights from model.init_from, which it may undo in a few "
                f"steps; fine-tuning usually takes ~{FINETUNE_LR:g}, the default when no train.lr is given)")
    return said


def build_model_config(values: dict[str, Any]) -> ModelConfig:
    """[model] alone (a preset, or init_from's weights, with the values given on top), unvalidated
    against the rest of a run: what the weights of init_from describe, for instance."""
    return _build_section("model", dict(values), {})


def _build_section(section: str, values: dict[str, Any], built: dict[str, Any]):
    cls = SECTIONS[section]
    for name in values:
        lookup(section, name)
    fields = fields_by_key(cls)
    if section == "model":
        values = _model_values(values, fields)
    if section == "train" and values.get("stages"):
        values = _staged_train_values(values)
    if section == "data":
        if "path" in values:  # (normalised once: every reader of data.path sees the same stores)
            values["path"] = normal_path(coerce("data.path", values["path"], fields["path"]))
        tokenizer = coerce("data.tokenizer", values.get("tokenizer", "auto"), fields["tokenizer"])
        if not tokenizer.strip():  # ('' was the path '.': the working directory's tokenizer.json, if any)
            raise ConfigError("data.tokenizer is empty; write auto (the model's own), byte, or the path of a "
                              "tokenizer.json.")
        values["tokenizer"] = resolve_tokenizer(built["model"].init_from, tokenizer, values.get("path", ""))
    return cls(**{fields[name].name: coerce(f"{section}.{name}", value, fields[name])
                  for name, value in values.items()})


# ----------------------------------------------------------------------------------------------
# Writing


def check_recordable(cfg: Config) -> None:
    """Refuse, naming its key, a string a config.toml cannot record (override_hints.not_text_problem: a name that
    is not UTF-8): asked where a config is written, `longctx train` before any work (config/layout.py; its
    config.toml is what every resume reads) and to_toml. Not by load_config: generate, eval and bench read a
    checkpoint or store by such a name and write no config (`generate --checkpoint $'caf\\xe9'` worked)."""
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            problem = isinstance(value, str) and not_text_problem(f"{section}.{key}", value)
            if problem:
                raise ConfigError(problem)


def to_toml(cfg: Config) -> str:
    check_recordable(cfg)
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for key, f in fields_by_key(cls).items():
            lines.append(f"{key} = {toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {
        section: {key: getattr(getattr(cfg, section), f.name) for key, f in fields_by_key(cls).items()}
        for section, cls in SECTIONS.items()
    }
