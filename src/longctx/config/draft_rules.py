"""[draft]'s rules (config/rules.py validate asks them): its numbers, what GliDe draft training (train/glide.py)
supports, and what draft.kind = clover (models/clover.py, train/glide.py CloverTraining) allows: GliDe's options
that a Clover draft has no use for, and the training it supports (one rank; its one Augmenting Block without a
recompute policy or attention chunks); and check_draft_target: draft.target names weights a draft trains
against (hf:DIR, or a complete longctx checkpoint of a model, not another draft's)."""

from __future__ import annotations

import json

from ..errors import ConfigError
from .checkpoint_paths import MANIFEST, find_checkpoint
from .hf import hf_dir
from .schema import Config


def clover_problems(cfg: Config) -> list[str]:
    """One sentence with its fix per problem of a draft.kind = clover config (none for glide)."""
    d, mem, par = cfg.draft, cfg.memory, cfg.parallel
    if d.kind != "clover":
        return []
    problems = []
    if d.layers != 1:
        problems.append(f"draft.layers = {d.layers} is a GliDe-only option: a Clover draft (draft.kind = clover) has "
                        f"one Augmenting Block and a regressive step; drop draft.layers (1) or use draft.kind = glide.")
    if d.init != "random":
        problems.append(f"draft.init = {d.init} is a GliDe-only option (a copy of the target layer a GliDe layer "
                        f"reads); a Clover draft starts from train.seed: drop draft.init or use draft.kind = glide.")
    if not d.target:
        return problems
    if par.head * par.ctx > 1:
        problems.append(f"Clover draft training runs on one rank (its chained steps read the whole sequence's "
                        f"states; no head x ctx layout is built for it), got parallel.head {par.head} x parallel.ctx "
                        f"{par.ctx}: drop them and run with --nproc 1.")
    if mem.recompute != "none" or mem.attention_chunk:
        problems.append("Clover draft training keeps its activations (memory.recompute none, no "
                        "memory.attention_chunk: its one small block is not worth recomputing); drop them "
                        "(memory.loss_chunk applies).")
    if mem.model_states == "host":
        problems.append("Clover draft training does not shard its states (FSDP is not applied to it), so "
                        "memory.model_states = host does not apply: use device or host_optimizer.")
    return problems


def clover_ranks_problem(cfg: Config, world: int) -> str:
    """'' unless a Clover draft would train on more than one rank (data ranks included, which the config
    alone does not show: the launcher's --nproc does): preflight asks it before launch and the data."""
    if cfg.draft.kind != "clover" or not cfg.draft.target or world <= 1:
        return ""
    return (f"Clover draft training runs on one rank (the chained steps read the whole sequence's states; "
            f"data-parallel draft training is not built for it), got {world} ranks: run with --nproc 1.")


def draft_problems(cfg: Config, shortest: int | None = None) -> list[str]:
    """One sentence with its fix per problem of [draft]: its numbers, what GliDe draft training (train/glide.py)
    supports, and draft.kind = clover's own (clover_problems). `shortest`: the shortest sequence the run trains
    on (rules.py shortest_length: its stages' shortest; default train.seq_len)."""
    problems: list[str] = []
    d, m, mem = cfg.draft, cfg.model, cfg.memory
    if d.layers < 1:
        problems.append(f"draft.layers must be at least 1, got {d.layers}.")
    elif d.target and m.layers > 0 and d.layers > m.layers:
        problems.append(f"draft.layers ({d.layers}) must be at most the target's layers ({m.layers}): draft layer i "
                        f"reads target layer {m.layers} - {d.layers} + i.")
    if d.block < 1:
        problems.append(f"draft.block (the speculation length the block-stale mask trains for) must be at least 1, "
                        f"got {d.block}.")
    elif d.target and d.block >= (shortest := shortest or cfg.train.seq_len):  # (every position in the first
        # block: no target key read; a stage's steps train the draft as much as any other's)
        where = (f"train.seq_len = {cfg.train.seq_len}" if not cfg.train.stages else
                 f"the shortest stage's {shortest} tokens (train.stages = {cfg.train.stages!r})")
        problems.append(f"draft.block = {d.block} is not below {where}: each position reads the target's keys of the "
                        f"blocks before its own, and there would be none; use the speculation length you decode with "
                        f"(e.g. 4).")
    if not d.kd_temperature > 0:
        problems.append(f"draft.kd_temperature must be positive, got {d.kd_temperature}.")
    elif d.loss == "ce" and d.kd_temperature != 1.0:
        problems.append(f"draft.kd_temperature = {d.kd_temperature} does nothing with draft.loss = ce (it tempers "
                        f"the distillation's two distributions): set draft.loss = kd, or drop draft.kd_temperature.")
    if d.vocab < 0 or d.target and m.vocab_size > 0 and d.vocab >= m.vocab_size:
        problems.append(f"draft.vocab must be 0 (the target's {m.vocab_size:,} tokens) or a smaller count of the "
                        f"tokens the draft proposes (e.g. 8192), got {d.vocab}.")
    problems += clover_problems(cfg)
    if not d.target:
        return problems
    if m.is_moe:
        problems.append("draft.target is a Mixture-of-Experts model; GliDe draft training supports dense targets "
                        "only for now.")
    if cfg.train.loss_weighting != "token":
        problems.append(f"GliDe draft training weighs every distilled token alike (train.loss_weighting = token); "
                        f"drop train.loss_weighting = {cfg.train.loss_weighting}.")
    if mem.offload_fraction != 0 or mem.block_chunk or mem.attention_offload:
        problems.append("GliDe draft training supports memory.recompute (none, selective, full), "
                        "memory.attention_chunk and memory.loss_chunk; drop memory.offload_fraction, "
                        "memory.block_chunk and memory.attention_offload.")
    return problems


def check_draft_target(target: str) -> None:
    """draft.target names weights a GliDe draft can be trained against: a local Hugging Face directory
    with config.json (hf:DIR), or a complete longctx checkpoint of a model (not another draft's)."""
    if target.startswith("hf:"):
        path = hf_dir(target)
        if not (path / "config.json").is_file():
            raise ConfigError(f"draft.target = {target!r}: {path} is not a Hugging Face model directory (no "
                                f"config.json); pass hf:DIR with config.json and safetensors weights, or DIR, a "
                                f"longctx checkpoint.")
        return
    path = find_checkpoint(target)
    if path is None:
        raise ConfigError(f"draft.target = {target!r} holds no complete longctx checkpoint (a step-* directory with "
                            f"{MANIFEST}, or a checkpoints directory holding them); train the target first (longctx "
                            f"train with --checkpoint.interval N saves them), or hf:DIR for Hugging Face weights.")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"draft.target: {path / MANIFEST} cannot be read ({e}).") from None
    if isinstance(manifest, dict) and manifest.get("draft"):
        raise ConfigError(f"draft.target = {target!r}: {path} is itself a GliDe draft's checkpoint; name the model "
                            f"it drafts for (its manifest's draft.target.path: "
                            f"{manifest['draft'].get('target', {}).get('path')!r}).")
