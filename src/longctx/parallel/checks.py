"""Every layout problem of a config on a number of ranks, found before any process starts work.

Used by the launcher (fail before torchrun starts workers), by each rank at start-up, and by the
planner (is a predicted plan runnable?).
"""

from __future__ import annotations

from ..config.rules import parse_stages
from ..errors import ConfigError
from .dims import ParallelDims
from .layouts import check_divisible
from .ulysses import check_heads


def check_layout(cfg, world: int) -> ParallelDims:
    """The validated degrees of `cfg` on `world` ranks, or a ConfigError naming what does not fit."""
    dims = ParallelDims.from_config(cfg, world_size=world)
    check_heads(cfg.model.heads, cfg.model.kv_heads, dims.head)
    check_divisible(cfg.train.seq_len, dims.ctx, dims.head)
    if cfg.train.stages:
        for seq_len, _, batch in parse_stages(cfg.train.stages):
            try:
                check_divisible(seq_len, dims.ctx, dims.head)
                _check_batch(batch or cfg.train.global_batch, cfg.train.grad_accum, dims)
            except ConfigError as e:
                raise ConfigError(f"train.stages: {e}") from None
    _check_batch(cfg.train.global_batch, cfg.train.grad_accum, dims)
    return dims


def _check_batch(global_batch: int, grad_accum: int, dims: ParallelDims) -> None:
    dp = dims.dp_replicate * dims.dp_shard
    if global_batch % (dp * grad_accum):
        raise ConfigError(
            f"train.global_batch ({global_batch} sequences per optimizer step) must split evenly into "
            f"train.grad_accum ({grad_accum}) micro-batches over the data-parallel degree dp_replicate x "
            f"dp_shard = {dims.dp_replicate} x {dims.dp_shard} = {dp}; use a multiple of {dp * grad_accum}."
        )
