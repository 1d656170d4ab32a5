"""What draft.kind = clover (models/clover.py, train/glide.py CloverTraining) allows, beside config/rules.py's
_draft_rules (which asks it): GliDe's options that a Clover draft has no use for, and the training
it supports (one rank; its one Augmenting Block without a recompute policy or attention chunks)."""

from __future__ import annotations

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
