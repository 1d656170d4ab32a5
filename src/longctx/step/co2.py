"""train.data_parallel = co2: CO2's outer optimizer (Sun et al., "CO2: Efficient Distributed Training
with Full Communication-Computation Overlap", ICLR 2024), over the parallel.dp_replicate replicas.

Each replica (an FSDP group: FSDP shards inside it, the replicas hold the same shards) takes
`local_steps` (tau) optimizer steps on its own data with its own AdamW, its gradients never leaving
it. A round then ends on every rank (on the local shards, flat fp32 buffers): its change
delta_i = start_i - x_i, the replica's progress since the last round end, starts an all-reduce that
is not waited for, and x_i is remembered as the mark. `overlap` local steps later (d, 1..tau;
train.co2_overlap_steps, tau by default: CO2's full overlap) the summed change is received and merged:

    dbar    = mean over replicas of delta_i
    m       = beta * m + dbar;  m clipped to norm phi                  (outer momentum, its clip)
    anchor -= alpha * m                       the outer model, the same on every replica
    x_i     = anchor + (x_i - mark_i) / (1 + lambda)    written into the weights

so a replica's own round change is replaced by the average, and what it learnt since the round end
(d steps of its own progress, not yet averaged: the staleness gap) is kept, shrunk by the staleness
gap penalty lambda (our reading of the paper's: a scalar here, not its layer-wise normalised form).
The next round's change is measured so that it is the replica's whole progress since the round end
(the penalty shrinks where the replica stands, not what it sends). With d = tau the merge comes at the
next round end, just before that round's change is sent: the outer step applies each round's average
one round late and the all-reduce is hidden under tau steps of compute (only its excess is exposed).
A smaller d merges sooner, so the replicas drift less from the average, and hides the all-reduce
under d steps only. With alpha = 1, beta = 0, lambda = 0 and replicas that see the same data, this is
exactly training on one replica (each merge replaces a change by itself); tests/distributed/
test_co2.py checks that and the formulas above on two replicas.

A run may start with `sync_steps` synchronous steps (train.co2_sync_steps; post-local SGD, Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): `average_gradients()` before each of them
makes every replica's gradient the global one (as train.data_parallel = sync), so the replicas, their
AdamW moments included, stay identical; `restart()` after the last one makes the weights reached the
start and the outer model of the first round. A run ends on one model: `final_average()` after its
last step merges the change in flight and averages the replicas' weights.

Each replica is an FSDP group of its own (parallel/fsdp/shard.py), so no gradient leaves it. Only those
groups' parameters are CO2's: under expert parallelism the experts' weights are sharded over an
expert-data group that spans the replicas, and their gradients stay synchronous; being one copy, they
are clipped by one coefficient on every shard, the agreed (largest) norm's (`reclip_synchronous`),
where each replica clips its own weights by its own norm.
The state a resume needs is each rank's own (`state_dict`): the replicas' weights and AdamW moments
differ, which a layout-free checkpoint (one copy per replicated shard) cannot hold.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from ..job import comm


def replicated_params(model: torch.nn.Module) -> list[DTensor]:
    """The parameters sharded over a replica's own FSDP group (parallel/fsdp/shard.py gives each replica
    one under co2), not over the experts' mesh."""
    return [p for p in model.parameters() if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("fsdp",)]


def synchronous_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that are not CO2's (replicated_params): one copy over the replicas, their gradients
    synchronous (the experts' weights under expert parallelism, sharded over an expert-data group that
    spans the replicas)."""
    own = {id(p) for p in replicated_params(model)}
    return [p for p in model.parameters() if id(p) not in own]


@torch.no_grad()
def reclip_synchronous(params: list[torch.Tensor], own_norm: torch.Tensor, agreed_norm: torch.Tensor,
                       max_norm: float) -> None:
    """The synchronous `params`' gradients, which clip_gradients clipped by this replica's own norm,
    clipped by the agreed (largest) norm instead: one coefficient on every shard of these one-copy
    weights. With each replica's own, an expert's global gradient reached its optimizer with its shards
    scaled apart (by 0.036 and 0.047 in tests/distributed/test_grad_norm_tiers_audit.py): a replica's
    norm holds its own weights' gradients. A replica's own weights keep its own coefficient. (A non-finite
    norm makes these gradients non-finite or zero: the step is not applied anyway.)"""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if max_norm <= 0 or not grads:
        return
    own = torch.clamp(max_norm / (own_norm + 1e-6), max=1.0)  # (clip_grads_with_norm_'s coefficients)
    agreed = torch.clamp(max_norm / (agreed_norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, (agreed / own).to(grads[0].device))


class OuterSync:
    """CO2's outer step over `params` (DTensors sharded over one replica's FSDP group, `params[0]`'s mesh)
    between the replicas of `replicas` (a 1-D mesh: the ranks holding the same shards in every replica);
    `step_done(k)` after each local optimizer step (k counts them from 1)."""

    def __init__(self, params: list[DTensor], replicas, *, local_steps: int, lr: float, momentum: float,
                 clip: float, penalty: float, overlap: int = 0):
        if not params:
            raise ValueError("CO2 needs parameters sharded over a replica's FSDP group (parallel/fsdp/shard.py)")
        if not 0 <= overlap <= local_steps:
            raise ValueError(f"CO2's overlap must be in 1..local_steps = {local_steps} (0 = local_steps), "
                             f"got {overlap}")
        self.replicas, self.shards = replicas, params[0].device_mesh
        self.params, self.local_steps, self.overlap = params, local_steps, overlap or local_steps
        self.lr, self.beta, self.clip, self.keep = lr, momentum, clip, 1.0 / (1.0 + penalty)
        with torch.no_grad():
            self.start = self._flat()  # where the change sent at the next round end is measured from
        self.anchor = self.start.clone()
        self.momentum = torch.zeros_like(self.start) if momentum > 0 else None
        self.pending = None  # the last round's change, summed over the replicas in flight
        self.arrived: torch.Tensor | None = None  # ... or already received (a checkpoint's)
        self.exposed_s = 0.0  # seconds the last wait for an outer all-reduce took (finish)
        self.rounds = 0

    def _locals(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]

    def _flat(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1).float() for t in self._locals()])

    def _write(self, flat: torch.Tensor, into: list[torch.Tensor] | None = None) -> None:
        """`flat` copied back into `into` (the local weights by default) in order."""
        into = self._locals() if into is None else into
        for t, part in zip(into, flat.split([t.numel() for t in into])):
            t.copy_(part.view_as(t))

    def _receive(self) -> torch.Tensor | None:
        """The previous round's summed change (waiting for it if it is still travelling), or None."""
        self.finish()
        summed, self.arrived = self.arrived, None
        return summed

    def step_done(self, k: int) -> None:
        """After the k-th local step: a merge `overlap` steps after every round end (before the next
        round end's change is measured, when the two coincide; nothing to merge does nothing), a round
        end after every `local_steps`-th. Scheduled from k alone, so a resume that changed the round's
        length, or began from a checkpoint without CO2 state, still merges every round it sends."""
        round_end = k % self.local_steps == 0
        in_flight = self.pending is not None or self.arrived is not None
        if (k >= self.overlap and (k - self.overlap) % self.local_steps == 0) or (round_end and in_flight):
            self.merge()  # (a change in flight is merged before the next is sent, even off the schedule)
        if round_end:
            self.end_round()

    @torch.no_grad()
    def end_round(self) -> None:
        """Send this replica's change since the last round end; its weights are the mark."""
        x = self._flat()
        delta = self.start - x
        self.start = x
        self.pending = comm.all_reduce_async(delta, self.replicas, label="co2_outer")
        self.rounds += 1

    @torch.no_grad()
    def merge(self, keep: float | None = None) -> None:
        """The last round's average in place of this replica's own change; the progress since the mark
        kept, times `keep` (the staleness penalty's by default)."""
        summed = self._receive()
        if summed is None:
            return
        keep = self.keep if keep is None else keep
        change = summed.div_(self.replicas.size())
        if self.momentum is not None:
            change = self.momentum.mul_(self.beta).add_(change)
        if self.clip > 0:
            norm = comm.all_reduce(change.square().sum(), self.shards, label="co2_clip").sqrt()
            change.mul_(torch.clamp(self.clip / (norm + 1e-12), max=1.0))
        self.anchor.sub_(change, alpha=self.lr)
        since = self._flat().sub_(self.start)  # this replica's progress since the round end (x - mark)
        self._write(torch.add(self.anchor, since, alpha=keep))  # (x 1.0 is exact: no penalty changes nothing)
        # the next change sent is the whole progress since the round end, unshrunk: start - x then
        self.start.copy_(self.anchor).add_(since, alpha=keep - 1.0)

    @torch.no_grad()
    def average_gradients(self) -> None:
        """A synchronous step's gradients: each replica's (of its own share of the global batch) replaced
        by their mean, in one all-reduce of the local shards (the replicas hold the same shards)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if len(grads) != len(self.params):
            raise RuntimeError(f"CO2's synchronous step found gradients on {len(grads)} of its {len(self.params)} "
                               f"parameters: every replica must average the same set")
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.replicas, label="co2_sync")
        self._write(flat.div_(self.replicas.size()), into=grads)

    @torch.no_grad()
    def restart(self) -> None:
        """The local rounds begin here, from one model: the replicas' weights averaged (the same already
        after synchronous steps; not after a resume that moved the synchronous steps past local rounds)
        are the first round's start and the outer model; nothing in flight, no outer momentum."""
        self.finish()
        self.arrived = None
        self._one_model("co2_restart")

    @torch.no_grad()
    def final_average(self) -> None:
        """The run's last step: the change in flight merged (the progress since its round end kept
        whole: no later average is coming for the penalty to make room for), then every replica's
        weights replaced by their mean, so the run's last evaluation and checkpoint hold one model with
        every replica's progress. A resumed, longer run's rounds go on from it as from restart()."""
        self.finish()
        self.merge(keep=1.0)
        self._one_model("co2_final")

    def _one_model(self, label: str) -> None:
        flat = comm.all_reduce(self._flat(), self.replicas, label=label).div_(self.replicas.size())
        self._write(flat)
        self.start, self.anchor = flat, flat.clone()
        if self.momentum is not None:
            self.momentum.zero_()

    def finish(self) -> None:
        """Receive the change in flight, if any (kept for its merge, or a checkpoint), timing the wait:
        `exposed_s` is the last one, wherever it fell (a merge, or a checkpoint's save before it; timed
        at the merge only, a save's wait went uncounted and the merge after it repeated the one before)."""
        if self.pending is not None:
            started = time.perf_counter()
            self.arrived, self.pending = self.pending.wait(), None
            self.exposed_s = time.perf_counter() - started

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's CO2 state, copied to host memory: outer state, its local weights and their AdamW state.
        (Host copies: a save writes them after the loop has gone on, an async one steps later, and device
        copies would hold 24-28 bytes per parameter of the device until then; costs/model_states.py
        co2_checkpoint_bytes counts them in the host memory.)"""
        self.finish()
        moments = []
        for p in self.params:
            state = optimizer.state.get(p, {})
            moments.append({k: _host_copy(v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()})
        return {"weights": _host_copy(self._flat()), "start": _host_copy(self.start),
                "anchor": _host_copy(self.anchor), "momentum": _host_copy(self.momentum),
                "arrived": _host_copy(self.arrived), "optimizer": moments, "rounds": self.rounds}

    def cut_like(self, state: dict) -> bool:
        """Whether `state` (state_dict's, this rank's) holds its local tensors as FSDP cuts them now: the same
        layout can cut them otherwise (parallel/fsdp/shard.py: dim 0 under hpz, else costs/model_states.py
        shard_dim's, which differ for a MoE layer's [experts, ...] tensors over more ranks than experts), and
        such a state's flat weights are another slicing of the model, of another length on most ranks."""
        if state["weights"].numel() != self.start.numel() or len(state["optimizer"]) != len(self.params):
            return False
        return all(v.shape == local.shape for local, saved in zip(self._locals(), state["optimizer"], strict=True)
                   for v in saved.values() if v is not None and v.dim())

    @torch.no_grad()
    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        if not self.cut_like(state):
            raise ValueError(f"the CO2 state holds {state['weights'].numel()} local elements in "
                             f"{len(state['optimizer'])} tensors; this rank has {self.start.numel()} in "
                             f"{len(self.params)}")
        self._write(state["weights"].to(self.start.device))
        for name in ("start", "anchor"):
            setattr(self, name, state[name].to(self.start.device))
        if self.momentum is not None and state["momentum"] is not None:
            self.momentum = state["momentum"].to(self.start.device)
        self.arrived = None if state["arrived"] is None else state["arrived"].to(self.start.device)
        self.pending, self.rounds = None, int(state["rounds"])
        for p, saved in zip(self.params, state["optimizer"]):
            current = optimizer.state.get(p, {})
            for k, v in saved.items():
                if k in current:
                    target = current[k].to_local() if isinstance(current[k], DTensor) else current[k]
                    target.copy_(v)


def _host_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of `t` in host memory (a copy on a CPU run too: the state goes on changing), or None."""
    return None if t is None else t.detach().to("cpu", copy=True)
