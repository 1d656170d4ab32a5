"""Weighted data mixtures in the config: `data.path` naming several stores (comma-separated) and
`data.weights`, one non-negative number per store (normalised; '' = in proportion to each store's
training samples, as if the stores were one). Read and checked here, before any work; the blend
itself is data/store_mix.py's.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import ConfigError
from .schema import Config


def store_paths(path: str) -> list[str]:
    """The stores data.path names, in order ('' -> none)."""
    return [p.strip() for p in path.split(",") if p.strip()]


def normal_path(path: str) -> str:
    """data.path as every reader takes it, normalised once where the config is built: its stores stripped and
    joined by plain commas ("stores/a," and "stores/a " -> "stores/a"), as store_paths reads them (one store was
    read raw elsewhere: "'stores/a,' is not a store"). A path of commas and spaces alone names no store."""
    paths = store_paths(path)
    if path and not paths:
        raise ConfigError(f"data.path = {path!r} names no store (only commas and spaces); give the path of a store "
                          f"(or several, comma-separated), or leave data.path unset to build one from data.corpus.")
    return ",".join(paths)


def first_store(path: str) -> str:
    """The first store of data.path ('' when none): what names the run's tokenizer and text prefix (every
    store of a mix is checked to have the same ones: train/setup.py)."""
    paths = store_paths(path)
    return paths[0] if paths else ""


def is_mix(cfg: Config) -> bool:
    """Whether the run reads a blend of several stores (one store, even with a weight, is read as before)."""
    return len(store_paths(cfg.data.path)) > 1


def parse_weights(spec: str) -> list[float]:
    """data.weights as numbers ('' -> []); a ValueError names what is not a number."""
    return [float(w) for w in spec.split(",")] if spec.strip() else []


def mix_problems(cfg: Config) -> list[str]:
    """One sentence with its fix per problem of data.path / data.weights (empty when there is none)."""
    d = cfg.data
    paths = store_paths(d.path)
    problems = []
    if d.weights.strip() and not paths:
        return [f"data.weights ({d.weights}) weighs the stores of data.path, but data.path is not set; name the "
                f"stores, e.g. --data.path books,code --data.weights 0.7,0.3, or drop data.weights."]
    seen = {}
    for p in paths:
        key = str(Path(p).resolve())
        if key in seen:
            problems.append(f"data.path names the store {p} twice ({seen[key]} and {p}); to sample it more "
                            f"often, list it once and raise its weight in data.weights.")
        seen[key] = p
    try:
        weights = parse_weights(d.weights)
    except ValueError:
        return problems + [f"data.weights must be comma-separated numbers, one per store of data.path, got "
                           f"{d.weights!r}."]
    if len(paths) > 1 and d.synthetic:
        problems.append(f"data.synthetic ({d.synthetic}) turns samples of one store into retrieval sequences; it "
                        f"does not apply to a mix of stores (data.path = {d.path}) yet: drop one of them.")
    if not weights:
        return problems
    if len(weights) != len(paths):
        problems.append(f"data.weights has {len(weights)} weight{'s' * (len(weights) != 1)} ({d.weights}) but "
                        f"data.path names {len(paths)} store{'s' * (len(paths) != 1)} ({', '.join(paths)}); give "
                        f"one weight per store, or '' to weigh them by their training samples.")
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        problems.append(f"data.weights must be finite numbers >= 0, got {d.weights}.")
    elif sum(weights) == 0:
        problems.append(f"data.weights are all zero ({d.weights}): no store would be read; give at least one a "
                        f"positive weight.")
    return problems
