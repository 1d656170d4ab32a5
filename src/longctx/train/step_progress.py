"""The training phase's count inside a step: a long step's forward and backward, block by block, per micro-batch.

One step at 64K tokens on a CPU, or at 500K on one GPU, takes minutes; a heartbeat line that said "0/1 steps" all
that time could not tell a slow step from a hung one, nor say the time left until the first step ended. So while a
step runs the training phase's count (progress.py) moves by parts of the step, and a line reads
"training [2m10s]: 0.4/1 steps (40%), about 3m left".

A step's micro-batches (train.grad_accum) share all of it but `REST` (the optimizer step, clipping: a small
rest) equally. A micro-batch's share is weighed in parts of one block's forward: each block's forward 1, its
backward `BACKWARD[memory.recompute]` (about twice the forward; more where the forward runs again inside the
backward), the LM head and loss one block's forward and backward. A forward hook on each block counts its forward
when it returns and registers a hook on its output tensor, which autograd calls when that output's gradient is
ready: the work above it in the backward is done (the head's and loss's for the last block, the block after it for
the others). A recomputation runs inside autograd's engine (torch._C._current_graph_task_id() != -1): a block hook
that fires there is not counted again as a forward, its cost being the backward's.

The count never goes back (a micro-batch starts at the larger of its start and the count) and never passes the
micro-batch's share, so a step never reaches its whole before `end`, which makes the count exactly whole in one
assignment (as progress.LayerCounts.end does) and moves the bar (progress_bar's tqdm: metrics.progress) by whole
steps only, so its rate stays steps per second.

On CUDA a hook fires when its work is launched, not when the device runs it: the count is of launched work, ahead
of the device by what its queue holds; the step's one wait (the optimizer's flag, guarded_step) bounds it.

Only a phase that speaks gets the hooks (rank 0, lines on): another rank's phase is quiet (Phase.quiet) and
nothing reads its count. The hooks are a few Python calls per block per micro-batch, on the blocks' own calls,
outside the compiled parts (models/compile.py): no graph breaks, no recompiles.
"""

from __future__ import annotations

import contextlib

import torch

from ..progress import Phase

# a block's backward, in its forward's time, by memory.recompute (full: the whole forward again; selective: the
# token-wise parts again, the attention core not)
BACKWARD = {"none": 2.0, "selective": 2.5, "full": 3.0}
REST = 0.02  # the part of a step after its micro-batches (the optimizer step, clipping)


class StepCounts:
    """Counts a training step's work in `phase` (the training phase; None: nothing to count) while `layers` (the
    model's blocks) run it. The trainer calls `micro_batch(i, n)` before each micro-batch's forward and `end(n)`
    once the step is over (n: the steps the count moves by, whole); `close` takes the hooks off."""

    def __init__(self, phase: Phase | None = None, layers=None, recompute: str = "none"):
        self.phase, self.base, self.counting = phase, None, False
        speaks = phase is not None and not phase.quiet
        layers = list(layers or []) if speaks else []
        back = BACKWARD.get(recompute, BACKWARD["none"])
        parts = (len(layers) + 1) * (1 + back)  # the blocks' and the head's forward and backward
        self.forward_part, self.head_part, self.backward_part = 1 / parts, (1 + back) / parts, back / parts
        self.unit = self.cap = 0.0  # the micro-batch's share of the step, and where its count stops
        self.above = True  # the next output gradient is the last block's (the head's backward done)
        self.handles = [layer.register_forward_hook(self._forward_done) for layer in layers]

    def micro_batch(self, i: int, n: int) -> None:
        """Micro-batch `i` of the step's `n` starts (its forward next)."""
        if self.phase is None:
            return
        if self.base is None:  # the step's first
            self.base = self.phase.done
        self.unit = (1 - REST) / n
        floor = self.base + i * self.unit
        self.cap = floor + self.unit
        self.phase.done = max(self.phase.done, floor)  # (one assignment: a line never sees it go back)
        self.counting, self.above = bool(self.handles), True

    def end(self, n: float = 1) -> None:
        """The step is over: the count is its start + `n` (1; a rollback's steps back and on), the bar moved by n."""
        if self.phase is None:
            return
        base = self.phase.done if self.base is None else self.base  # (no micro-batch counted: a step stood in for)
        self.phase.done = base + n
        if self.phase.bar is not None:
            self.phase.bar.update(n)
        self.base, self.counting = None, False

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _add(self, part: float) -> None:
        done = self.phase.done
        self.phase.done = min(done + part * self.unit, max(self.cap, done))  # (up to the micro-batch's share)

    def _forward_done(self, _module, _args, output) -> None:
        if not self.counting or torch._C._current_graph_task_id() != -1:  # (a recomputation: backward work)
            return
        self._add(self.forward_part)
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._gradient_ready)

    def _gradient_ready(self, _grad) -> None:
        if self.counting:
            self._add(self.head_part if self.above else self.backward_part)
            self.above = False


@contextlib.contextmanager
def counted_steps(trainer, phase: Phase):
    """`trainer.step_counts` counting its steps in `phase` (the training phase) while the loop runs."""
    trainer.step_counts = StepCounts(phase, getattr(trainer.model, "layers", None), trainer.cfg.memory.recompute)
    try:
        yield trainer.step_counts
    finally:
        trainer.step_counts.close()
        del trainer.step_counts  # (the class's idle one again)
