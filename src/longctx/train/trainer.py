"""The training loop: set up -> steps (with metrics, evaluation and saves) -> plots.

One optimizer step = `train.grad_accum` micro-batches; `train.global_batch` counts the sequences of
a whole step over every data-parallel rank, so a config means the same training under any layout.
The loss of a step (step_run.py) is the mean over every valid (non-ignored) label token of the global step:
every rank divides its summed local loss by that count (known to all ranks, since all of them draw the same
global batch and count its labels from the store's segment index, without reading its tokens; a draft whose
vocabulary scores fewer labels counts those on the device: label_count) and FSDP sums the gradients, so
micro-batches and ranks with different numbers of valid tokens are weighted exactly as one large batch on one
device would be.
With train.loss_weighting = sequence the same holds of the step's trained sequences, each label weighted by
1 / its sequence's labels (data/sequence_weights.py; LongAlign's loss weighting).

What is set up before the first step lives in setup.py (run directory, data, checkpoints) and
model.py (the parallelised model); the pieces of a step the planner also uses (optimizer,
schedule, loss forward, clipping) in the step/ package; what a metrics line says in metrics.py, an evaluation
(a mix's loss of each store among it) in evaluation.py. What a step does beside the loss is done by step hooks
called at fixed points (hooks.py; the MoE routers' bookkeeping: moe_hooks.py), LONGCTX_FAULT's faults by a
wrapper around the step (fault_injection.py); when to save in saves.py, what watches the loop in watch.py, the
one read of the steps' figures and what a bad step or a stop leads to in read_back.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Config
from ..errors import Preempted
from ..job import watchdog
from ..job.checks import check_layout
from ..job.devices import resolve_device, resolve_dtype, seed_everything, use_deterministic_algorithms
from ..job.join import join_job
from ..job.launch import end_one_rank_group, under_launcher
from ..models.compile import check_compiler
from ..parallel.context.shares import read_local_batch
from ..progress import phase, progress_bar, said
from ..step.optimizer import make_optimizer
from ..step.schedule import lr_at
from .co2 import co2_rounds
from .evaluation import evaluate_eval_set
from .fault_injection import with_step_faults
from .glide import choose_draft_vocab
from .guard import StepGuard
from .hooks import StepHooks
from .host_budget import check_host_memory
from .host_update import host_update_hooks
from .metrics import MetricsLogger, setup_peak_line
from .model import build_training_model, resolve_offload
from .moe_hooks import MoEStepHook, moe_step_hooks
from .preemption import EarlySignals, StopOnSignal, command_age, set_up_stop
from .profile_step import profile_hooks
from .read_back import read_back, roll_back_trainer, stop_on_signal
from .recompile_hook import recompile_hooks
from .report import write_plots
from .rollback import BadStep, resume_past_rollback
from .run_identity import keep_run_identity, record_tags
from .run_lines import describe_run, done_line
from .run_lock import RunLock
from .saves import RunSaves
from .setup import (
    build_data,
    build_later_stores,
    check_packages,
    continue_run_files,
    make_run_dir,
    on_main,
    open_checkpointing,
    run_tokenizer,
)
from .stages import StagedLoader, holdout_note, start_positions, tokens_through
from .step_progress import StepCounts, counted_steps
from .step_run import label_count, run_step
from .step_state import keep_step_state
from .watch import watched


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per optimizer step run by this job
    grad_norms: list[float] = field(default_factory=list)  # (beside losses: a line logged after a rollback reads one)
    first_step: int = 1  # the step losses[0] belongs to (> 1 after a resume)
    eval_losses: dict[int, float] = field(default_factory=dict)
    eval_by_store: dict[int, dict[str, float]] = field(default_factory=dict)  # a mix's: each store's eval loss
    tokens_per_s: float = 0.0
    # a rollback of the run's last step: the checkpoint step whose weights the run ends with (read_back.py)
    ended_at: int | None = None


class Trainer:
    """One training job on this rank: `Trainer(cfg).run()`. With `read_ahead=False` each step's
    batches are read when the step starts instead of during the step before (the same batches).

    Set-up runs one way: config -> process group -> run directory -> (offload resolved) model ->
    optimizer -> checkpoint (resumed or not) -> the data of the stage the run continues in."""
    step_counts = StepCounts()  # the training phase's count within a step, while the loop runs (step_progress.py)

    def __init__(self, cfg: Config, log=print, read_ahead: bool = True):
        # checkpoint.on_signal is caught during set-up (a signal there stops the run at the loop's first boundary,
        # preemption.EarlySignals) and let go at its end, failed or not: run() catches them again
        self.early_signals = EarlySignals(cfg.checkpoint.on_signal if cfg.checkpoint.saves_or_resumes else "")
        self.run_lock = RunLock()  # the run directory held by this run until it ends (run_lock.py; rank 0's)
        try:  # (in the order the parts need each other: the job, the model and its step, the data and checkpoints)
            with phase("training set-up", done_line=False):  # (a big model's init or a resume's read: minutes)
                self._join(cfg, log)
                self._build()
                self._open_run(read_ahead)
        except BaseException:
            self.run_lock.release()
            raise
        finally:
            self.early_signals.restore()

    def _join(self, cfg: Config, log) -> None:
        """The job (ranks, device, seed, dtype) and the run directory; the config with its offload resolved."""
        self.clock = time.monotonic  # what checkpoint.exit_after_minutes reads (a test installs its own)
        self.started = self.clock() - command_age()  # (the limit counts from the command's start: command_clock)
        if cfg.train.deterministic:
            use_deterministic_algorithms()  # (the process's: before the job starts CUDA or runs any kernel)
        self.rt, self.device = join_job(cfg, training=True)
        rt = self.rt
        self.log = log if rt.is_main else _silent  # one voice per job
        self.dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.autocast_dtype = self.dtype if self.dtype != torch.float32 else None
        seed_everything(cfg.train.seed)
        check_packages(cfg)
        if cfg.train.compile:  # (before the data and the model: a rank started without `longctx train`'s preflight)
            check_compiler(self.device.type)
        self.run_dir = Path(on_main(rt, lambda: str(make_run_dir(cfg, self.run_lock, log)), "making the run directory"))
        self.cfg = resolve_offload(cfg, self.device, rt, self.log)

    def _build(self) -> None:
        """The model, what a step does beside the loss (hooks, fault injection, the guard) and the optimizer."""
        cfg, rt = self.cfg, self.rt
        self.model = build_training_model(cfg, self.device, rt, self.log)
        # what a step does beside the loss, at fixed points (hooks.py): MoE routers' bookkeeping; none in a dense run
        self.hooks = StepHooks(moe_step_hooks(cfg, self.model, rt, self.log))
        # wraps each step's forward and backward: tests put a host-sync detector here (tests/host_sync.py)
        self.device_section = contextlib.nullcontext
        # LONGCTX_FAULT (a testing aid): the step wrapped to inject the faults planned on this rank
        self.step = with_step_faults(self.step, self.model, rt.rank, rt.world)
        # train.on_nonfinite / train.spike_factor: whether a step's update is applied, on the device
        self.guard = StepGuard(cfg.train.spike_factor, cfg.train.spike_window, self.device)
        self.last_spike: torch.Tensor | None = None  # the last step's spike flag (on the device)
        self.skipped_steps = 0  # steps whose update the guard did not apply (as read so far)
        self.skipped_in_a_row = 0  # of them, the latest run of steps with none applied between (train.skip_limit)
        self.first_skipped_in_a_row: int | None = None  # that run's first step (None: not known, an old checkpoint)
        self.skipped_at: set[int] = set()  # their indices in this job's TrainResult.losses (left out of loss_mean)
        self.rollbacks = 0
        self.rollback_repeats: dict = {}  # the last rollbacks in a row to one checkpoint (rollback.check_repeats)
        self.tokens_offset = 0  # positions trained before this run's stage plan counts (a resume's: step_state.py)
        self.optimizer = make_optimizer(self.model, cfg)
        self.hooks.hooks += host_update_hooks(self.optimizer)  # the host update's time (host_optimizer)
        self.hooks.hooks += profile_hooks(cfg, self.run_dir, rt.rank, self.device, self.log)  # metrics.profile_step
        # train.compile (ZeRO++'s compiled kernels): a recompile after the warm-up, said and counted (recompile_hook.py)
        self.hooks.hooks += recompile_hooks(cfg, rt, self.device.type, self.log)

    def _open_run(self, read_ahead: bool) -> None:
        """The data, the checkpoints and what a resume restores, the metrics, and the stage the run starts in."""
        cfg, rt = self.cfg, self.rt
        # global batches in seeded order (one global cursor: resumable under any layout), each permuted
        # so that the data-parallel ranks get samples of balanced estimated cost; by stage (stages.py).
        # Each rank reads only its share of them, the next step's on a background thread
        # (train.loss_weighting = sequence: each label weighted by 1 / its sequence's labels, the step's sum divided
        # by its trained sequences instead of its labels: data/sequence_weights.py)
        read_local = functools.partial(read_local_batch, rt, loss_weighting=cfg.train.loss_weighting)
        self.sampler = StagedLoader(cfg, lambda stage_cfg: build_data(stage_cfg, self.log, rt), rt.dp,
                                    read_local=read_local, read_ahead=read_ahead, log=self.log)
        self.ckpt, self.start_step = open_checkpointing(cfg, self.run_dir, rt, self.model, self.optimizer,
                                                        self.sampler, self.log, run_tokenizer(cfg))
        if self.start_step == 0:  # (a draft run's reduced vocabulary: counted when it starts, a resume's is saved)
            choose_draft_vocab(self.model, cfg, rt, self.log)
        keep_step_state(self)  # the spike check's window, the routers' placements: saved, restored
        keep_run_identity(self)  # the run's id in its metrics records, kept by a resume
        self.saves = RunSaves(self.ckpt, cfg, self.log)  # checkpoint.interval / final / on_save_error
        # train.data_parallel = co2: CO2's rounds over the replicas (co2.py; None under sync)
        self.co2 = co2_rounds(cfg, self.model, self.optimizer, rt, self.ckpt, self.log)
        self.hooks.hooks += [self.co2] if self.co2 is not None else []
        # a resume from a checkpoint the run once rolled back to goes on after the bad step (rollback.py), and
        # counts those rollbacks (made after it was saved: its own count is from before them)
        self.start_step, rolled_back = resume_past_rollback(self.ckpt, self.start_step, self.sampler, self.log)
        self.rollbacks += rolled_back
        self.start_positions = start_positions(cfg, self.ckpt)  # (what checkpoints record as trained: stages.py)
        if self.start_step and (note := holdout_note(cfg)):  # (a resume holds out on its checkpoint's grid)
            self.log(f"data: {note}")
        self.metrics = MetricsLogger(cfg, rt, self.device, self.model, self.run_dir, self.log)
        self._enter_stage(self.start_step + 1, announce=True)  # the one stage the run starts in
        # (every later stage's store built now, before the hang watchdog runs: setup.build_later_stores)
        build_later_stores(cfg, self.sampler.stages, self.start_step, self.log, rt)
        if rt.is_main:
            continue_run_files(self.run_dir, cfg, self.start_step, self.log, self.metrics.path)
        self.log(setup_peak_line(self.device, rt))
        self._describe()

    @property
    def router_counts(self) -> torch.Tensor | None:
        """The last step's choices per expert [layers, E] of a run that trains routers (moe_hooks.py),
        else None: what tests of the expert placement read."""
        moe = self.hooks.find(MoEStepHook)
        return None if moe is None else moe.router_counts

    @property
    def eval_samples(self):
        return self.sampler.eval_samples

    @property
    def micro_step_sequences(self) -> int:  # sequences of one micro-step over the whole job (the stage's)
        return self.sampler.micro_step_sequences

    def _enter_stage(self, step: int, announce: bool = False) -> None:
        """Switch the data to `step`'s stage when it starts there (train.stages), and say so."""
        changed = self.sampler.enter(step)
        if self.ckpt is not None:  # (every step: a rollback may have lowered it, within this stage: roll_back_trainer)
            self._record_trained(self.sampler.stage.index)
        if not (changed or announce):
            return
        if self.sampler.position_note:
            self.log(f"data: {self.sampler.position_note}")
            self.sampler.position_note = None
        s = self.sampler.stage
        self.metrics.enter_stage(s.seq_len)
        if len(self.sampler.stages) > 1:
            self.log(f"stage {s.index + 1}/{len(self.sampler.stages)}: steps {s.first_step}-{s.last_step} at "
                     f"{s.seq_len} tokens per sequence")

    def _record_trained(self, stage: int) -> None:
        """What checkpoints from here on record as trained (config/positions.py): stages 1..`stage`'s lengths."""
        self.ckpt.trained_positions = max(self.start_positions, *(t.seq_len for t in self.sampler.stages[:stage + 1]))

    def _describe(self) -> None:
        for line in describe_run(self.cfg, self.rt.world, self.rt.dims, self.model, self.device, self.dtype,
                                 self.metrics.describe_peak()):
            self.log(line)
        self.log(f"run directory: {self.run_dir}")

    # ------------------------------------------------------------------------------------------
    # the loop

    def run(self) -> TrainResult:
        """Train from the step after start_step to train.steps; returns this job's losses and throughput. The run
        directory is let go once the run has ended, plots and all, or failed (run_lock.py)."""
        try:
            return self._train()
        finally:
            self.run_lock.release()

    def _train(self) -> TrainResult:
        cfg = self.cfg
        # (a resume's TensorBoard hides the abandoned attempt's later steps; every record names the run: run_identity)
        self.metrics.open(self.start_step + 1, record_tags(self))
        progress = progress_bar(cfg.train.steps, "train", "step", cfg.metrics.progress and self.rt.is_main,
                                initial=self.start_step)  # (a resume's steps are done: not in the rate or time left)
        self.metrics.say = progress.write if progress is not None else self.log
        loop = _Loop(TrainResult(run_dir=self.run_dir, first_step=self.start_step + 1), progress)
        self.early_signals.catch()  # (until the loop's StopOnSignal takes them over: watched restores them)
        try:
            # a line at least every progress.interval_s() in logs where no bar is drawn (a first step,
            # a slow interval, an evaluation are each minutes at long lengths on a CPU)
            with watched(cfg, self.rt, self.ckpt is not None, self.started, self.clock, self.early_signals) as stop, \
                    phase("training", total=cfg.train.steps - self.start_step, unit="steps", done_line=False,
                          bar=progress) as beat, counted_steps(self, beat):
                try:
                    step = self._run_steps(loop, stop)
                    if self.ckpt is not None:
                        watchdog.phase(step, "save")
                        self.saves.wait(last=True)  # the last async save is complete and committed before the job ends
                except BaseException:  # (a stop on a bad step, a full disk, Ctrl-C): the save in flight committed
                    self.saves.finish_in_flight()
                    raise
        finally:
            self.early_signals.restore()  # (a no-op once taken over)
            self.hooks.run_end()
            self.sampler.close()
            if progress is not None:
                progress.close()
            self.metrics.close()
        return self._finish(loop.result, time.perf_counter() - loop.start, loop.eval_s)

    def _run_steps(self, loop: _Loop, stop: StopOnSignal) -> int:
        """Steps start_step + 1 to train.steps (a rollback runs some again); returns the last one run."""
        t, progress = self.cfg.train, loop.progress
        step = self.start_step
        if 0 < step < t.steps and (name := stop.agreed(deadline=False)):  # (a signal in set-up: the checkpoint is all)
            raise Preempted(set_up_stop(step, name))
        while step < t.steps:
            step += 1
            self._enter_stage(step)
            lr = self._launch_step(step, loop.unread)
            log_now = self.metrics.due(step)
            if log_now or self.saves.due(step):
                # the one host read of the step's figures, here and not every step: it waits for
                # the device to finish; before a save, so no checkpoint holds a non-finite step
                try:
                    loss, grad_norm = read_back(self, loop.unread, loop.result)
                except BadStep as bad:  # train.on_nonfinite = rollback
                    # a new interval, as the router figures' (hooks.rolled_back): no rolled-back loss in a mean
                    read_at, step = step, roll_back_trainer(self, bad, loop.result)
                    self._log_uncovered(loop, int(self.ckpt.resumed_from[1]["step"]))  # (the kept steps)
                    loop.mean_from = len(loop.result.losses)
                    self.step_counts.end(step - (read_at - 1))  # (the steps after the bad one run again: counted once)
                    continue
                if progress is not None:
                    progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.metrics.saved(self.saves.save(step, self.model, self.optimizer, self.sampler))
            self.step_counts.end(1)  # (made whole, as counted within the step: step_progress.py; and the bar)
            if log_now:
                self._log_step(step, loss, grad_norm, lr, loop)
            if self.eval_samples is not None and (step % t.eval_interval == 0 or step == t.steps):
                loop.eval_s += self._timed_evaluation(step, loop.result)
            signal_name = stop.agreed()  # every rank, every step: a CPU-side flag exchange
            if signal_name and step < t.steps:
                stop_on_signal(self, step, signal_name, loop.unread, loop.result,
                               lambda at: self._log_uncovered(loop, at))
        return step

    def _launch_step(self, step: int, unread: list) -> float:
        """Run `step` and queue its figures, left on the device, for the next read; returns its lr."""
        loss_t, grad_norm_t, lr = self.step(step)
        # (with rollback, the data position after the step: where a rollback past it continues)
        position = self.sampler.state_dict() if self.cfg.train.on_nonfinite == "rollback" else None
        unread.append((step, loss_t, grad_norm_t, self.last_spike, position))
        stage = self.sampler.stage
        self.metrics.stepped(stage.global_batch * stage.seq_len)
        return lr

    def _log_uncovered(self, loop: _Loop, step: int) -> None:
        """The steps through `step` that no metrics line covers yet, as a line of `step` (no hook figures: after a
        rollback the hooks' were of the discarded steps too): a rollback's kept steps (`step`: the checkpoint it went
        back to; the steps after, run and discarded, stay in no mean), or a stop's since the last line (`step`: the
        one it saves). A loss curve that left them out lost trained steps without a word."""
        end = step - loop.result.first_step + 1  # (their losses: a rollback's trimmed to the checkpoint's step)
        if end <= loop.mean_from:  # (a line covered them, or the step is where this job began)
            return
        figures = loop.result
        self._log_step(step, figures.losses[end - 1], figures.grad_norms[end - 1], lr_at(step - 1, self.cfg), loop,
                       end=end)

    def _log_step(self, step: int, loss: float, grad_norm: float, lr: float, loop: _Loop,
                  end: int | None = None) -> None:
        """`step`'s metrics line (metrics.py), with where the run is: tokens, stage, skips, the hooks' fields,
        and the mean loss of the interval's steps (every step's loss is read back anyway; a skipped
        step's left out: non-finite, or a spike whose update was not applied), which loss.png draws. `end`: the
        interval ends there in the losses (steps no line covered: _log_uncovered), not at the newest."""
        losses = loop.result.losses
        whole = end is None
        end = len(losses) if whole else end
        start, loop.mean_from = loop.mean_from, end  # (a rollback's cut resets mean_from)
        interval = losses[start:end]
        finite = [x for i, x in enumerate(interval, start) if math.isfinite(x) and i not in self.skipped_at]
        self.metrics.line(step, loss, grad_norm, lr, {  # (interval_steps: what loss_mean and router figures cover)
            **({"loss_mean": sum(finite) / len(finite)} if finite else {}), "interval_steps": len(interval),
            "tokens": self.tokens_offset + tokens_through(self.sampler.stages, step),
            "seq_len": self.sampler.stage_of(step).seq_len, **self._stage_field(step),
            "elapsed_s": time.perf_counter() - loop.start,
            **({"skipped_steps": self.skipped_steps} if self.skipped_steps else {}),
            **({"rollbacks": self.rollbacks} if self.rollbacks else {}),
            **(self.hooks.log_fields(step, last=step == self.cfg.train.steps) if whole else {})})
        said()  # a metrics line: the heartbeat's quiet starts again

    def _stage_field(self, step: int) -> dict:
        """{"stage": k} (1-based) in a run of several stages, which a metrics record's seq_len alone does not name
        (two stages of one length); {} otherwise."""
        return {"stage": self.sampler.stage_of(step).index + 1} if len(self.sampler.stages) > 1 else {}

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step (1-based): its loss over the global batch and the gradient norm, both
        left on the device, and the lr (step_run.py; a method, so fault injection can wrap it)."""
        return run_step(self, step)

    def evaluate(self) -> float:
        """Mean loss over every valid label of the first train.eval_batches global batches of eval
        samples: a fixed set of sequences (so evals compare), the same under any layout and any
        grad_accum (the micro-batch only decides how many are in flight at once). Over a mix of stores
        self.last_eval.by_store holds each store's too (evaluation.py)."""
        self.last_eval = evaluate_eval_set(self, functools.partial(label_count, self))
        return self.last_eval.loss

    def _timed_evaluation(self, step: int, result: TrainResult) -> float:
        """Evaluate and record; its time and bytes are taken out of the current metrics interval."""
        start, before = self.metrics.now(), self.rt.comm_bytes()  # (after the queued training work)
        watchdog.phase(step, "eval")
        with phase(f"evaluation at step {step}", done_line=False):
            loss = self.evaluate()
        result.eval_losses[step] = loss
        if self.last_eval.by_store is not None:  # (a mix of stores)
            result.eval_by_store[step] = self.last_eval.by_store
        seconds = time.perf_counter() - start
        stage = self._stage_field(step)  # (a staged run's eval set is of its stage's length: said in the record)
        self.metrics.evaluated(step, loss, seconds, before, self.hooks.eval_note(), self.last_eval.by_store,
                               {**stage, "seq_len": self.sampler.stage.seq_len} if stage else None)
        return seconds

    def _finish(self, result: TrainResult, total_s: float, eval_s: float) -> TrainResult:
        t = self.cfg.train
        trained = (tokens_through(self.sampler.stages, t.steps)
                   - tokens_through(self.sampler.stages, result.first_step - 1))
        result.tokens_per_s = trained / (total_s - eval_s) if result.losses else 0.0
        plots = self.cfg.metrics.plots
        if plots and self.rt.is_main:
            try:
                write_plots(self.run_dir, self.metrics.path, self.log)
            except OSError as e:  # (a full disk: the run finished and saved; failing it now sent a requeue again)
                plots = False
                self.log(f"note: the plots could not be written to {self.run_dir} ({e.strerror or e}); the run "
                         f"finished, and its checkpoints and metrics are kept: `longctx report {self.run_dir}` writes "
                         f"them once there is room.")
        self.log(done_line(result, t.steps, total_s, self.run_dir, plots,
                           None if self.ckpt is None else self.ckpt.root, self.cfg.draft.target, self.skipped_steps,
                           self.rollbacks, self.metrics.path))
        return result


@dataclass
class _Loop:
    """What the loop carries from step to step."""
    result: TrainResult
    progress: object  # the progress bar, or None
    start: float = field(default_factory=time.perf_counter)
    eval_s: float = 0.0  # time spent evaluating, left out of the throughput
    unread: list = field(default_factory=list)  # steps whose figures are still on the device
    mean_from: int = 0  # result.losses' index where the current log interval's losses begin


def train(cfg: Config, log=print, *, preflighted: bool = False) -> TrainResult:
    """Run one training job (this rank's part of it) and return its losses. Called from a plain Python process (no
    launcher's env:// variables; `longctx train` passes `preflighted`, its preflight having checked), it first refuses
    a run that would not fit in this machine's free host memory, with the figures, as `longctx train` does before
    any work (train/host_budget.py), rather than leave it to the OOM killer in the first step. Not on a rank of a
    process group the caller made (job/launch.py init_distributed reuses it): one job's ranks, as under a launcher;
    that group stays the caller's, while the one-rank group memory.model_states = host makes at world 1 ends with the
    run, finished or failed (a run ends what it started: a second run in this process starts as the first did)."""
    own_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not preflighted and not under_launcher() and not own_group:
        check_host_memory(cfg, check_layout(cfg, 1), 1, resolve_device(cfg.train.device).type)
    try:
        return Trainer(cfg, log).run()
    finally:
        end_one_rank_group()  # (only the group this run's join_job made; a launched job's: finish_distributed)


def _silent(*_args, **_kwargs) -> None:
    pass

