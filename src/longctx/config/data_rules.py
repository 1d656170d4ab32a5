"""[data]'s rules (config/rules.py validate asks them) and data.synthetic's spec: the synthetic tasks a run
mixes into its training samples, parsed here for the data, eval and train modules that read it."""

from __future__ import annotations

from ..errors import ConfigError
from .schema import Config

SYNTHETIC_TASKS = ("passkey", "needle")


def parse_synthetic(spec: str) -> tuple[str, float] | None:
    """data.synthetic "passkey:0.2" -> ("passkey", 0.2); "" -> None; anything else a ConfigError."""
    if not spec:
        return None
    task, _, frac = spec.partition(":")
    try:
        fraction = float(frac)
    except ValueError:
        fraction = -1.0
    if task not in SYNTHETIC_TASKS or not 0 < fraction <= 1:
        raise ConfigError(f"data.synthetic = {spec!r} must be TASK:FRACTION with TASK one of "
                          f"{', '.join(SYNTHETIC_TASKS)} and FRACTION in (0, 1], e.g. \"passkey:0.2\" (a fifth of "
                          f"the training samples); '' = none.")
    return task, fraction


def data_rules(cfg: Config, problems: list[str]) -> None:
    d, t = cfg.data, cfg.train
    try:
        parse_synthetic(d.synthetic)
    except ConfigError as e:
        problems.append(str(e))
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}.")
    if t.eval_interval and d.eval_fraction == 0:
        problems.append("train.eval_interval is set but data.eval_fraction is 0: nothing is held out to evaluate on.")
    if d.max_docs < 0:
        problems.append(f"data.max_docs must be >= 0, got {d.max_docs}.")
    if d.workers < 1:
        problems.append(f"data.workers must be >= 1, got {d.workers}.")
    if not d.corpus.strip():  # ('' was the path '.': the working directory's files became the corpus)
        problems.append("data.corpus is empty; write stdlib (the default) or a directory of text files.")
    elif d.path and d.corpus != "stdlib":
        problems.append(f"data.path ({d.path}) and data.corpus ({d.corpus}) are both set; a store already holds its "
                        f"documents: set data.path to train from a store, or data.corpus to build one.")
