"""Progressive sequence lengths (`train.stages = "1024:200,4096:100"`): the run's data by stage.

A stage is a sequence length and a number of steps. Each stage reads its own store (the default
store of data.corpus at that length, built once and cached) and has its own sample order, whose
state is one cursor like any run's. The loader switches at the first step of a stage; what is
saved in a checkpoint is the stage and its cursor, so a resume lands in the right stage at the
right sample, whether the checkpoint is before, at or after a boundary. A run without stages is
one stage of train.steps at train.seq_len, with exactly the loader it always had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import Config
from .config_rules import parse_stages
from .data.loader import BatchLoader, cost_coefficients


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


def stage_config(cfg: Config, stage: Stage) -> Config:
    """The run's config with this stage's sequence length and batch (what its data and checks see)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=stage.seq_len,
                                                              global_batch=stage.global_batch))


def tokens_through(stages: list[Stage], step: int) -> int:
    """Tokens trained in steps 1..step."""
    return sum(max(0, min(step, s.last_step) - s.first_step + 1) * s.seq_len * s.global_batch for s in stages)


class StagedLoader:
    """The global batches of each step, from the stage the step belongs to."""

    def __init__(self, cfg: Config, build_data, dp: int):
        self.cfg, self.build_data, self.dp = cfg, build_data, dp
        self.stages = stages_of(cfg)
        self.stage: Stage | None = None
        self.loader: BatchLoader | None = None
        self.train_samples = self.eval_samples = None
        self._saved: dict | None = None  # a checkpoint's data position, applied when its stage is entered

    def stage_of(self, step: int) -> Stage:
        return next((s for s in self.stages if s.first_step <= step <= s.last_step), self.stages[-1])

    def enter(self, step: int) -> bool:
        """Make `step`'s stage the current one (building its data); True when it changed."""
        stage = self.stage_of(step)
        if stage == self.stage:
            return False
        cfg = self.cfg
        self.stage = stage
        self.train_samples, self.eval_samples = self.build_data(stage_config(cfg, stage))
        self.loader = BatchLoader(self.train_samples, self.micro_batch, cfg.train.seed, dp=self.dp,
                                  balance=cfg.data.balance, cost=cost_coefficients(cfg.model))
        if self._saved is not None and int(self._saved.get("stage", 0)) == stage.index:
            self.loader.load_state_dict(self._saved)
        self._saved = None
        return True

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch of the current stage, whole job."""
        return (self.stage or self.stages[0]).global_batch // self.cfg.train.grad_accum

    def next_batch(self):
        return self.loader.next_batch()

    def state_dict(self) -> dict:
        return {**self.loader.state_dict(), "stage": self.stage.index}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's data position: it continues its stage's order when that stage is entered;
        a checkpoint at a stage's last step leaves the next stage to start at its first sample."""
        self._saved = dict(state)
        if self.stage is not None and int(state.get("stage", 0)) == self.stage.index:
            self.loader.load_state_dict(state)
            self._saved = None
