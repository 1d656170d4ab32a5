"""What a run says when it starts (describe_run: the model, precision, memory policy, layout) and when it ends
(done_line: its steps, losses, bad steps, and where its files and last weights are)."""

from __future__ import annotations

from pathlib import Path

from ..config.checkpoint_paths import step_name
from ..config.inert_options import inert_option_notes
from ..config.model_name import count_words
from ..config.moe_rules import moe_notes
from ..models.llama import count_params
from ..step.schedule import schedule_note, schedule_words


def describe_run(cfg, world: int, dims, model, device, dtype, peak: str) -> list[str]:
    """The run's opening line: the model, its precision and memory policy, the layout."""
    from .. import threads
    from ..config.load import lr_note

    mem = cfg.memory
    expert = f" (expert {dims.expert} folded over them)" if getattr(dims, "expert", 1) > 1 else ""
    layout = (f"{world} ranks: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x head {dims.head} x ctx "
              f"{dims.ctx}" + (f" (window {dims.window})" if dims.window else "") + f", {dims.placement}{expert}"
              if world > 1 else "1 process")
    cpu = f", {threads.describe()}" if device.type == "cpu" else ""
    return [f"model: {_model_words(cfg, model)}, "
            f"{device.type} {str(dtype).removeprefix('torch.')}{cpu}, memory: recompute={mem.recompute}"
            + (f" offload={mem.offload_fraction} skip_last={mem.offload_skip_last}" if mem.offload_fraction else "")
            + _memory_options(mem) + f", loss_chunk={mem.loss_chunk}, {layout}"
            + (", compiled (train.compile: each block's token-wise parts)" if cfg.train.compile else "")
            + (", deterministic kernels (train.deterministic)" if cfg.train.deterministic else "")
            + (", loss per sequence (train.loss_weighting: each trained sequence's mean, averaged)"
               if cfg.train.loss_weighting == "sequence" else "")
            + f"; {lr_note(cfg)}" + (f", {words}" if (words := schedule_words(cfg)) else "") + f"; {peak}"] + (
        [model.grad_bucket_plan.describe()] if hasattr(model, "grad_bucket_plan") else []) + [
        f"note: {note}" for note in (moe_notes(cfg.model) if not cfg.draft.target else []) + [schedule_note(cfg)]
        + inert_option_notes(cfg) if note]


def _model_words(cfg, model) -> str:
    """The model the run trains and its parameters (config/model_name.py, as generate and eval name it, with the
    step read where it starts from a longctx checkpoint); a draft's training (draft.target: GliDe, Clover) names the
    draft (its kind, layers, block and parameters) and the frozen target it learns from (config/model_name.py:
    its name, parameters and the step read), each with its own figures."""
    from ..costs.model_states import model_said

    if not cfg.draft.target:  # (a fine-tune from a longctx checkpoint: the step read; was "llama runs/a/checkpoints")
        return model_said(cfg.model, cfg.model.init_from)  # (a MoE model's active too)
    from ..checkpoint.glide import draft_words

    d = cfg.draft
    drafted = f"{count_words(count_params(getattr(model, 'draft', model)))} parameters"
    return (f"{draft_words({'kind': d.kind, 'layers': d.layers, 'block': d.block}, drafted)} against the target "
            f"{model_said(cfg.model, d.target)}")


def _memory_options(mem) -> str:
    """The memory settings a run departs from the default in, beyond recompute and offload (a plan's choices,
    planner/output.py, read back in the setup line): chunks, the attention offload, grad_sync, model_states."""
    chunks = "".join(f" {k}={getattr(mem, k)}" for k in ("block_chunk", "attention_chunk", "expert_chunk")
                     if getattr(mem, k))
    return (chunks + (" attention_offload=true" if mem.attention_offload else "")
            + (f" grad_sync={mem.grad_sync}" if mem.grad_sync != "step" else "")
            + (f" model_states={mem.model_states}" if mem.model_states != "device" else ""))


def done_line(result, steps: int, total_s: float, run_dir: Path, plots: bool, checkpoints: Path | None,
              draft_target: str = "", skipped: int = 0, rollbacks: int = 0, metrics: Path | None = None) -> str:
    """The run's closing line: the steps this job ran (`result`: trainer.py TrainResult) up to
    train.steps `steps`, their time and first and last loss, the last evaluation's, the run's skipped steps and
    rollbacks (train.on_nonfinite, as the metrics count them), and where what the run wrote is (`checkpoints`:
    the checkpoint directory, None when the run saves nothing; `draft_target`: a draft run's draft.target, which
    generate reads the draft beside; `metrics`: the file the run logged to)."""
    # (no losses: a resume of a finished run under torchrun directly; `longctx train` says so before building)
    if not result.losses:
        return f"done: nothing to train: the run is at step {result.first_step - 1} of train.steps {steps}."
    # a rollback of the last step (read_back.py): the run ends with checkpoint step `kept`'s weights, so the
    # losses and evaluations after it are of discarded updates
    kept = result.ended_at
    evals = [loss for s, loss in result.eval_losses.items() if kept is None or s <= kept]
    last_eval = f", eval loss {evals[-1]:.4f}" if evals else ""
    if kept is None:
        last = f"{result.losses[-1]:.4f}"
    elif kept >= result.first_step:
        last = f"{result.losses[kept - result.first_step]:.4f} (step {kept}'s: steps {kept + 1}-{steps} rolled back)"
    else:
        last = f"- (steps {kept + 1}-{steps} rolled back)"
    files = _run_files(run_dir, plots, metrics)
    where = (_where_it_is(steps, files, checkpoints, draft_target) if kept is None else
             _where_it_is(kept, files, checkpoints, draft_target, f"the weights it ends with (step {kept}'s)"))
    return (f"done: steps {result.first_step}-{steps} in {total_s:.1f}s, loss {result.losses[0]:.4f} -> "
            f"{last}{last_eval}{_bad_steps(skipped, rollbacks)}. {where}")


def _bad_steps(skipped: int, rollbacks: int) -> str:
    """The done line's count of the run's bad steps: without it, a run whose every step was non-finite ended
    "done" with its untrained weights as "the last step's", the per-step lines long scrolled away."""
    said = ""
    if skipped:
        said += (f"; skipped {skipped} step{'s' if skipped != 1 else ''} (not applied: non-finite or a loss spike, "
                 f"train.on_nonfinite = skip)")
    if rollbacks:
        said += f"; rolled back {rollbacks} time{'s' if rollbacks != 1 else ''} (train.on_nonfinite = rollback)"
    return said


def _run_files(run_dir: Path, plots: bool, metrics: Path | None) -> str:
    """Where the run's files are: its config, metrics and plots in run_dir/, the metrics said apart where
    metrics.file put them elsewhere (the line named run_dir for them, where there were none)."""
    apart = metrics is not None and Path(metrics).resolve().parent != Path(run_dir).resolve()
    files = ["config", *([] if apart else ["metrics"]), *(["plots"] if plots else [])]
    listed = files[0] if len(files) == 1 else f"{', '.join(files[:-1])} and {files[-1]}"
    return (f"Its {listed} {'is' if len(files) == 1 else 'are'} in {run_dir}/"
            + (f", its metrics in {metrics}" if apart else ""))


def _where_it_is(step: int, said: str, checkpoints: Path | None, draft_target: str = "",
                 what: str = "the last step's weights") -> str:
    """The done line's pointer to what the run wrote: its files (`said`: _run_files), and the last step's
    checkpoint when one was saved (what `longctx generate --checkpoint` reads)."""
    if checkpoints is None:
        return f"{said} (nothing saved: checkpoint.interval 0 and checkpoint.final false)."
    saved = checkpoints / step_name(step)
    if not saved.is_dir():  # (a failed save under checkpoint.on_save_error = warn)
        return f"{said}."
    how = f"--checkpoint {draft_target} --draft {checkpoints}" if draft_target else f"--checkpoint {checkpoints}"
    return f"{said}; {what} in {saved}/ (`longctx generate {how}` reads them)."
