"""`longctx train`'s default layout (config/layout.py) is for a command that names no degree: one named at its
default value by a flag is the layout asked for."""

from longctx.config import to_toml
from longctx.config.layout import resolve_layout


def test_degrees_named_at_their_defaults_are_not_replaced_by_the_default_layout():
    """`--nproc 4 --parallel.head 1 --parallel.ctx 1` (data parallelism over 4 ranks) ran head 2 x ctx 2 without a
    word; the ranks the launch starts build the same layout from the overrides it hands them."""
    run = resolve_layout(None, ["--parallel.head=1", "--parallel.ctx=1"], 4)
    assert (run.cfg.parallel.head, run.cfg.parallel.ctx, run.nproc) == (1, 1, 4)
    rank = resolve_layout(None, run.overrides, None, world=run.nproc)
    assert to_toml(rank.cfg) == to_toml(run.cfg)
    plain = resolve_layout(None, [], 4)  # (no degree named: the default layout, as before)
    assert (plain.cfg.parallel.head, plain.cfg.parallel.ctx) == (2, 2)
    other = resolve_layout(None, ["--parallel.expert=1"], 4)  # (not a degree of the world: completed as before)
    assert (other.cfg.parallel.head, other.cfg.parallel.ctx) == (2, 2)
