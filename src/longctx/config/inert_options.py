"""Options that would do nothing in the run they are given to, asked by rules.py's validate.

A knob set for a feature the run does not have (memory.expert_chunk on a dense model, an offload
that no block takes) was accepted and silently ignored: the run trained, and its config.toml and
setup line named the option as if it applied. Each is refused here, before any work, with the
setting that makes it apply or the advice to drop it. [model.moe] keys on a dense model are a note
(dense_moe_notes), since a saved MoE config.toml under a dense preset legitimately carries them.
"""

from __future__ import annotations

import dataclasses

from .presets import MODEL_PRESETS
from .schema import Config, ModelConfig


def inert_option_problems(cfg: Config) -> list[str]:
    """One sentence with its fix per option that would be ignored (empty when each applies)."""
    return _expert_chunk_on_dense(cfg) + _offload_without_blocks(cfg)


def dense_moe_notes(m: ModelConfig) -> list[str]:
    """[model.moe] keys a dense model (model.moe.experts = 0) was given: a note each run prints (rules.py
    moe_notes), not an error, since a MoE run's saved config.toml under a dense --model.preset keeps the
    keys it changed (load.py drop_restated_model_keys) and that is allowed."""
    if m.moe_experts != 0:
        return []
    preset = MODEL_PRESETS.get(m.preset, {})
    # a key at its default or at its preset's value was not set for this run (a MoE preset's keys stay
    # when its experts are turned off: that dense model is allowed, and the saved config lists them)
    given = [(key, getattr(m, f.name)) for f in dataclasses.fields(ModelConfig)
             if (key := f.metadata.get("key", f.name)).startswith("moe.") and key != "moe.experts"
             and getattr(m, f.name) not in (f.default, preset.get(key, f.default))]
    if not given:
        return []
    named = ", ".join(f"model.{key} = {value!r}" for key, value in given)
    return [f"{named} {'are' if len(given) > 1 else 'is'} ignored: the model is dense (model.moe.experts = 0, "
            f"model.preset {m.preset}), so no layer has experts to route to; set model.moe.experts (or a "
            f"Mixture-of-Experts preset such as --model.preset debug-moe) to train experts"]


def _expert_chunk_on_dense(cfg: Config) -> list[str]:
    if cfg.model.moe_experts != 0 or cfg.memory.expert_chunk <= 0:
        return []
    return [f"memory.expert_chunk = {cfg.memory.expert_chunk} would be ignored: it splits the rows of the MoE "
            f"experts, and the model is dense (model.moe.experts = 0); drop it, or train a Mixture-of-Experts "
            f"model (e.g. --model.preset debug-moe)."]


def _offload_without_blocks(cfg: Config) -> list[str]:
    """memory.offload_fraction with memory.offload_skip_last keeping every block on the device."""
    mem, layers = cfg.memory, cfg.model.layers
    fraction = mem.offload_fraction
    valid = fraction == "auto" or 0 < fraction <= 1  # (out of range, or without recompute: rules.py says so)
    if not valid or mem.recompute == "none" or cfg.draft.target or layers <= 0:
        return []
    if mem.offload_skip_last < layers:
        return []
    return [f"memory.offload_fraction = {fraction} would offload nothing: memory.offload_skip_last = "
            f"{mem.offload_skip_last} keeps the last {mem.offload_skip_last} blocks on the device, and the model "
            f"has {layers}. Set memory.offload_skip_last below {layers} (e.g. {max(0, min(1, layers - 1))}), "
            f"or memory.offload_fraction 0."]
