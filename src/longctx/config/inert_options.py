"""Options that would do nothing in the run they are given to, asked by rules.py's validate.

A knob set for a feature the run does not have (memory.expert_chunk on a dense model, an offload
that no block takes) was accepted and silently ignored: the run trained, and its config.toml and
setup line named the option as if it applied. Each is refused here, before any work, with the
setting that makes it apply or the advice to drop it. [model.moe] keys on a dense model are a note
(dense_moe_notes), since a saved MoE config.toml under a dense preset legitimately carries them; so are
train.co2_* under sync and parallel.zero_pp_block without qwz / qgz (inert_option_notes), which
`longctx plan` takes in its (sync, unquantized) base config to cost its co2 and quantized plans, and the
decay's keys under train.lr_schedule constant, which a resume that switches to it carries, and one mode's
keys under another (_unread_sub_options: a router's under another router, Ms-PoE's without it, ...). What
needs the world size (parallel.zero_pp on one process) is job/checks.py check_layout's: inert_layout_problems.
A key counts as given when it differs from its default (and from its preset's value): every saved
config.toml lists every key, at its default when the run did not set it.
"""

from __future__ import annotations

import dataclasses

from ..errors import UserError
from .hf import resolve_init_from
from .positions import MS_POE_SETTINGS
from .presets import MODEL_PRESETS
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DraftConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)


def inert_option_problems(cfg: Config) -> list[str]:
    """One sentence with its fix per option that would be ignored (empty when each applies)."""
    return (_expert_chunk_on_dense(cfg) + _offload_without_blocks(cfg) + _draft_without_target(cfg)
            + _zero_pp_unused(cfg) + _rope_factor_unscaled(cfg) + _unusable_expert_replicas(cfg)
            + _time_limit_without_saves(cfg) + _signals_without_saves(cfg) + _build_options_with_store(cfg))


# [data] keys that only configure the store built from data.corpus (data/default_store.py); a data.path store
# was built by `longctx data build`, with its own (its manifest)
STORE_BUILD_KEYS = {"eval_fraction": "--eval-fraction", "max_docs": "--max-docs", "strategy": "--strategy",
                    "dedup": "--dedup", "workers": "--workers"}


def _build_options_with_store(cfg: Config) -> list[str]:
    """data.max_docs, data.eval_fraction, ... beside data.path: the run trained on the whole store, as it was
    built, and its config.toml named the option as if it applied (data.corpus beside data.path is rules.py's)."""
    given = _given(cfg.data, DataConfig, lambda key: key in STORE_BUILD_KEYS)
    if not cfg.data.path or not given:
        return []
    flags = " ".join(f"{STORE_BUILD_KEYS[key]} {value}" for key, value in given)
    return [f"{_named('data', given)} would be ignored: {'they configure' if len(given) > 1 else 'it configures'} the "
            f"store built from data.corpus, and data.path ({cfg.data.path}) is a store already built, with its own "
            f"settings (its manifest.json); build one with them (`longctx data build ... {flags}`), or drop "
            f"{'them' if len(given) > 1 else 'it'}."]


def _time_limit_without_saves(cfg: Config) -> list[str]:
    """checkpoint.exit_after_minutes in a run without a checkpoint manager (CheckpointConfig.saves_or_resumes):
    the limit's stop saves the step it stops at, and such a run can save nothing."""
    ck = cfg.checkpoint
    if not ck.exit_after_minutes or ck.saves_or_resumes:
        return []
    return [f"checkpoint.exit_after_minutes = {ck.exit_after_minutes:g} would stop the run with nothing saved: it "
            f"saves the step it stops at, and this run saves no checkpoint (checkpoint.interval 0, checkpoint.final "
            f"false); set --checkpoint.final true (or an interval), or drop the limit."]


def _signals_without_saves(cfg: Config) -> list[str]:
    """checkpoint.on_signal naming signals in a run without a checkpoint manager: the stop on a signal saves the step
    it stops at, so such a run installs no handler (train/watch.py), and the signal it was given to catch ends it
    with nothing saved, as if the option were not there (the default's signals, and '' or none, say nothing)."""
    ck = cfg.checkpoint
    names = [p.strip() for p in str(ck.on_signal).split(",") if p.strip() and p.strip().lower() != "none"]
    if not names or ck.saves_or_resumes or not _given(ck, CheckpointConfig, lambda key: key == "on_signal"):
        return []
    return [f"checkpoint.on_signal = {ck.on_signal!r} would be ignored: a stop on a signal saves the step it stops "
            f"at, and this run saves no checkpoint (checkpoint.interval 0, checkpoint.final false), so the signal "
            f"would end it with nothing saved; set --checkpoint.final true (or an interval), or drop it."]


def inert_option_notes(cfg: Config) -> list[str]:
    """Options the run ignores that a legitimate path writes: a note each at setup (train/report.py), not an
    error. `longctx plan` loads its base config, sync and unquantized, with the co2 and qwz / qgz settings
    it costs its co2 and quantized plans by (planner/cli.py run_settings), and writes them into its plan
    whichever it picks; a resume of a co2 run under --train.data_parallel sync keeps its saved train.co2_*."""
    notes = []
    t, p = cfg.train, cfg.parallel
    co2 = _given(t, TrainConfig, lambda key: key.startswith("co2_"))
    if t.data_parallel == "sync" and co2:
        notes.append(f"{_named('train', co2, 'is')} ignored: train.data_parallel = sync averages the gradients every "
                     f"step, so no CO2 rounds run; set --train.data_parallel co2 (with parallel.dp_replicate >= 2) "
                     f"to use {'them' if len(co2) > 1 else 'it'}")
    decay = _given(t, TrainConfig, lambda key: key in ("min_lr_ratio", "lr_decay_fraction"))
    if t.lr_schedule == "constant" and decay:
        notes.append(f"{_named('train', decay, 'is')} ignored: train.lr_schedule = constant holds train.lr after the "
                     f"warmup, with no decay; set --train.lr_schedule cosine, linear or 1-sqrt to decay")
    notes += _unread_companions(cfg) + _rope_factor_unscaled(cfg, weights=True)
    block = _given(p, ParallelConfig, lambda key: key == "zero_pp_block")
    if block and not {"qwz", "qgz"} & _zero_pp(cfg):
        notes.append(f"{_named('parallel', block, 'is')} ignored: it sizes the int8 blocks of parallel.zero_pp's qwz "
                     f"and qgz, and neither is on (parallel.zero_pp = {p.zero_pp!r})")
    return notes


# RoPE scaling keys and the scalings that read them (models/llama.py): any other leaves them unread
_SCALING_KEYS = {"rope_low_freq_factor": ("llama3",), "rope_high_freq_factor": ("llama3",),
                 "rope_original_max_len": ("llama3", "yarn"), "rope_beta_fast": ("yarn",), "rope_beta_slow": ("yarn",),
                 "rope_mscale": ("yarn",), "rope_mscale_all_dim": ("yarn",), "rope_attention_factor": ("yarn",),
                 "rope_truncate": ("yarn",)}


def _unread_companions(cfg: Config) -> list[str]:
    """Keys that only tune another option, given while that option is off: train.spike_window without
    train.spike_factor, train.skip_limit under another train.on_nonfinite than skip, memory.offload_skip_last
    without memory.offload_fraction, a RoPE scaling's own keys under another scaling (away from the
    preset's values, or from the weights' own for a model from model.init_from: _own_model).
    Notes, not errors: a saved config.toml carries them when a resume turns the option off."""
    t, mem, m = cfg.train, cfg.memory, cfg.model
    notes = []
    window = _given(t, TrainConfig, lambda key: key == "spike_window")
    if window and not t.spike_factor:
        notes.append(f"{_named('train', window, 'is')} ignored: it is the spike check's window, and "
                     f"train.spike_factor is 0 (no spike check); set --train.spike_factor (e.g. 5) to check spikes")
    limit = _given(t, TrainConfig, lambda key: key == "skip_limit")
    if limit and t.on_nonfinite != "skip":
        notes.append(f"{_named('train', limit, 'is')} ignored: it bounds the bad steps skipped in a row, and "
                     f"train.on_nonfinite = {t.on_nonfinite!r} skips none (stop ends the run at the first, rollback "
                     f"goes back to the last checkpoint); set --train.on_nonfinite skip to use it")
    skip = _given(mem, MemoryConfig, lambda key: key == "offload_skip_last")
    if skip and not mem.offload_fraction:
        notes.append(f"{_named('memory', skip, 'is')} ignored: it keeps blocks out of memory.offload_fraction's "
                     f"offload, and memory.offload_fraction is 0 (nothing offloaded)")
    own = _own_model(m)
    scaling = _given(m, ModelConfig, lambda key: m.rope_scaling not in _SCALING_KEYS.get(key, (m.rope_scaling,)),
                     own) if own is not None else []
    if scaling:
        notes.append(f"{_named('model', scaling, 'is')} ignored: model.rope_scaling is {m.rope_scaling!r}, which "
                     f"reads none of {'them' if len(scaling) > 1 else 'it'} (low/high_freq_factor: llama3; "
                     f"beta_fast/slow, mscale, mscale_all_dim, attention_factor, truncate: yarn; original_max_len: "
                     f"both)")
    return notes + _unread_sub_options(cfg)


def _unread_sub_options(cfg: Config) -> list[str]:
    """Keys of one mode of a feature given while another mode (or none) is on: each was accepted, read by
    nothing (models/ms_poe.py, models/moe.py's routers, parallel/expert/, train/trainer.py's evaluation), and
    named in the config.toml as if it applied. Notes, as _unread_companions': a resume that switches the mode
    off carries them in its saved config."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    preset = MODEL_PRESETS.get(m.preset, {})
    # (section, its config, its class, the keys, whether nothing reads them, why)
    unread = [
        ("model", m, ModelConfig, MS_POE_SETTINGS, not m.rope_ms_poe,
         "model.rope_ms_poe is false (plain RoPE positions); Ms-PoE is set at generate or eval"),
        ("model", m, ModelConfig, ("qk_norm_span",), not m.qk_norm,
         f"model.qk_norm is false (model.family {m.family}: no q/k norm to span)"),
        ("model", m, ModelConfig, ("moe.dts_steps", "moe.dts_temperature", "moe.dts_eval"),
         m.is_moe and m.moe_router != "dts", f"model.moe.router is {m.moe_router!r}, not dts"),
        ("model", m, ModelConfig, ("moe.sinkhorn_iters",),
         m.is_moe and m.moe_router != "sinkhorn", f"model.moe.router is {m.moe_router!r}, not sinkhorn"),
        ("parallel", p, ParallelConfig, ("expert_pipeline_chunks",), p.expert == 1,
         "parallel.expert is 1 (no expert all-to-all to pipeline)"),
        ("parallel", p, ParallelConfig, ("expert_placement_window",), p.expert == 1 or not p.expert_replicas,
         "parallel.expert_replicas is 0 (no hot-expert copies to place)" if p.expert > 1 else
         "parallel.expert is 1 (no expert parallelism)"),
        ("parallel", p, ParallelConfig, ("expert_ranks_per_node",), p.expert in (1, p.expert_ranks_per_node),
         "parallel.expert is 1 (no expert parallelism)" if p.expert == 1 else f"parallel.expert = {p.expert} ranks "
         f"fit one node of {p.expert_ranks_per_node}: the flat all-to-all runs (parallel/expert/install.py)"),
        ("train", t, TrainConfig, ("eval_batches",), not t.eval_interval, "train.eval_interval is 0 (no evaluation)"),
        ("checkpoint", cfg.checkpoint, CheckpointConfig, ("dir", "keep", "async", "on_save_error"),
         not cfg.checkpoint.saves_or_resumes, "this run saves no checkpoint (checkpoint.interval 0, checkpoint.final "
         "false) and resumes none: it has no checkpoint manager (train/setup.py open_checkpointing)"),
    ]
    notes = []
    for section, obj, cls, keys, off, why in unread:
        given = _given(obj, cls, keys.__contains__, preset if section == "model" else None) if off else []
        if given:
            notes.append(f"{_named(section, given, 'is')} ignored: {why}")
    return notes


def inert_layout_problems(cfg: Config, world: int) -> list[str]:
    """What the world size makes inert (job/checks.py check_layout asks, before launch and on each rank):
    parallel.zero_pp on one process whose states FSDP does not shard (parallel/fsdp/shard.py uses_fsdp: one
    rank and memory.model_states device or host_optimizer), so no weight is gathered and no gradient reduced."""
    names = _zero_pp(cfg)
    if not names or world != 1 or cfg.memory.model_states == "host":
        return []
    return [f"parallel.zero_pp = {cfg.parallel.zero_pp!r} would be ignored: ZeRO++ changes FSDP's gathers and "
            f"reduce-scatters between ranks, and this run is one process (memory.model_states = "
            f"{cfg.memory.model_states}: FSDP is not applied); drop it, or train on more ranks (--nproc N)."]


def _zero_pp(cfg: Config) -> set[str]:
    return {n.strip() for n in cfg.parallel.zero_pp.split(",") if n.strip()}


def _given(section, cls, wanted, preset: dict | None = None) -> list[tuple[str, object]]:
    """(key, value) of the `wanted` keys of `section` (a `cls`) set away from their default (and from
    `preset`'s value)."""
    return [(key, getattr(section, f.name)) for f in dataclasses.fields(cls)
            if wanted(key := f.metadata.get("key", f.name))
            and getattr(section, f.name) not in (f.default, (preset or {}).get(key, f.default))]


def _named(section: str, given: list[tuple[str, object]], verb: str = "") -> str:
    """'draft.kind = 'clover', draft.loss = 'kd'' (+ ' are' / ' is' with `verb`)."""
    said = ", ".join(f"{section}.{key} = {value!r}" for key, value in given)
    return f"{said} {'are' if len(given) > 1 else 'is'}" if verb else said


def _draft_without_target(cfg: Config) -> list[str]:
    """[draft] keys without draft.target: train/model.py trains the model itself, as if [draft] were absent."""
    given = _given(cfg.draft, DraftConfig, lambda key: key != "target")
    if cfg.draft.target or not given:
        return []
    return [f"{_named('draft', given)} would be ignored: [draft] configures a draft trained against the "
            f"frozen draft.target, and draft.target is '' (a normal run, which trains the model itself); set "
            f"--draft.target DIR (the target's checkpoint, or hf:DIR), or drop them."]


def _zero_pp_unused(cfg: Config) -> list[str]:
    """parallel.hpz_ranks without hpz; parallel.zero_pp beside a draft, whose FSDP (parallel/parallelize.py
    parallelize_draft) is plain: no secondary partition, no int8 gathers or reduce-scatters."""
    p = cfg.parallel
    problems = []
    if cfg.draft.target and _zero_pp(cfg):
        problems.append(f"parallel.zero_pp = {p.zero_pp!r} would be ignored: a draft's training (draft.target) "
                        f"shards the draft with plain FSDP (parallel/parallelize.py parallelize_draft); drop it.")
    if p.hpz_ranks and "hpz" not in _zero_pp(cfg):
        problems.append(f"parallel.hpz_ranks = {p.hpz_ranks} would be ignored: it sizes hpz's secondary partition, "
                        f"and parallel.zero_pp ({p.zero_pp!r}) has no hpz; add hpz to parallel.zero_pp, or drop "
                        f"parallel.hpz_ranks (0).")
    return problems


def _own_model(m: ModelConfig) -> dict | None:
    """[model]'s values where the user gives none: its preset's, or for a model from model.init_from the weights'
    own (config.json, or a checkpoint's manifest), so that a RoPE key given over weights counts as given: it was
    taken unsaid (`--model.init_from hf:DIR --model.rope_factor 4` over weights of no scaling trained plain RoPE).
    None where the weights cannot be read (init_from's own check says why)."""
    if not m.init_from:
        return MODEL_PRESETS.get(m.preset, {})
    try:
        return resolve_init_from({"init_from": m.init_from})[0]
    except UserError:
        return None


def _rope_factor_unscaled(cfg: Config, weights: bool = False) -> list[str]:
    """model.rope_factor with model.rope_scaling none: models/llama.py reads the factor only under a scaling.
    A factor away from its default and from the preset's (`weights`: the init_from weights' own, _own_model; an
    extension may set rope_scaling none over their factor) counts. Over a preset it is refused; over weights it is
    a note (`weights`, asked by inert_option_notes): a run started before 2026-12-07 took it without a word and its
    saved config.toml records it, which a refusal would leave unable to resume, though the factor never acted."""
    m = cfg.model
    if bool(m.init_from) != weights:
        return []
    own = _own_model(m)
    given = _given(m, ModelConfig, lambda key: key == "rope_factor", own) if own is not None else []
    if m.rope_scaling != "none" or not given:
        return []
    fix = "set --model.rope_scaling linear, llama3 or yarn to scale by it, or drop it"
    if weights:
        return [f"model.rope_factor = {m.rope_factor} is ignored: model.rope_scaling is none over the weights of "
                f"model.init_from, which have no RoPE scaling (plain RoPE, no factor); {fix}"]
    return [f"model.rope_factor = {m.rope_factor} would be ignored: model.rope_scaling is none (plain RoPE, no "
            f"factor); {fix}."]


def _unusable_expert_replicas(cfg: Config) -> list[str]:
    """parallel.expert_replicas beyond the experts a rank can copy: it owns E / expert of them and holds at
    most one copy of each other one (parallel/expert/placement.py plan_placement), so the slots past
    E - E / expert stay empty, though every forward still fetches (zeroes) all of them."""
    p, m = cfg.parallel, cfg.model
    if not m.is_moe or p.expert < 2 or m.moe_experts % p.expert or not p.expert_replicas:
        return []
    usable = m.moe_experts - m.moe_experts // p.expert
    if p.expert_replicas <= usable:
        return []
    return [f"parallel.expert_replicas = {p.expert_replicas} is more copy slots than a rank can fill: it owns "
            f"{m.moe_experts // p.expert} of the {m.moe_experts} experts (parallel.expert = {p.expert}) and holds "
            f"at most one copy of each of the other {usable}; set parallel.expert_replicas to at most {usable}."]


def dense_moe_notes(m: ModelConfig) -> list[str]:
    """[model.moe] keys a dense model (model.moe.experts = 0) was given: a note each run prints (moe_rules.py
    moe_notes), not an error, since a MoE run's saved config.toml under a dense --model.preset keeps the
    keys it changed (load.py drop_restated_model_keys) and that is allowed."""
    if m.moe_experts != 0:
        return []
    # a key at its default or at its preset's value was not set for this run (a MoE preset's keys stay
    # when its experts are turned off: that dense model is allowed, and the saved config lists them)
    given = _given(m, ModelConfig, lambda key: key.startswith("moe.") and key != "moe.experts",
                   MODEL_PRESETS.get(m.preset, {}))
    if not given:
        return []
    return [f"{_named('model', given, 'is')} ignored: the model is dense (model.moe.experts = 0, "
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
