"""Resuming continues the run: `--checkpoint.resume auto|PATH` starts from the run's saved config.toml.

Without this, a resume would build its config from the defaults plus the command line, so a run
saved every 10 steps, resumed with only `--train.steps 30`, would silently train on with saving off
and whatever else the defaults say. Here the saved config is the base and the command line applies
on top; each key that differs is said once ("resume: train.steps 20 -> 30"). Changing the model or
the data, or turning saving off, is refused unless asked for with `--checkpoint.allow_changes`. What is said and
refused is measured from the config the resumed checkpoint trained under, where it records one (a rollback past a
resume that edited config.toml: config/resume_source.py). Where the run's config.toml is not found (checkpoints
copied elsewhere, a run directory wiped), the config the checkpoint recorded is the base, said so, and a checkpoint
that records none resumes on the defaults, said before any work (config/resume_moved.py).

Which layout a resume runs is config/layout.py's rule (it calls this with `layout_given`). Pure
config logic (no torch), used by `longctx train`; `load_config` itself builds exactly what it is
given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UserError
from .checkpoint_paths import auto_checkpoint, find_checkpoint, latest_checkpoint, manifest_or_empty, resolve_checkpoint
from .inert_options import STORE_BUILD_KEYS
from .load import build_config, drop_restated_model_keys, read_raw, to_dict
from .resume_moved import RunBase, drop_own_paths, recorded_base, recorded_text
from .resume_source import Origin, refused_note, trained_under
from .resume_source import show as _show
from .rules import parse_stages
from .schema import Config
from .weight_shapes import shape_differences

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "head", "ctx", "window", "placement", "expert")
# where and how to resume are not settings of the run
NOT_SETTINGS = {("checkpoint", "resume"), ("train", "run_dir"), ("checkpoint", "allow_changes")}
# keys that do not change which data is read: data.workers (the build's processes); data.dp_balance only permutes
# each micro-batch's rows over the data-parallel ranks (data/balance.py balanced_order, applied to the indices the
# sample order drew), and the loss, the MoE balancing statistics and the gradients are sums over the whole
# micro-batch, so a step trains on the same samples with the same loss up to float summation order (routings that
# read a micro-batch in token order take their rows unbalanced whatever it says: train/stages.py)
DATA_NEUTRAL = {"workers", "dp_balance"}


@dataclass
class Resumed:
    run_dir: Path  # the run whose config.toml is the base (a recorded base: the checkpoint)
    changes: list[str]  # "train.steps 20 -> 30", one per key that differs from the config the checkpoint trained under
    note: str = ""  # said after them (resume_source.py, resume_moved.py)
    base: str = "its saved config.toml"  # what the config is built on

    def describe(self) -> str:
        said = ", ".join(self.changes) if self.changes else "nothing changed"
        return f"resume: {self.run_dir} with {self.base}; {said}" + (f" ({self.note})" if self.note else "")


def saved_run_dir(raw: dict) -> Path | None:
    """The run directory whose config.toml a resume continues; None when there is none to continue.
    train.run_dir when it holds one; else the run of the checkpoint to resume (PATH, or for `auto` the
    newest in checkpoint.dir or <train.run_dir>/checkpoints): the run directory above it
    (`<run>/checkpoints/step-N`), or the one its manifest names (a checkpoint.dir outside the run's)."""
    if raw.get("checkpoint", {}).get("resume", "none") == "none":
        return None
    given = raw.get("train", {}).get("run_dir")
    if given and (Path(given) / "config.toml").is_file():
        return Path(given)
    target = resume_checkpoint(raw)
    if target is None:
        return None
    path = target.resolve()
    for parent in [path, *path.parents][:4]:
        if (parent / "config.toml").is_file():
            return parent
    return manifest_run_dir(path)


def resume_checkpoint(raw: dict) -> Path | None:
    """The checkpoint a raw config's checkpoint.resume names: PATH, or for `auto` the one it loads in checkpoint.dir or
    <train.run_dir>/checkpoints (None: not a resume, or no checkpoint there)."""
    resume = raw.get("checkpoint", {}).get("resume", "none")
    given = raw.get("train", {}).get("run_dir")
    if resume == "none":
        return None
    if resume == "auto":
        root = raw.get("checkpoint", {}).get("dir") or (Path(given) / "checkpoints" if given else None)
        return auto_checkpoint(Path(root)) if root else None
    # (a checkpoints directory, or its `latest` pointer: the step it names, whose manifest names the run)
    return find_checkpoint(resume) or Path(resume)


def run_base(given: dict) -> RunBase | None:
    """What a resume continues: the run's saved config.toml (saved_run_dir), else the config its checkpoint
    recorded (resume_moved.py); None: not a resume, or neither is found (the defaults run, said by the caller)."""
    run_dir = saved_run_dir(given)
    if run_dir is not None:
        return RunBase(read_raw(run_dir / "config.toml", saved_run=True), run_dir, run_dir)
    target = resume_checkpoint(given)
    text = recorded_text(target)
    if text is None:
        return None
    return recorded_base(read_raw(f"the config {target} recorded", text=text, saved_run=True), given, target)


def manifest_run_dir(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint's manifest names, if it still holds a config.toml (an unreadable
    manifest: None here; verification refuses the checkpoint with its reasons later)."""
    named = manifest_or_empty(checkpoint).get("run_dir")
    return Path(named) if named and (Path(named) / "config.toml").is_file() else None


def _without_ignored_build_keys(saved: dict) -> dict:
    """A saved config beside whose data.path a run written before they were refused (config/inert_options.py)
    recorded data.max_docs, data.workers, ...: that run ignored them, so dropping them changes nothing it trained,
    where they made the saved config.toml fail to load and the run impossible to resume (no flag drops a key)."""
    data = saved.get("data", {})
    if not data.get("path"):
        return saved
    return {**saved, "data": {k: v for k, v in data.items() if k not in STORE_BUILD_KEYS}}


def _padding_idx_as_trained(saved: dict) -> tuple[dict, str]:
    """A saved config of a run from hf:DIR written before model.padding_idx existed (its [model] lists every key but
    that one) trained every embedding row: resolved now, config.json's pad_token_id would set it and the resumed run
    would stop training the pad row its steps so far trained. Kept at -1 (none), as it trained, and said."""
    model = saved.get("model", {})
    if "padding_idx" in model or not str(model.get("init_from", "")).startswith("hf:"):
        return saved, ""
    return {**saved, "model": {**model, "padding_idx": -1}}, (
        "model.padding_idx -1 (every embedding row trained), as this run trained before longctx read config.json's "
        "pad_token_id; --model.padding_idx ID with --checkpoint.allow_changes true stops that row's training")


def _merge(base: dict, top: dict) -> dict:
    out = {section: dict(values) for section, values in base.items()}
    for section, values in top.items():
        out.setdefault(section, {}).update(values)
    return out


def _differences(before: dict, after: dict) -> list[tuple[str, str, Any, Any]]:
    return [(section, key, before[section][key], value)
            for section, values in after.items() for key, value in values.items()
            if (section, key) not in NOT_SETTINGS and before[section][key] != value]


def load_run_config(path: str | Path | None, overrides: Sequence[str], layout_given: bool
                    ) -> tuple[Config, Resumed | None]:
    """The config `longctx train` runs: on a resume of a run with a saved config.toml, that config
    with the file and command line on top (and the layout wholly the command line's when
    `layout_given`); otherwise exactly the file and command line."""
    given = read_raw(path, overrides)
    run = run_base(given)
    if run is None:
        return build_config(given), None
    # (its sub-tables, such as [model.moe], flattened as given ones are; keys renamed since it was written,
    # config/fields.py RENAMED_KEYS, read under their new names)
    saved, padding_note = _padding_idx_as_trained(_without_ignored_build_keys(run.saved))
    base = _merge(saved, {})
    moved = drop_own_paths(base, given) if run.checkpoint else ""  # (where the old run wrote: this run's own)
    # (asked of this resume alone: a saved true, from an earlier resume's flag, let every later one change anything)
    base.get("checkpoint", {}).pop("allow_changes", None)
    if "preset" in given.get("model", {}) and "model" in base:  # (its full listing would keep the saved model)
        base["model"] = drop_restated_model_keys(base["model"], given["model"]["preset"])
    if given.get("train", {}).get("stages"):  # (the saved steps and seq_len are its old stages' sum and last length)
        for key in ("steps", "seq_len"):
            base.get("train", {}).pop(key, None)
    _follow_another_target(base, given)
    if layout_given:
        for key in LAYOUT_KEYS:
            base.get("parallel", {}).pop(key, None)
    try:  # (first: a key it holds that this version lacks was said as if the command line had given it)
        run_file = to_dict(build_config(saved))
    except UserError as e:  # (ConfigError; or a path it reads gone, model.init_from: the record of another machine)
        raise _no_longer_loads(run, e) from None
    merged = _merge(base, given)
    if run.checkpoint is None:
        merged.setdefault("train", {})["run_dir"] = given.get("train", {}).get("run_dir") or str(run.run_dir)
    cfg = build_config(merged)
    after = to_dict(cfg)
    # (what the checkpoint trained under, which a rollback past an edited resume no longer finds in config.toml; a
    # key given here, or not read from config.toml, is no change config.toml carries)
    mine = {(s, k) for s, values in after.items() for k in values if k in given.get(s, {}) or k not in base.get(s, {})}
    origin = trained_under(resumed_manifest(cfg, run.run_dir), run_file, recorded_config, run.run_dir, mine)
    before = origin.config
    diffs = _differences(before, after)
    _refuse_another_seed(diffs, cfg, run)
    _refuse_other_weights(before["model"], after["model"], cfg, run.named)
    _refuse_unasked(diffs, cfg, run, origin)
    _refuse_replanned_stages(before["train"], cfg, run, origin)
    later = origin.later(diffs)
    changes = [f"{s}.{k} {_show(a)} -> {_show(b)}" + (f" ({origin.from_run_file()})" if (s, k) in later else "")
               for s, k, a, b in diffs]
    padding_note = "" if "padding_idx" in given.get("model", {}) else padding_note  # (given: said as a change)
    note = "; ".join(n for n in (origin.note, moved, padding_note) if n)
    return cfg, Resumed(run.named, changes + origin.restored(after, NOT_SETTINGS), note, run.said)


def _no_longer_loads(run: RunBase, e: UserError) -> ConfigError:
    if run.checkpoint is None:
        return ConfigError(f"the saved config of the run to resume, {run.run_dir / 'config.toml'}, no longer loads: "
                           f"{e} Edit that file to what this version accepts (`longctx train --print-config` lists "
                           f"every key), or start a new run from its weights with --model.init_from "
                           f"{run.run_dir / 'checkpoints'}.")
    return ConfigError(f"the config {run.checkpoint} recorded, the base of this resume (the run's config.toml was "
                       f"not found), no longer loads: {e} Write it (its manifest's \"config\") to "
                       f"{run.checkpoint.resolve().parent / 'config.toml'}, edited to what this version accepts, "
                       f"which the resume then reads as the run's config.toml; or start a new run from its weights "
                       f"with --model.init_from {run.checkpoint}.")


def recorded_config(text: str) -> dict:
    """A checkpoint's record of its run's config.toml (its manifest's "config"), loaded as config.toml is."""
    raw = read_raw("the checkpoint's recorded config", text=text, saved_run=True)
    return to_dict(build_config(_padding_idx_as_trained(_without_ignored_build_keys(raw))[0]))


def _follow_another_target(base: dict, given: dict) -> None:
    """A draft run resumed with another draft.target: the saved model.init_from is the old target's, which
    config/load.py set from draft.target, not a setting of the user's. Dropped, so that the new target sets it
    and the change is said as the draft's and the model's (refused unless asked), where it was refused as a
    model.init_from given beside draft.target ("drop model.init_from", a key the user never gave)."""
    target, saved = given.get("draft", {}).get("target"), base.get("draft", {}).get("target")
    model = base.get("model", {})
    if target and saved and target != saved and model.get("init_from") == saved:
        model.pop("init_from")


def _refuse_another_seed(diffs: list, cfg: Config, run: RunBase) -> None:
    """A checkpoint's data position is a cursor into the order its seed drew: another train.seed would repeat
    samples and skip others (data/loader.py refuses it when the position loads, after the ranks, the model
    and the data have started). Refused here, before any of that, whenever there is a checkpoint to load."""
    change = next((d for d in diffs if d[:2] == ("train", "seed")), None)
    if change is None or cfg.checkpoint.resume == "none":
        return
    root = checkpoint_root(cfg, run.run_dir)
    if cfg.checkpoint.resume == "auto" and latest_checkpoint(root) is None:
        return  # (nothing to resume: the run starts afresh under the new seed)
    raise ConfigError(f"this resume of {run.named} would change train.seed {change[2]} -> {change[3]}: its "
                      f"checkpoint's data order was drawn with seed {change[2]}, and another would repeat some samples "
                      f"and skip others. Resume with --train.seed {change[2]}, or start a new run from its weights "
                      f"with --model.init_from {run.checkpoint or root}.")


def _other_length(diffs: list, cfg: Config) -> list:
    """train.seq_len changed in a run without train.stages (before or now): its data is the store of that length,
    so the checkpoint's data position is a cursor into another store (data/loader.py refused it only after the
    new length's store was built and the ranks had started). Stages read a store per stage and may change."""
    staged = cfg.train.stages or any(d[:2] == ("train", "stages") for d in diffs)
    return [] if staged else [d for d in diffs if d[:2] == ("train", "seq_len")]


def _refuse_other_weights(saved: dict, configured: dict, cfg: Config, run_dir: Path) -> None:
    """A model of other weight shapes, which no flag makes the run's checkpoints load into: said at once (the
    advice for other model changes, allow_changes or init_from, was refused in turn by the load)."""
    diff = {} if cfg.draft.target else shape_differences(saved, configured)  # (a draft's: its own [draft])
    if diff:
        said = ", ".join(f"model.{k} {_show(a)} -> {_show(b)}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"this resume of {run_dir} would change the shapes of the model's weights ({said}): its checkpoints "
            f"cannot load into that model, whatever the flags. Resume with the run's own model (drop those "
            f"overrides), or train that model as a new run in another --train.run_dir (without init_from).")


def _stage_plan(train: dict) -> list[tuple[int, int, int, int]]:
    """(seq_len, first step, last step, its own batch or 0) of each stage of a [train] table; a run without
    stages is one stage of train.steps at train.seq_len."""
    given = parse_stages(train["stages"]) if train["stages"] else [(train["seq_len"], train["steps"], 0)]
    plan, first = [], 1
    for seq_len, steps, batch in given:
        plan.append((seq_len, first, first + steps - 1, batch))
        first += steps
    return plan


def _spelled(seq_len: int, steps: int, batch: int) -> str:
    """A stage as train.stages writes it."""
    return f"{seq_len}:{steps}" + (f":{batch}" if batch else "")


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    """Where a run's checkpoints are: checkpoint.dir, else its run directory's checkpoints/."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def resumed_manifest(cfg: Config, run_dir: Path) -> dict:
    """The manifest of the checkpoint this run's checkpoint.resume loads ({}: it starts afresh, or none is found:
    preflight and the load say why, in their words)."""
    if cfg.checkpoint.resume == "none":
        return {}
    try:
        target = resolve_checkpoint(cfg.checkpoint.resume, checkpoint_root(cfg, run_dir))
    except UserError:
        return {}
    return manifest_or_empty(target) if target is not None else {}


def _refuse_replanned_stages(saved_train: dict, cfg: Config, run: RunBase, origin: Origin) -> None:
    """train.stages edited so that the steps the checkpoint trained, or the stage it continues in, belong to
    other stages than they did. The data position a checkpoint saves is a cursor in its stage's store, applied
    only when the run goes on in that same stage (train/stages.py): a stage inserted before it, its length
    changed or its steps cut below the step reached left the next stage to start at its store's first samples
    (some of them trained already, with no word when the step fell on the new stage's first), or refused the
    store as "rebuilt with other content". Stages after the one the run is in, and that stage's own end (at or
    past the step reached), may change: the run goes on exactly."""
    staged = saved_train["stages"] or cfg.train.stages
    if not staged or cfg.checkpoint.allow_changes or cfg.checkpoint.resume == "none":
        return
    old, new = _stage_plan(saved_train), _stage_plan(to_dict(cfg)["train"])
    if old == new or not (step := int(resumed_manifest(cfg, run.run_dir).get("step") or 0)):
        return
    for i, (seq_len, first, last, batch) in enumerate(old):
        if first > step:
            return
        now = new[i] if i < len(new) else None
        kept = now is not None and now[:2] == (seq_len, first) and (now[2] == last if last < step else now[2] >= step)
        if kept:
            continue
        at = (f"is now {_spelled(now[0], now[2] - now[1] + 1, now[3])!r}, steps {now[1]}-{now[2]} at {now[0]:,} "
              f"tokens" if now is not None else "is gone")
        finished = last < step
        why = ("the plan would no longer say what the weights trained on, and a later stage of its length would "
               "start elsewhere in their store" if finished else
               "the checkpoint's data position is a cursor in that stage's store, so the run would not go on with "
               "the data it was reading")
        # (the stages as they ran through the step reached, the one it is in cut there: what the resume may extend)
        ran = [(length, min(end, step) - start + 1, b) for length, start, end, b in old if start <= step]
        keep = ",".join(_spelled(*stage) for stage in ran)
        edit = f"{saved_train['stages'] or '(none)'!r} -> {cfg.train.stages or '(none)'!r}"
        if ("train", "stages") in origin.later([("train", "stages", saved_train["stages"], cfg.train.stages)]):
            edit += f" ({origin.from_run_file()})"
        raise ConfigError(
            f"this resume of {run.named} continues from step {step}, but train.stages {edit} moves the steps it "
            f"trained: stage {i + 1} ({_spelled(seq_len, last - first + 1, batch)!r}, steps {first}-{last} at "
            f"{seq_len:,} tokens, {'finished' if finished else f'trained through step {step}'})"
            f" {at}; {why}. Keep the stages through step {step} as they ran (train.stages beginning {keep!r}, its "
            f"last stage as long as you like from there) and change or add only the stages after that; or add "
            f"--checkpoint.allow_changes true to resume with the new stages anyway.")


def _refuse_unasked(diffs: list, cfg: Config, run: RunBase, origin: Origin) -> None:
    """Changes a resume makes only when asked: the model, the data, saving turned off; those that come from the run's
    config.toml (changed after the checkpoint was saved) said so, with the way to give the checkpoint's back."""
    if cfg.checkpoint.allow_changes:
        return
    kinds = {
        "the model": [d for d in diffs if d[0] == "model"],
        "the draft": [d for d in diffs if d[0] == "draft"],
        "the data": [d for d in diffs if d[0] == "data" and d[1] not in DATA_NEUTRAL] + _other_length(diffs, cfg),
        "saving (checkpoint.interval 0 and checkpoint.final false: nothing after this point would be saved)":
            [d for d in diffs if d[:2] in (("checkpoint", "interval"), ("checkpoint", "final"))
             and not (cfg.checkpoint.interval or cfg.checkpoint.final)],
    }
    found = {what: ds for what, ds in kinds.items() if ds}
    if not found:
        return
    later = origin.later(diffs)
    source = f" ({origin.from_run_file()})"
    said = "; ".join(f"{what}: " + ", ".join(f"{s}.{k} {_show(a)} -> {_show(b)}" + (source if (s, k) in later else "")
                                             for s, k, a, b in ds) for what, ds in found.items())
    fresh = ("a new draft run in another --train.run_dir" if cfg.draft.target else  # (a draft is no init_from)
             f"a new run from its weights with --model.init_from {run.checkpoint or run.run_dir / 'checkpoints'}")
    raise ConfigError(
        f"this resume of {run.named} would change {said}. A resume continues the run with its saved settings, so "
        f"this is refused unless asked for: add --checkpoint.allow_changes true to do it anyway, or start {fresh}."
        + refused_note([d for ds in found.values() for d in ds if d[:2] in later], origin))
