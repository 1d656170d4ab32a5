"""Ranges of numbers that rules.py asks beside its own: values the work would otherwise refuse only
deep inside it (a traceback from numpy at the first step), each said here before any work with what
to write instead."""

from __future__ import annotations

from .fields import TOML_INT
from .schema import Config

# torch.manual_seed takes up to 2**64 - 1, but numpy's generators (data order, synthetic samples)
# take no negative seed, and a config.toml is TOML, whose integers are signed 64-bit (fields.py refuses any int
# key's value past them first)
SEED_LIMIT = TOML_INT


def range_problems(cfg: Config) -> list[str]:
    """One sentence with its fix per number out of its range (empty when every one is in it)."""
    t = cfg.train
    problems = []
    if not 0 <= t.seed < SEED_LIMIT:  # (a negative seed stopped the first step in numpy's default_rng)
        problems.append(f"train.seed must be a whole number from 0 to 2**63 - 1 (the data order's generator takes "
                        f"no negative seed), got {t.seed}; e.g. --train.seed 0.")
    block = cfg.parallel.zero_pp_block  # (its upper bound, a unit's shard, needs the model: parallel/fsdp/shard.py)
    if block < 1:  # (the ranks refused it at set-up, after launch and the data store's build)
        problems.append(f"parallel.zero_pp_block = {block} elements is no int8 block of parallel.zero_pp's qwz / qgz: "
                        f"use at least 1 (512 is usual).")
    limit = cfg.checkpoint.exit_after_minutes  # (not a finite number: refused where the config is read)
    if limit < 0:
        problems.append(f"checkpoint.exit_after_minutes must be a number of minutes >= 0 (0 = no limit), got {limit}.")
    return problems
