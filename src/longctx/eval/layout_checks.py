"""The layout checks of `longctx eval`, before any rank starts: every length splits over the layout and
the layout runs; --mode generate's narrower one (head x ctx ranks, no data or expert parallelism).
"""

from __future__ import annotations

from ..errors import ConfigError


def _check_layout(cfg, lengths: list[int], mode: str, nproc: int) -> None:
    """Every length splits over the layout, and the layout runs (generation's narrower one too)."""
    from ..job.checks import check_divisible, check_layout
    from ..job.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size=nproc)
    # Score mode feeds each length to training's forward, whose zigzag split wants 2 x ctx x head to divide
    # it; generate mode pads its prompts over the ranks itself (generate/sharded.py), so any length runs.
    for length in lengths if mode != "generate" else ():
        try:
            check_divisible(length, dims.ctx, dims.head)
        except ConfigError as e:
            raise ConfigError(f"--lengths: {e} (the layout is head {dims.head} x ctx {dims.ctx})") from None
    check_layout(cfg, nproc)
    if mode == "generate":
        _check_generation_layout(cfg, dims, nproc)
    else:
        _check_ms_poe_probe(cfg, nproc)


def _check_ms_poe_probe(cfg, nproc: int) -> None:
    """Ms-PoE's attention order ranks the heads on a probe through the whole weights (models/ms_poe.py), which
    score mode's FSDP-sharded model (several processes, or memory.model_states = host: parallel/fsdp/shard.py
    uses_fsdp) does not hold: refused here, before any rank starts and builds its model to refuse it."""
    m = cfg.model
    if m.rope_ms_poe and m.rope_ms_poe_order == "attention" and (nproc > 1 or cfg.memory.model_states == "host"):
        where = f"--nproc {nproc}" if nproc > 1 else "--memory.model_states=host"
        raise ConfigError(f"--model.rope_ms_poe_order=attention ranks each head on a probe with the whole weights, "
                          f"but --mode score under {where} shards the model (FSDP). Set "
                          f"--model.rope_ms_poe_order=index, or evaluate on one process (--nproc 1) with the "
                          f"weights on the device, or use --mode generate, whose ranks each hold the weights.")


def _check_generation_layout(cfg, dims, nproc: int) -> None:
    """--mode generate runs on one process, or on head x ctx ranks that shard the KV cache, each with
    the full weights (generate/sharded.py): no data parallelism, no expert parallelism."""
    dp = dims.dp_replicate * dims.dp_shard
    if dp > 1 or dims.head * dims.ctx != nproc:
        raise ConfigError(f"--mode generate under --nproc {nproc} needs --parallel.head x --parallel.ctx = {nproc} "
                          f"(the layout is data-parallel {dp} x head {dims.head} x ctx {dims.ctx}): generation "
                          f"shards the KV cache over head x ctx ranks and every rank holds the full weights, so "
                          f"there is no data parallelism to split prompts over. Use --nproc "
                          f"{dims.head * dims.ctx}, or --parallel.head/--parallel.ctx whose product is {nproc}.")
    if dims.expert > 1 or dims.window:
        which = "--parallel.expert" if dims.expert > 1 else "--parallel.window"
        raise ConfigError(f"--mode generate: {which} does not apply (every rank holds the full weights and the cache "
                          f"is sharded over head x ctx only); drop it.")
    if dims.head > 1:
        from ..job.checks import check_heads

        check_heads(cfg.model.heads, cfg.model.kv_heads, dims.head)
