"""train.data_parallel = co2 in the loop (the outer step itself: step/co2.py): after the
train.co2_sync_steps synchronous steps, a round ends after every train.co2_local_steps-th optimizer
step; the metrics line says how many rounds ran and how long the last merge waited for its
all-reduce (`co2_exposed_s`); each checkpoint carries every rank's CO2 state in its own
file, read back on a resume under the same layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..checkpoint.rng_states import local_state_file
from ..job import comm
from ..step.co2 import OuterSync, reclip_synchronous, replicated_params, synchronous_params
from .hooks import StepHook

STATE_KEY = "co2"


class CO2Rounds(StepHook):
    """The rounds of a co2 run: steps 1..sync_steps synchronous (`before_clip` averages their gradients),
    then a round ends after every local_steps-th step, its average merged overlap steps later; after
    the last step the replicas' weights are averaged."""

    def __init__(self, outer: OuterSync, replica_mesh, sync_steps: int = 0, last_step: int = 0,
                 synchronous: list = (), max_norm: float = 0.0):
        self.outer, self.replica_mesh, self.sync_steps, self.last_step = outer, replica_mesh, sync_steps, last_step
        self.synchronous, self.max_norm = list(synchronous), max_norm  # (the experts' weights, train.grad_clip)

    def before_clip(self, step: int) -> None:
        if step <= self.sync_steps:
            self.outer.average_gradients()

    def after_optimizer(self, step: int, applied: torch.Tensor) -> None:
        if step == self.sync_steps:
            self.outer.restart()
        elif step > self.sync_steps:
            self.outer.step_done(step - self.sync_steps)
        if step == self.last_step:  # one model for the last evaluation and checkpoint
            self.outer.final_average()

    def agreed_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The largest of the replicas' gradient norms (each clipped its own): one figure on every rank,
        so that train.on_nonfinite's stop is decided by all of them alike. A NaN norm is sent as +inf:
        a MAX all-reduce keeps the first operand when a comparison with NaN is false (gloo's max(1, NaN)
        is 1), so one replica's NaN gradients would pass the guard, and their update would be applied.
        It also re-clips the synchronous weights' gradients (the experts', one copy over the replicas) by
        that agreed norm, in place (step/co2.py reclip_synchronous)."""
        mine = grad_norm.detach().clone()
        mine = torch.where(torch.isnan(mine), torch.full_like(mine, float("inf")), mine)
        agreed = comm.all_reduce(mine, self.replica_mesh, op=dist.ReduceOp.MAX, label="metrics")
        # weights that are not a replica's own (the experts') take the agreed norm's clip, one on every shard
        reclip_synchronous(self.synchronous, grad_norm, agreed, self.max_norm)
        return agreed

    def log_fields(self, step: int, last: bool) -> dict:
        if not self.outer.rounds:
            return {}
        return {"co2_rounds": self.outer.rounds, "co2_exposed_s": round(self.outer.exposed_s, 4)}

    def run_end(self) -> None:
        self.outer.finish()


def co2_rounds(cfg, model, optimizer, rt, ckpt, log) -> CO2Rounds | None:
    """The hook of a co2 run (None under sync), its state restored from the checkpoint the run resumed
    from when that was written by a co2 run of the same layout; else its rounds start from the weights."""
    t = cfg.train
    if t.data_parallel != "co2":
        _note_dropped_state(ckpt, log)
        return None
    outer = OuterSync(replicated_params(model), model.co2_replicas, local_steps=t.co2_local_steps, lr=t.co2_outer_lr,
                      momentum=t.co2_outer_momentum, clip=t.co2_momentum_clip, penalty=t.co2_staleness_penalty,
                      overlap=t.co2_overlap_steps)
    if ckpt is not None:
        ckpt.rank_state = lambda: {STATE_KEY: outer.state_dict(optimizer)}
        resumed = getattr(ckpt, "resumed_from", None)
        if resumed is not None:
            _restore(outer, optimizer, ckpt, *resumed, log, t.steps)
    warm = f", after {t.co2_sync_steps} synchronous steps" if t.co2_sync_steps else ""
    log(f"data parallel: co2 over {rt.dims.dp_replicate} replicas, a round every {t.co2_local_steps} steps{warm}, "
        f"its average merged {outer.overlap} steps later (outer lr {t.co2_outer_lr}, momentum "
        f"{t.co2_outer_momentum})")
    return CO2Rounds(outer, comm.sub_mesh(rt.mesh, "dp_replicate"), t.co2_sync_steps, t.steps,
                     synchronous_params(model), t.grad_clip)


def _restore(outer: OuterSync, optimizer, ckpt, path, manifest: dict, log, steps: int) -> None:
    state = ckpt.load_rank_state(path, manifest)
    if state is None or STATE_KEY not in state:
        log(_not_restored_note(path, manifest, ckpt.layout))
        return
    if not outer.cut_like(state[STATE_KEY]):  # (every rank alike: a changed cut changes every rank's shapes)
        log(_recut_note(path))
        return
    outer.load_state_dict(state[STATE_KEY], optimizer)
    note = lengthened_note(getattr(ckpt, "resumed_state", None), path.name, steps)
    if note:
        log(note)


def _not_restored_note(path, manifest: dict, layout: dict) -> str:
    """What a co2 run resumed from a checkpoint that holds no CO2 state for its layout goes on from. A co2 run's
    checkpoint under another layout (its ranks' own files are there, for other ranks) leaves behind what only those
    files held, as a resume under sync does (_note_dropped_state); until 2026-12-04 it said only "holds no CO2 state
    for this layout (written under sync or another layout)", neither which nor what was dropped."""
    if not (path / local_state_file(0)).is_file():  # (every rank of a co2 run writes its own: rank 0's is there)
        return (f"co2: {path.name} holds no CO2 state (written under train.data_parallel = sync): the replicas start "
                f"their rounds from its weights")
    return (f"co2: {path.name} was written by a co2 run under another layout ({_layout(manifest['layout'])}; now "
            f"{_layout(layout)}): every replica goes on from its replica 0's weights and AdamW moments; the other "
            f"replicas' progress since their last merge (none after a co2 run's last step, which averages them) and "
            f"CO2's outer state (its momentum, a change in flight) are not carried over. Resume under the layout it "
            f"was written with to keep them.")


def _recut_note(path) -> str:
    """What a co2 run resumed under its checkpoint's layout goes on from when FSDP now cuts the weights otherwise
    (parallel.zero_pp's hpz added or dropped: parallel/fsdp/shard.py). Until 2026-12-04 every rank raised "the CO2
    state holds N local elements", or, where the lengths agreed, would have read another slicing as its own."""
    return (f"co2: {path.name} was written by a co2 run whose FSDP cut its tensors otherwise (parallel.zero_pp's hpz "
            f"cuts every tensor on dim 0, without it a MoE layer's [experts, ...] tensors over more ranks than "
            f"experts are cut on another dim): every replica goes on from its replica 0's weights and AdamW "
            f"moments; the other replicas' progress since their last merge and CO2's outer state (its momentum, a "
            f"change in flight) are not carried over. Resume with hpz in parallel.zero_pp or not, as it was written, "
            f"to keep them.")


def _layout(x: dict) -> str:
    expert = f" x expert {x['expert']}" if x.get("expert", 1) > 1 else ""
    return (f"{x['world']} ranks: head {x['head']} x ctx {x['ctx']} x dp {x['dp_replicate']}x{x['dp_shard']}"
            f"{expert}")


def lengthened_note(saved: dict | None, name: str, steps_now: int) -> str | None:
    """What a co2 run resumed from its last step's checkpoint to train more steps (steps_now: train.steps)
    should hear (saved: the checkpoint's trainer state, its step and its run's schedule settings). That
    checkpoint holds the replicas' average made after the last step (final_average: the change in flight
    merged with the progress since kept whole, the outer momentum zeroed), not the replicas the uninterrupted
    longer run would go on with: the lengthened run trains another trajectory, silently until 2026-12-03
    (debug model, 2 replicas, H 2, outer momentum 0.5, constant lr: step 6's loss 4.86 against 4.32)."""
    step, steps = (saved or {}).get("step"), ((saved or {}).get("schedule") or {}).get("steps")
    if step is None or step != steps or steps_now <= step:
        return None
    return (f"co2: {name} is its run's last step ({step}), where the replicas' weights were averaged and the outer "
            f"momentum reset: the rounds go on from that one model, which is not how an uninterrupted run of this "
            f"length would go on. To lengthen a co2 run as if it had not stopped, resume from a checkpoint before "
            f"its last step (checkpoint.interval).")


def _note_dropped_state(ckpt, log) -> None:
    """A sync run resumed from a co2 run's checkpoint (its ranks' own CO2 state beside it) says what it leaves
    behind: it went on from replica 0's weights and AdamW moments, the outer momentum and the other
    replicas' progress dropped without a word (docs/parallelism.md says it; the run did not)."""
    resumed = ckpt.resumed_from if ckpt is not None else None
    if resumed is None or not (resumed[0] / local_state_file(ckpt.rank)).is_file():
        return
    log(f"co2: {resumed[0].name} was written by a train.data_parallel = co2 run; under sync this run goes on from "
        f"its replica 0's weights and AdamW moments: the other replicas' progress since their last merge (none "
        f"after a co2 run's last step, which averages them) and CO2's outer state (its momentum, a change in "
        f"flight) are not carried over. Resume with --train.data_parallel co2 (the same layout) to keep them.")
