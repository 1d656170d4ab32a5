"""A rollback runs the layout its checkpoint was written under, on the ranks that wrote it (no torch).

A resume that names no layout degree and no --nproc keeps the saved run's layout on as many ranks as wrote the
checkpoint (config/layout.py). The layout came from the run's config.toml and the ranks from the checkpoint's
manifest: rolled back past a resume that changed the layout, those are two runs' halves (4 ranks written under head
2 x ctx 2, config.toml's head 1 x ctx 2 of a later 2-rank resume: dp_shard 2 x ctx 2 ran, a layout nobody asked for;
or config.toml's ctx 2 on the 1 rank that wrote step 1: refused by the preflight). Where config.toml's layout is not
the checkpoint's, the checkpoint's is kept whole, with its ranks, and said.

The layout is every key of LAYOUT_KEYS (the keys whose naming makes the layout the command line's): the degrees
that multiply to the world, and also parallel.window (it divides ctx), parallel.placement (how head and ctx lie on
the ranks) and parallel.expert (folded over the same ranks, it must divide them): each is part of how the checkpoint
ran, and one taken from another layout may not fit these degrees. It is read from the config the checkpoint recorded
(its manifest's "config"), else from its manifest's "layout" (the degrees as they ran, with the world); a checkpoint
with neither, or whose record gives no world, keeps the rule as it was (config.toml's layout, its ranks); the keys a
manifest of before checkpoints recorded them lacks (expert, window, placement) stay config.toml's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .resume import LAYOUT_KEYS, Resumed, recorded_config, resumed_manifest
from .resume_source import config_text, show
from .rules import DEGREES, degree_problems, degrees_on
from .schema import Config, ParallelConfig


@dataclass
class Written:
    """The layout a checkpoint was written under: `degrees` (LAYOUT_KEYS, as its config gave them), `world`."""

    degrees: dict
    world: int
    step: int

    def overrides(self) -> list[str]:
        """The flags that run it: every key of the layout, so that the ranks rebuild it as a named layout."""
        return [f"--parallel.{k}={v}" for k, v in self.degrees.items()]

    def said(self) -> str:
        """`head 2 x ctx 2 on 4 ranks`: the degrees that are not 1, the other keys where not their defaults."""
        ran = on_world(self.degrees, self.world) or self.degrees
        degrees = " x ".join(f"{k} {ran[k]}" for k in DEGREES if ran[k] != 1)
        if not degrees:
            return "1 rank, no parallel degree"
        default = ParallelConfig()
        extra = "".join(f", {k} {show(ran[k])}" for k in ("window", "placement", "expert")
                        if k in ran and ran[k] != getattr(default, k))
        return f"{degrees}{extra} on {self.world} rank{'s' if self.world != 1 else ''}"


def on_world(degrees: dict, world: int) -> dict | None:
    """`degrees` with its inferred one (-1) worked out on `world` ranks; None where they do not fit it."""
    ran = degrees_on({k: degrees[k] for k in DEGREES}, world)
    return None if ran is None else {**degrees, **ran}


def spelled_as(degrees: dict, now: dict, world: int) -> dict:
    """`degrees` with the one that `now` infers (-1) spelled -1 where it infers the same on `world` ranks (a manifest's
    dp_shard 1 of head 2 x ctx 2 on 4 ranks is config.toml's dp_shard -1 there): the user's spelling kept."""
    for k in (k for k in DEGREES if now[k] == -1 and degrees[k] != -1):
        trial = {**degrees, k: -1}
        if on_world(trial, world) == on_world(degrees, world):
            return trial
    return degrees


def written_layout(manifest: dict, load: Callable[[str], dict] = recorded_config) -> Written | None:
    """The layout of the checkpoint whose manifest is `manifest`: its recorded config's, else its manifest's "layout";
    None where it records no world or no degrees (written before checkpoints recorded them)."""
    layout, step = manifest.get("layout"), int(manifest.get("step") or 0)
    if not isinstance(layout, dict) or not isinstance(layout.get("world"), int) or layout["world"] < 1 or not step:
        return None
    text = config_text(manifest)
    if text is not None:
        try:
            parallel = load(text)["parallel"]
            return Written({k: parallel[k] for k in LAYOUT_KEYS}, layout["world"], step)
        except UserError:  # (ConfigError; or a path it reads gone since: hf.py's)
            pass  # (a record that no longer loads: its manifest's layout, as it ran)
    if not all(k in layout for k in DEGREES):
        return None
    return Written({k: layout[k] for k in LAYOUT_KEYS if k in layout}, layout["world"], step)


@dataclass
class Kept:
    """A rollback's own layout, kept over config.toml's: the flags that run it, its ranks, and what is said."""

    overrides: list[str]
    nproc: int
    line: str

    def say(self, resumed: Resumed) -> Resumed:
        """`resumed` with this line in place of the layout keys' changes (each key given back to config.toml, or, with
        no recorded config, measured from it: one statement of the layout, not a change per key)."""
        layout = tuple(f"parallel.{k} " for k in LAYOUT_KEYS)
        changes = [c for c in resumed.changes if not c.startswith(layout)]
        return Resumed(resumed.run_dir, [*changes, self.line], resumed.note, resumed.base)


def kept_layout(cfg: Config, world: int | None) -> Kept | None:
    """Where the run's config.toml (`cfg`: its layout, no degree named) holds another layout than the resumed
    checkpoint was written under: that checkpoint's, on its ranks (None: they agree, or the checkpoint records no
    layout). `world`: the ranks a launcher already started; another number than wrote the checkpoint keeps the
    rule as it was (the launcher's ranks run config.toml's layout)."""
    written = written_layout(resumed_manifest(cfg, Path(cfg.train.run_dir)))
    if written is None or (world and world != written.world):
        return None
    now = {k: getattr(cfg.parallel, k) for k in LAYOUT_KEYS}
    written.degrees = spelled_as(written.degrees, now, written.world)
    ran, runs = on_world(written.degrees, written.world) or written.degrees, on_world(now, written.world) or now
    # (a key spelled otherwise that runs the same, dp_shard -1 or 2 on 4 ranks of ctx 2, is no other layout)
    differ = [k for k in LAYOUT_KEYS if k in ran and now[k] != written.degrees[k] and runs[k] != ran[k]]
    if not differ:
        return None
    said = ", ".join(f"parallel.{k} {show(now[k])}" for k in differ)
    line = (f"{said} (the run's config.toml, changed after step {written.step}) not applied: step {written.step} "
            f"runs the layout it was written under, {written.said()} (written back to config.toml); name a degree or "
            f"--nproc to run another")
    unrecorded, unfit = _unrecorded(now, written, ran)
    return Kept([*written.overrides(), *unrecorded], written.world, line + unfit)


def _unrecorded(now: dict, written: Written, ran: dict) -> tuple[list[str], str]:
    """The flags for the keys a manifest of before checkpoints recorded them lacks (parallel.expert, window,
    placement): config.toml's, as before the kept layout (its flags name the whole layout, and the defaults ran for
    them with no word), each where it fits the kept degrees, else its default, said (what is added to the line)."""
    fits = {"window": lambda v: not degree_problems({"ctx": ran["ctx"]}, v), "expert": lambda v: written.world % v == 0}
    default, flags, unfit = ParallelConfig(), [], []
    for k in (k for k in LAYOUT_KEYS if k not in written.degrees):
        value = now[k] if fits.get(k, lambda v: True)(now[k]) else getattr(default, k)
        flags.append(f"--parallel.{k}={value}")
        if value != now[k]:
            unfit.append(f"parallel.{k} {show(now[k])} -> {show(value)}")
    if not unfit:
        return flags, ""
    return flags, (f"; {', '.join(unfit)}: step {written.step}'s manifest does not record it, and config.toml's "
                   f"does not fit {written.said()}")
