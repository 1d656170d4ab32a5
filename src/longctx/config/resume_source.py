"""What a resume's changes are measured from: the config its checkpoint trained under.

A resume builds its config from the run's config.toml (the run's latest intent) with the command line on top, and
rewrites config.toml. A rollback to an older checkpoint, past a resume that changed the config (with
--checkpoint.allow_changes, or a change that needs none), compared against config.toml said "nothing changed" and
trained the older weights under the later settings, though a resume of that checkpoint before the edit would have
refused a change of its model or data unless asked. A checkpoint records the config it trained under (its
manifest's "config": config.toml's text, checkpoint/manifest.py); the changes are said, and refused, against that,
each one that config.toml carries said with where it comes from. A checkpoint written before it recorded one is
compared with config.toml, as it was then. Pure config logic (no torch).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError


@dataclass
class Origin:
    """The config a resume's changes are measured from (`config`: to_dict's form) and which keys of the run's
    config.toml differ from it: `later`, {(section, key)} that config.toml changed after `step` was saved."""

    config: dict
    step: int = 0  # the checkpoint's step, when `config` is its own record (0: it is config.toml's)
    run_file: dict = field(default_factory=dict)  # config.toml's, when it differs from the checkpoint's
    note: str = ""  # said with the changes (a record that no longer loads)
    # {(section, key)} the resume does not take from config.toml: given (a --config file, the command line, the
    # layout it completes) or dropped from the base (train.steps and seq_len under given stages)
    given: set = field(default_factory=set)

    def later(self, diffs: list) -> set[tuple[str, str]]:
        """The changes of `diffs` (section, key, checkpoint's, now) that come from the run's config.toml: it holds the
        value the resume runs, the checkpoint trained under another, and this command did not give it."""
        return {(s, k) for s, k, _, now in diffs
                if self.run_file and self.run_file[s][k] == now and (s, k) not in self.given}

    def from_run_file(self) -> str:
        return f"the run's config.toml, changed after step {self.step}"

    def restored(self, after: dict, skip: set) -> list[str]:
        """Keys the command line gives back to the checkpoint's value where config.toml holds another: said, for
        config.toml is rewritten with them (its earlier text kept: train/setup.py continue_run_files)."""
        return [f"{s}.{k} {show(self.run_file[s][k])} -> {show(v)} in the run's config.toml (back to step "
                f"{self.step}'s)" for s, values in after.items() for k, v in values.items()
                if self.run_file and (s, k) not in skip and self.config[s][k] == v != self.run_file[s][k]]


def show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def flag(section: str, key: str, value: Any) -> str:
    """`--section.key=value` that sets `value` back (a string quoted for a shell where it needs it)."""
    text = shlex.quote(value) if isinstance(value, str) else show(value)
    return f"--{section}.{key}={text}"


def config_text(manifest: dict) -> str | None:
    """The config a checkpoint's manifest records (config.toml's text: checkpoint/manifest.py), None where it records
    none (written before checkpoints recorded theirs)."""
    text = manifest.get("config")
    return text if isinstance(text, str) and text else None


def trained_under(manifest: dict, run_file: dict, load: Callable[[str], dict], where: Path,
                  given: set | None = None) -> Origin:
    """The Origin of a resume of the checkpoint whose manifest is `manifest` ({}: none found, or unreadable), in a
    run whose config.toml loads as `run_file`. `load(text)`: a recorded config's text as a dict, as config.toml is
    loaded (config/resume.py); `where`: the checkpoint's run directory, for messages; `given`: Origin.given."""
    text, step, given = config_text(manifest), int(manifest.get("step") or 0), given or set()
    if text is None or not step:
        return Origin(run_file, given=given)  # (written before checkpoints recorded their config)
    try:
        recorded = load(text)
    except UserError as e:  # (ConfigError; or a path it reads gone since, model.init_from moved: hf.py's)
        return Origin(run_file, note=f"step {step}'s recorded config no longer loads ({e}), so the changes are said "
                                     f"against {where / 'config.toml'}", given=given)
    return Origin(recorded, step, run_file if recorded != run_file else {}, given=given)


def refused_note(later: list, origin: Origin) -> str:
    """What a refusal adds when changes it names come from the run's config.toml: where they come from, and the
    way on besides allowing them: the checkpoint's values given back."""
    if not later:
        return ""
    back = " ".join(flag(s, k, before) for s, k, before, _ in later)
    return (f" {'That change comes' if len(later) == 1 else 'Those changes come'} from the run's config.toml, "
            f"changed after step {origin.step} was saved (by a later resume, most likely), not from this command "
            f"line: to resume step {origin.step} under the settings it trained under, give them back ({back}).")
