"""Progressive sequence lengths (`train.stages = "1024:200,4096:100"`): the run's data by stage.

A stage is a sequence length and a number of steps. Each stage reads its own store (the default
store of data.corpus at that length, built once and cached) and has its own sample order, whose
state is one cursor like any run's; stages of one length share their store, and a later one's order
goes on where the earlier ones left it, rather than training on their samples again: where the run
drew to (`cursors`, below), which the plan's steps x batch (drawn_before) is not after a resume that changed
a batch (train.global_batch, or the batch of the stage the run is in) or, under --checkpoint.allow_changes, the
stages before. The loader switches at the first step of a stage; what is saved
in a checkpoint is the stage, its cursor, where each length's store's order stands (`cursors`) and the
identity of its store (data/loader.py store_identity: a resume into that stage
refuses a store rebuilt with other content), so a resume lands in the right stage at the right
sample, whether the checkpoint is before, at or after a boundary. A run without stages is one stage
of train.steps at train.seq_len, with exactly the loader it always had.

`step_batches(step)` hands the training loop a step's micro-batches as this rank's shares, already
read (parallel/context/shares.py read_local_batch: only the tokens the rank holds), and starts reading the next step's
on a background thread while the current step runs. The sample order is still drawn on the main
thread, in order, so the batches are the same with or without that read ahead; the data position
a checkpoint saves is the one after the last step handed out, never the one read ahead, and a
stage change or a loaded position drops what was read ahead.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..config.positions import run_start_positions
from ..config.resume import resumed_manifest
from ..config.rules import parse_stages
from ..data.loader import BatchLoader, cost_coefficients
from ..models.moe_capacity import routes_across_tokens


@dataclass(frozen=True)
class Stage:
    index: int
    seq_len: int
    first_step: int  # 1-based, inclusive
    last_step: int
    global_batch: int  # sequences per optimizer step, whole job


def stages_of(cfg: Config) -> list[Stage]:
    given = parse_stages(cfg.train.stages) if cfg.train.stages else [(cfg.train.seq_len, cfg.train.steps, 0)]
    out, first = [], 1
    for i, (seq_len, steps, batch) in enumerate(given):
        out.append(Stage(i, seq_len, first, first + steps - 1, batch or cfg.train.global_batch))
        first += steps
    return out


def drawn_before(stages: list[Stage], stage: Stage) -> int:
    """Samples the stages before `stage` drew from its store: those of its length read the same store (a batch
    ramp-up, "1024:200:16,1024:100:32", or a return to a length), so `stage` starts its order after them."""
    return sum((s.last_step - s.first_step + 1) * s.global_batch for s in stages[:stage.index]
               if s.seq_len == stage.seq_len)


def holdout_grid(cfg: Config) -> int:
    """The eval-split grid of the stores a run builds from data.corpus (data/default_store.py): its
    longest stage's length, so that every stage holds out the same text, else train.seq_len. A resume
    keeps the grid its checkpoint recorded (resumed_holdout_grid): the stages edited since (a longer one
    added at the end) would otherwise rebuild the store of the stage it continues in with other samples,
    under the saved cursor, and hold out text the stages so far trained on."""
    return resumed_holdout_grid(cfg) or planned_holdout_grid(cfg)


def planned_holdout_grid(cfg: Config) -> int:
    """The grid this config's stages give alone: the longest stage's length, else train.seq_len."""
    return max(s for s, _, _ in parse_stages(cfg.train.stages)) if cfg.train.stages else cfg.train.seq_len


def resumed_holdout_grid(cfg: Config) -> int:
    """The holdout_tokens of the checkpoint this run resumes (the grid its run's stores hold out on); 0 when
    it starts afresh, reads data.path (no grid) or resumes a checkpoint without the record (or none readable:
    its verification refuses it later, in its own words)."""
    # (no train.run_dir: a new runs/<time>-<preset>/, nothing there to resume)
    if cfg.data.path or (cfg.checkpoint.resume == "auto" and not (cfg.checkpoint.dir or cfg.train.run_dir)):
        return 0
    return int(resumed_manifest(cfg, Path(cfg.train.run_dir)).get("holdout_tokens") or 0)


def holdout_note(cfg: Config) -> str | None:
    """What a resume says when it holds out on its checkpoint's grid, below a stage it now plans."""
    kept, planned = resumed_holdout_grid(cfg), planned_holdout_grid(cfg)
    if not kept or kept >= planned:
        return None
    longest = f"this run's longest stage of {planned:,}" if cfg.train.stages else f"train.seq_len {planned:,}"
    return (f"the stores hold out their eval text on the resumed checkpoint's grid of {kept:,} tokens (the longest "
            f"sequence its run had planned), not on {longest}: the run keeps the eval text it held out from the "
            f"start (another grid would rebuild the stores, the one the run continues in among them, with other "
            f"samples), so eval samples longer than {kept:,} tokens are such pieces packed. A new run from these "
            f"weights (--model.init_from) holds out on its own grid.")


def stage_config(cfg: Config, stage: Stage) -> Config:
    """The run's config with this stage's sequence length and batch (what its data and checks see)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=stage.seq_len,
                                                              global_batch=stage.global_batch))


def tokens_through(stages: list[Stage], step: int) -> int:
    """Tokens trained in steps 1..step."""
    return sum(max(0, min(step, s.last_step) - s.first_step + 1) * s.seq_len * s.global_batch for s in stages)


def start_positions(cfg: Config, ckpt) -> int:
    """The positions the starting weights can be trusted with under this run's RoPE settings (config/positions.py;
    a draft's: 0). A resume keeps what the loaded weights already trained on (its stages may have changed since:
    the record was rebuilt from this run's stages alone, and fell); an older manifest without the record, not.
    That record holds its run's start already (the trainer records max(start, stages)), so init_from is not read
    again: a checkpoints directory names its latest checkpoint, which may be a later one now (the run it belongs
    to went on), trained on positions these weights never saw."""
    if cfg.draft.target:
        return 0
    if ckpt is not None and ckpt.resumed_from and ckpt.resumed_from[1].get("trained_positions"):
        return run_start_positions(str(ckpt.resumed_from[0]), cfg.model)
    return run_start_positions(cfg.model.init_from, cfg.model)


class ReadAhead:
    """`read(*args)` running on a daemon thread (one per read: none lingers after it); `result()`
    waits for it and raises its error, with the thread's traceback, in the caller."""

    def __init__(self, read, *args):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(read, args), name="longctx-read-ahead", daemon=True)
        self._thread.start()

    def _run(self, read, args) -> None:
        try:
            self._value = read(*args)
        except BaseException as e:  # raised again by result(), in the caller's thread
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> None:
        """Until the read is over, whatever its outcome (for a read that is being dropped)."""
        self._thread.join()


def _whole_batch(samples, indices):
    """A global batch as one rank of one process reads it, and its valid labels."""
    batch = samples.batch(indices)
    return batch, batch.valid_tokens


class StagedLoader:
    """The global batches of each step, from the stage the step belongs to; as this rank's shares,
    with the next step's read ahead, through `step_batches`."""

    def __init__(self, cfg: Config, build_data, dp: int, read_local=_whole_batch, read_ahead: bool = False,
                 log=None):
        self.cfg, self.build_data, self.dp, self.log = cfg, build_data, dp, log
        self.read_local = read_local  # (samples, global batch indices) -> (my share on the host, valid labels)
        self.read_ahead = read_ahead
        self.stages = stages_of(cfg)
        self.stage: Stage | None = None
        self.loader: BatchLoader | None = None
        self.train_samples = self.eval_samples = None
        self._saved: dict | None = None  # a checkpoint's data position, applied when its stage is entered
        self._resumed_stage: int | None = None  # that position's stage, until the first step after it
        self.position_note: str | None = None  # why that position could not be applied, if it could not
        self._ahead: ReadAhead | None = None  # the next step's shares, being read
        self._ahead_step = 0
        self._ahead_from: dict | None = None  # the data position before the read-ahead step was drawn
        # seq_len -> where its store's order stands after the stages of that length left so far (what the run drew);
        # None: unknown (a position saved before it was recorded): the plan's drawn_before
        self.cursors: dict[int, int] | None = {}
        # seq_len -> the whole data position where its store was left (the stage left in this process, or the loaded
        # position's stage): what a later stage of that length goes on from, a mix's counts and keys with the cursor
        self._left: dict[int, dict] = {}

    def stage_of(self, step: int) -> Stage:
        return next((s for s in self.stages if s.first_step <= step <= s.last_step), self.stages[-1])

    def enter(self, step: int) -> bool:
        """Make `step`'s stage the current one (building its data); True when it changed."""
        stage = self.stage_of(step)
        if self._resumed_stage is not None and stage.index != self._resumed_stage:  # the first step after a resume
            self._saved = None  # a position applies only to its own stage
            if step != stage.first_step:
                # the stage boundaries moved since the save: the saved position belongs to another stage
                self.position_note = (
                    f"the checkpoint's data position is in stage {self._resumed_stage + 1}, but step {step} is "
                    f"in stage {stage.index + 1} of train.stages now (steps {stage.first_step}-{stage.last_step}), "
                    f"so that stage's data starts at its own start, not where the saved run was. Resume "
                    f"with the saved run's train.stages to continue its data order exactly.")
        self._resumed_stage = None
        if stage == self.stage:
            return False
        self._drop_ahead()
        if self.stage is not None and self.loader is not None:
            self._left[self.stage.seq_len] = self.loader.state_dict()
            if self.cursors is not None:
                self.cursors[self.stage.seq_len] = self.loader.order.cursor  # (the stage left: where it left its store)
        cfg = self.cfg
        self.stage = stage
        self.train_samples, self.eval_samples = self.build_data(stage_config(cfg, stage))
        self._say_epochs(stage)
        # (a routing that reads the micro-batch in token order takes its rows unbalanced: models/moe_capacity.py)
        balance = cfg.data.dp_balance and not routes_across_tokens(cfg.model)
        self.loader = BatchLoader(self.train_samples, self.micro_step_sequences, cfg.train.seed, dp=self.dp,
                                  balance=balance, cost=cost_coefficients(cfg.model))
        if self._saved is not None and int(self._saved.get("stage", 0)) == stage.index:
            # (the position records its own stage's store, checked against the store this stage reads now)
            changed = self.loader.load_state_dict(self._saved, allow_changes=cfg.checkpoint.allow_changes)
            self.position_note = " ".join(n for n in (self.position_note, changed) if n) or None
        elif drawn := self._drawn_before(stage, step):
            # the store of an earlier stage of this length: its order goes on past what they trained on (from its
            # first sample, this stage trained on their samples again, in the same order)
            self._go_on(stage, step, drawn)
        self._saved = None
        return True

    def _go_on(self, stage: Stage, step: int, drawn: int) -> None:
        """Start `stage` at `drawn` in its store's order: from the whole position where an earlier stage of its
        length left that store, where it is known and at that cursor (a mix goes on with its schedule, each store
        from its count in its own permutation: data/store_mix.py; the position of a checkpoint at a stage's last
        step is checked against the store, as inside a stage), else from the cursor alone. A mix's stores are all
        of one length, so a run whose stages change its batch reads the same stores in each: taken up from the cursor
        in a mix built afresh (its schedule from position 0, its stores' permutations by place), a mix edited on a
        resume gave each store other counts and another order there, repeating samples and skipping others."""
        left = self._left.get(stage.seq_len) if step == stage.first_step else None
        if left is not None and int(left.get("cursor", -1)) == drawn:
            changed = self.loader.load_state_dict(left, allow_changes=self.cfg.checkpoint.allow_changes)
            self.position_note = " ".join(n for n in (self.position_note, changed) if n) or None
        else:
            self.loader.order.load_state_dict({"cursor": drawn})

    def _drawn_before(self, stage: Stage, step: int) -> int:
        """Where `stage`, entered at `step` with no position of its own, starts in its store's order: where the
        stages of its length before it left it (cursors: what they drew, which the plan does not say when a resume
        changed a batch), else the plan's count; at the plan's when the stage is entered past its first step
        (boundaries moved on a resume: position_note says it starts at its start)."""
        if self.cursors is not None and step == stage.first_step:
            return self.cursors.get(stage.seq_len, 0)
        return drawn_before(self.stages, stage)

    def _say_epochs(self, stage: Stage) -> None:
        """A stage that draws more samples than its store holds repeats them (one seeded shuffle per epoch,
        from the stage's start: drawn_before): said, so that a run over a small store is not taken for one pass."""
        drawn, before = (stage.last_step - stage.first_step + 1) * stage.global_batch, drawn_before(self.stages, stage)
        epochs = (before + drawn) / max(1, len(self.train_samples))
        # (a mix of stores says each store's epochs itself: data/store_mix.py mix_line)
        if self.log is not None and epochs > 1 and not hasattr(self.train_samples, "stores"):
            where = f"stage {stage.index + 1}'s" if len(self.stages) > 1 else "the run's"
            after = f" (after the {before:,} of the stages before it of this length)" if before else ""
            self.log(f"data: {where} {drawn:,} samples{after} {'reach' if before else 'are'} {epochs:.2f} epochs of "
                     f"the store's {len(self.train_samples):,} (each epoch reshuffled; a batch across an epoch's end "
                     f"may hold a sample twice)")

    @property
    def micro_step_sequences(self) -> int:
        """Sequences of one micro-step of the current stage over the whole job (every data-parallel
        rank's micro-batch together)."""
        return (self.stage or self.stages[0]).global_batch // self.cfg.train.grad_accum

    def next_batch(self):
        """The next global micro-batch, whole."""
        self._drop_ahead()
        return self.loader.next_batch()

    def step_batches(self, step: int) -> list:
        """`step`'s micro-batches (train.grad_accum of them), each as (this rank's share on the host,
        valid labels of its global batch); the step of the current stage that follows the last one
        handed out. With read_ahead, the next step's are read in the background meanwhile."""
        if self._ahead is not None and self._ahead_step == step:
            ahead, self._ahead = self._ahead, None
            batches = ahead.result()
        else:
            self._drop_ahead()
            batches = self._read(self.train_samples, self._draw())
        if self.read_ahead and step < self.stage.last_step:
            # drawn here, in step order, so the order and its position never depend on the thread
            self._ahead_from, self._ahead_step = self.loader.state_dict(), step + 1
            self._ahead = ReadAhead(self._read, self.train_samples, self._draw())
        return batches

    def _draw(self) -> list[list[int]]:
        return [self.loader.next_indices() for _ in range(self.cfg.train.grad_accum)]

    def _read(self, samples, draws: list[list[int]]) -> list:
        return [self.read_local(samples, indices) for indices in draws]

    def _drop_ahead(self) -> None:
        """Forget the step read ahead (after its read ends) and put the order back before its draw."""
        if self._ahead is None:
            return
        self._ahead.wait()
        self._ahead = None
        self.loader.load_state_dict(self._ahead_from)

    def close(self) -> None:
        """Drop what was read ahead: no read thread is left running."""
        self._drop_ahead()

    def state_dict(self) -> dict:
        """The data position after the last batch handed out (not after one read ahead). A loaded
        position whose stage is not entered yet is returned as loaded (a save on a signal right after
        a rollback to another stage's position records it, not the forgotten stage's)."""
        if self.loader is None and self._saved is not None:
            return {**self._saved, "stage": self._resumed_stage}
        position = self._ahead_from if self._ahead is not None else self.loader.state_dict()
        if self.cursors is None:
            return {**position, "stage": self.stage.index}
        # (pairs: JSON keeps no integer keys)
        cursors = {**self.cursors, self.stage.seq_len: int(position["cursor"])}
        return {**position, "stage": self.stage.index, "cursors": [[n, c] for n, c in sorted(cursors.items())]}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's (or a rollback's) data position: it continues its stage's order when that
        stage is entered; a position at a stage's last step leaves the next stage to start at its
        start (its first sample, or after the stages before it of its length: drawn_before)."""
        self._drop_ahead()
        self._saved = dict(state)
        self._resumed_stage = int(state.get("stage", 0))
        saved = state.get("cursors")
        self.cursors = None if saved is None else {int(length): int(cursor) for length, cursor in saved}
        # (where the position's stage left its store: a later stage of its length goes on from it, _go_on)
        own = self.stages[self._resumed_stage] if 0 <= self._resumed_stage < len(self.stages) else None
        self._left = {} if own is None else {own.seq_len: {k: v for k, v in state.items() if k not in ("stage",
                                                                                                      "cursors")}}
        if self.stage is None:
            return
        if self._resumed_stage == self.stage.index:
            # (a position of this run's own stage: a rollback's, on the store it was drawn from)
            self.loader.load_state_dict(state, allow_changes=self.cfg.checkpoint.allow_changes)
            self._saved = None
        else:
            # Another stage's position, e.g. a rollback read in stage k+1 to a bad step of stage k: the
            # current stage's loader has moved past the steps that now run again, so it is forgotten,
            # and the next enter() builds the step's stage afresh (from its start, drawn_before, or from this
            # position when it is that stage's).
            self.stage = self.loader = None
