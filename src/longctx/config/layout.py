"""Which layout a `longctx train` runs: the one rule, in one place (no torch).

- A new run takes the degrees the config and command line give; where they give none (every one of
  dp_replicate, dp_shard, head and ctx at its default, and none of them named by a flag: `--parallel.head 1
  --parallel.ctx 1` on 4 ranks is data parallelism, as asked), the launch's ranks run `default_layout`.
- A resume keeps the saved run's layout, on as many ranks as wrote the checkpoint, unless the
  command line names a layout degree or `--nproc`; then the layout is wholly the command line's
  (degrees mixed from two layouts would not multiply to the new world), completed by
  `default_layout` exactly as for a new run. The saved layout is config.toml's where it is the one
  the checkpoint was written under; a rollback past a resume that changed it keeps the checkpoint's
  own, with its ranks, and says so (config/resume_layout.py).

`resolve_layout` applies the rule once and returns the config the ranks run, the overrides that
rebuild it under the launcher, and the resume's changes computed against that final config, so what
is printed is what runs (issue 53: a resume once printed `parallel.ctx 2 -> 1` and then ran ctx 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .load import check_recordable, parse_overrides, read_raw
from .resume import LAYOUT_KEYS, Resumed, load_run_config, resume_checkpoint
from .resume_layout import kept_layout
from .resume_moved import unfound_line
from .rules import DEGREES, head_fits
from .schema import Config, ParallelConfig


def default_layout(nproc: int, heads: int = 0, kv_heads: int = 0) -> dict[str, int]:
    """The layout used when no parallel degree is given: 2D whenever it can, that is whenever the
    model's heads split over a head degree of 2 (a 9-head model, as SmolLM2-135M: the context alone,
    ctx = nproc; rules.head_fits)."""
    if nproc >= 4 and nproc % 2 == 0:
        if heads and not head_fits(heads, kv_heads or heads, 2):
            return {"ctx": nproc}
        return {"head": 2, "ctx": nproc // 2}
    if nproc == 2:
        return {"ctx": 2}
    return {}


def cache_layout(nproc: int, heads: int = 0, kv_heads: int = 0) -> dict[str, int]:
    """The layout generation shards its KV cache over when none is given (eval --mode generate,
    longctx generate): default_layout, or ctx = nproc where that is data parallelism (an odd nproc),
    which generation has not."""
    return default_layout(nproc, heads, kv_heads) or {"ctx": nproc}


def layout_world(cfg: Config) -> int | None:
    """The world a config's layout spells out in full (no degree -1, e.g. a written plan): the
    number of processes to start when --nproc is not given."""
    p = cfg.parallel
    degrees = [getattr(p, k) for k in DEGREES]
    return p.dp_replicate * p.dp_shard * p.head * p.ctx if min(degrees) > 0 else None


def _unspelled(cfg: Config) -> bool:
    d = ParallelConfig()
    return all(getattr(cfg.parallel, k) == getattr(d, k) for k in DEGREES)


@dataclass
class Layout:
    cfg: Config  # what every rank runs
    resumed: Resumed | None  # the resume's changes against `cfg` (None: not a resume)
    overrides: list[str]  # the command line's overrides plus the default layout spelled out
    nproc: int
    note: str | None  # said once when the default layout had to bend to the model's heads
    # said in place of the resume's line (`resumed` None) where a resume found neither the run's config.toml nor a
    # config its checkpoint recorded, so that it runs the defaults plus what is given (config/resume_moved.py)
    unfound: str | None = None


def resolve_layout(path: str | Path | None, overrides: Sequence[str], nproc: int | None, *,
                   world: int | None = None, saved_world: Callable[[Config], int | None] = lambda cfg: None,
                   default_nproc: Callable[[Config], int] = lambda cfg: 1) -> Layout:
    """The rule above. `nproc`: --nproc as given (None: not given); `world`: the ranks a launcher
    already started (then they are the world, whatever --nproc says); `saved_world(cfg)`: the ranks
    that wrote the checkpoint a resume continues; `default_nproc(cfg)`: the device's default."""
    raw = read_raw(path, overrides)
    named = bool(nproc) or any(k in raw.get("parallel", {}) for k in LAYOUT_KEYS)
    cfg, resumed = load_run_config(path, overrides, layout_given=named)
    check_recordable(cfg)  # (the run's config.toml: a name not UTF-8, before any work)
    kept = kept_layout(cfg, world) if resumed is not None and not named else None
    if kept is not None:  # (a rollback past a resume that changed the layout: its checkpoint's, on its ranks)
        overrides = [*overrides, *kept.overrides]
        cfg, resumed = load_run_config(path, overrides, layout_given=True)
        resumed, nproc = kept.say(resumed), kept.nproc
    if world:
        nproc = world
    else:
        nproc = nproc or (resumed and saved_world(cfg)) or layout_world(cfg) or default_nproc(cfg)
    overrides, note = list(overrides), None
    if _unspelled(cfg) and not set(DEGREES) & set(parse_overrides(overrides).get("parallel", {})):
        layout = default_layout(nproc, cfg.model.heads, cfg.model.kv_heads)
        if layout != default_layout(nproc):
            note = (f"model.heads {cfg.model.heads} (kv {cfg.model.kv_heads}) do not split over a head degree of 2, "
                    f"so the {nproc} ranks run the default layout as ctx {nproc} (sequence parallel only); "
                    "--parallel.head / --parallel.ctx choose another")
        if layout:
            overrides += [f"--parallel.{k}={v}" for k, v in layout.items()]
            cfg, resumed = load_run_config(path, overrides, layout_given=True)
    unfound = None if resumed is not None else unfound_line(raw, resume_checkpoint(raw), path)
    return Layout(cfg, resumed, overrides, nproc, note, unfound)
