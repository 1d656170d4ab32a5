"""The training phase's count inside a step: a long step's forward and backward, block by block, per micro-batch.

One step at 64K tokens on a CPU, or at 500K on one GPU, takes minutes; a heartbeat line that said "0/1 steps" all
that time could not tell a slow step from a hung one, nor say the time left until the first step ended. So while a
step runs the training phase's count (progress.py) moves by parts of the step, and a line reads
"training [2m10s]: 0.4/1 steps (40%), about 3m left".

A step's micro-batches (train.grad_accum) share all of it but its rest (the optimizer step, clipping) equally;
the StepWeights below say how large the rest is (0.02 with the model states on the device, the predicted host AdamW's
part under a host tier) and, when a draft is trained (draft.target), which part of a micro-batch is the frozen
target's forward, counted block by block by a forward hook on each of the target's blocks. The rest of a
micro-batch's share is weighed in parts of one block's forward: each block's forward 1, its
backward `BACKWARD[memory.recompute]` (about twice the forward; more where the forward runs again inside the
backward), the LM head and loss one block's forward and backward. A forward hook on each block counts its forward
when it returns and registers a hook on its output tensor, which autograd calls when that output's gradient is
ready: the work above it in the backward is done (the head's and loss's for the last block, the block after it for
the others). A recomputation runs inside autograd's engine (torch._C._current_graph_task_id() != -1): a block hook
that fires there is not counted again as a forward, its cost being the backward's.

The count never goes back (a micro-batch starts at the larger of its start and the count) and never passes the
micro-batch's share, so a step never reaches its whole before its update is done (`updated`, after the optimizer
step: the rest counted then, not assumed) or `end`, which makes the count exactly whole in one assignment (as
progress.LayerCounts.end does) and moves the bar (progress_bar's tqdm: metrics.progress) by whole steps only, so
its rate stays steps per second. Under host_optimizer the optimizer step starts the update on the host and
returns: the rest is counted as it starts (the next forward waits for it).

On CUDA a hook fires when its work is launched, not when the device runs it: the count is of launched work, ahead
of the device by what its queue holds; the step's one wait (the optimizer's flag, guarded_step) bounds it.

Only a phase that speaks gets the hooks (rank 0, lines on): another rank's phase is quiet (Phase.quiet) and
nothing reads its count. The hooks are a few Python calls per block per micro-batch, on the blocks' own calls,
outside the compiled parts (models/compile.py): no graph breaks, no recompiles.

What part of a step each kind of its work is (StepWeights), from the cost model's figures, not one fixed guess:

- `frozen`: under draft.target (GliDe / Clover: train/glide.py) each micro-batch runs the frozen target's forward
  first, most of a draft's step, and only then the draft's blocks. Its part of a micro-batch is the target's term
  of models/flops.py draft_train_flops_per_token (its forward without the LM head, no backward) over the whole
  (that, the draft's work 3x its forward, the LM head's rows): counting only the draft's blocks left the count flat
  through the long target forward, then jumping, and the time left optimistic. 0 for a model trained itself.
- `rest`: the part after the micro-batches (clipping, the optimizer step). Under memory.model_states = device it
  is `REST` (a fused AdamW over the rank's shard: a small part). Under host (FSDP2's CPU offload: the AdamW step
  runs on the host's cores after the backward, exposed) and host_optimizer (under FSDP the next forward waits for
  the whole update; at world 1 on a GPU it hides behind that forward: costs/host_bytes.py), it is the cost
  model's host AdamW time (the rank's parameters at costs/hardware.py host_adam_rate, the node's rate shared by
  its ranks: costs/host_bytes.py adam_seconds, the planner's) over itself plus the step's predicted compute
  (the run's model FLOPs, train/metrics.py run_flops_per_token, at GEMM_EFFICIENCY of the peak MFU divides by).
  Against what this 2-core CPU timed under host (debug model, 2 layers, 0.48M parameters): 16 tokens a step
  predicted 0.23, the update took 0.075 of the step (its tiny GEMMs run far below the peak); 512 tokens
  predicted 0.02 (the floor), took 0.018. A long-context step's update is a small part; a short one's is
  counted high, never missed.

Prediction only: nothing here is timed. The rest is counted when the update is done (StepCounts.updated).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..costs.hardware import host_adam_rate
from ..costs.host_bytes import adam_seconds
from ..models.flops import draft_target_flops_per_token
from ..progress import Phase
from .metrics import run_flops_per_token

# a block's backward, in its forward's time, by memory.recompute (full: the whole forward again; selective: the
# token-wise parts again, the attention core not)
BACKWARD = {"none": 2.0, "selective": 2.5, "full": 3.0}
REST = 0.02  # the part of a step after its micro-batches with the model states on the device (clipping, the step)
GEMM_EFFICIENCY = 0.5  # the fraction of the peak a step's work reaches, roughly (its matmuls, attention, the rest)
MOST = 0.9  # the rest's largest part: the micro-batches' work still counts


@dataclass(frozen=True)
class StepWeights:
    """Parts of a step: `frozen`, of each micro-batch's, the frozen target's forward; `rest`, of the step, what
    follows the micro-batches (the update)."""
    frozen: float = 0.0
    rest: float = REST


def target_share(cfg, seq_len: int) -> float:
    """The frozen target's forward's part of a draft-training micro-batch at `seq_len` (0 without draft.target)."""
    if not cfg.draft.target:
        return 0.0
    return draft_target_flops_per_token(cfg.model, seq_len) / run_flops_per_token(cfg, seq_len)


def update_share(cfg, *, seq_len: int, tokens: float, params: int, peak: float | None, device_type: str,
                 local_ranks: int = 1, world: int = 1) -> float:
    """The optimizer step's part of a step of `tokens` per rank at `seq_len`: REST, or under a host tier whose
    update is exposed the predicted host AdamW time of the rank's `params` over itself plus the step's compute
    at `peak` FLOP/s per rank (None, unknown: REST)."""
    tier = cfg.memory.model_states
    hidden = tier == "host_optimizer" and world == 1 and device_type == "cuda"  # (behind the next forward)
    if tier == "device" or hidden or not peak:
        return REST
    adam_s = adam_seconds(params, host_adam_rate(device_type), local_ranks)
    compute_s = run_flops_per_token(cfg, seq_len) * tokens / (peak * GEMM_EFFICIENCY)
    return min(MOST, max(REST, adam_s / (adam_s + compute_s)))


def rank_params(optimizer) -> int:
    """The parameters this rank's optimizer updates (its shards' elements under FSDP)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for group in optimizer.param_groups for p in group["params"])


def trainer_weights(trainer):
    """A function of nothing returning the StepWeights of `trainer`'s next step (its stage's length and batch:
    a stage may change them)."""
    cfg, metrics = trainer.cfg, trainer.metrics
    params = rank_params(trainer.optimizer)
    world = trainer.rt.world

    def weights() -> StepWeights:
        stage = trainer.sampler.stage
        tokens = stage.global_batch * stage.seq_len / world
        return StepWeights(target_share(cfg, stage.seq_len), update_share(
            cfg, seq_len=stage.seq_len, tokens=tokens, params=params, peak=getattr(metrics, "peak", None),
            device_type=trainer.device.type, local_ranks=getattr(metrics, "local_ranks", 1), world=world))

    return weights


class StepCounts:
    """Counts a training step's work in `phase` (the training phase; None: nothing to count) while `layers` (the
    model's blocks) run it, and `frozen` (a draft's frozen target's blocks: forward only) before them; `weights`
    returns the next step's StepWeights (None: a model's own training, the states on the device). The trainer
    calls `micro_batch(i, n)` before each micro-batch's forward, `updated()` once the optimizer step is done and
    `end(n)` once the step is over (n: the steps the count moves by, whole); `close` takes the hooks off."""

    def __init__(self, phase: Phase | None = None, layers=None, recompute: str = "none", frozen=None,
                 weights=None):
        self.phase, self.base, self.counting = phase, None, False
        speaks = phase is not None and not phase.quiet
        layers = list(layers or []) if speaks else []
        self.frozen = list(frozen or []) if speaks else []
        self.weights = weights or StepWeights
        self.share = StepWeights()  # the current step's
        back = BACKWARD.get(recompute, BACKWARD["none"])
        parts = (len(layers) + 1) * (1 + back)  # the blocks' and the head's forward and backward
        self.forward_part, self.head_part, self.backward_part = 1 / parts, (1 + back) / parts, back / parts
        self.frozen_part, self.trained = 0.0, 1.0  # a frozen block's forward, and the trained blocks' scale
        self.unit = self.cap = 0.0  # the micro-batch's share of the step, and where its count stops
        self.above = True  # the next output gradient is the last block's (the head's backward done)
        self.first = layers[0] if layers else None  # (its input's gradient: the last block's backward done)
        self.handles = [layer.register_forward_hook(self._forward_done) for layer in layers]
        self.handles += [block.register_forward_hook(self._frozen_done) for block in self.frozen]

    def micro_batch(self, i: int, n: int) -> None:
        """Micro-batch `i` of the step's `n` starts (its forward next)."""
        if self.phase is None:
            return
        if self.base is None:  # the step's first
            self.base, self.share = self.phase.done, self.weights()
            frozen = self.share.frozen if self.frozen else 0.0  # (the target's forward, counted by its blocks)
            self.frozen_part, self.trained = frozen / max(1, len(self.frozen)), 1 - frozen
        self.unit = (1 - self.share.rest) / n
        floor = self.base + i * self.unit
        self.cap = floor + self.unit
        self.phase.done = max(self.phase.done, floor)  # (one assignment: a line never sees it go back)
        self.counting, self.above = bool(self.handles), True

    def updated(self) -> None:
        """The step's optimizer step is done (its rest: StepWeights): the count is the step's whole."""
        if self.phase is not None and self.base is not None:
            self.phase.done = max(self.phase.done, self.base + 1)
            self.counting = False

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

    def _forward_done(self, module, args, output) -> None:
        if not self.counting or torch._C._current_graph_task_id() != -1:  # (a recomputation: backward work)
            return
        self._add(self.trained * self.forward_part)
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._gradient_ready)
        # the first block's own backward ends with its input's gradient (no block's output after it): without
        # this its part was never counted, a plain step's count stopping near 0.8 until the update
        if module is self.first and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(self._first_done)

    def _gradient_ready(self, _grad) -> None:
        if self.counting:
            self._add(self.trained * (self.head_part if self.above else self.backward_part))
            self.above = False

    def _first_done(self, _grad) -> None:
        if self.counting:
            self._add(self.trained * self.backward_part)

    def _frozen_done(self, *_) -> None:
        if self.counting and torch._C._current_graph_task_id() == -1:
            self._add(self.frozen_part)


@contextlib.contextmanager
def counted_steps(trainer, phase: Phase):
    """`trainer.step_counts` counting its steps in `phase` (the training phase) while the loop runs."""
    model = trainer.model  # (a draft's holds its frozen target outside its module tree: train/glide.py)
    frozen = getattr(getattr(model, "target", None), "layers", None)
    trainer.step_counts = StepCounts(phase, getattr(model, "layers", None), trainer.cfg.memory.recompute, frozen,
                                     trainer_weights(trainer))
    try:
        yield trainer.step_counts
    finally:
        trainer.step_counts.close()
        del trainer.step_counts  # (the class's idle one again)
