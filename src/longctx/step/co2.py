"""train.data_parallel = co2: CO2's outer optimizer (Sun et al., "CO2: Efficient Distributed Training
with Full Communication-Computation Overlap", ICLR 2024), over the parallel.dp_replicate replicas.

Each replica (an FSDP group: FSDP shards inside it, the replicas hold the same shards) takes
`local_steps` (tau) optimizer steps on its own data with its own AdamW, its gradients never leaving
it. A round then ends on every rank with, on the local shards (flat fp32 buffers):

    delta_i  = start_i - x_i                 this replica's change over the round
    dbar     = mean over replicas of the PREVIOUS round's delta (its all-reduce ran under this round)
    m        = beta * m + dbar;  m clipped to norm phi                      (outer momentum, its clip)
    anchor  -= alpha * m                      the outer model, the same on every replica
    start_i  = anchor - delta_i / (1 + lambda)    where the next round starts, written into the weights
    all-reduce(delta_i) started, not waited for: it travels while the next round computes

A run may start with `sync_steps` synchronous steps (train.co2_sync_steps; post-local SGD, Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): `average_gradients()` before each of them
makes every replica's gradient the global one (as train.data_parallel = sync), so the replicas, their
AdamW moments included, stay identical; `restart()` after the last one makes the weights reached the
start and the outer model of the first round. Local steps cost the most convergence early, where the
loss falls fastest and a round-old change is furthest from current.

So the outer step applies each round's averaged change one round late, and the all-reduce is fully
overlapped with tau local steps (only what it takes longer than they do is exposed). A replica restarts
from the outer model plus its own change, not yet averaged: the replicas differ by one round of local
progress, the staleness gap. lambda (the staleness gap penalty, our reading of the paper's: a scalar
here, not its layer-wise normalised form) shrinks that private lead; it is replaced by the average a
round later in any case. With alpha = 1, beta = 0, lambda = 0 and replicas that see the same data, this
is exactly training on one replica (the anchor lags the weights by one change); tests/distributed/
test_co2.py checks that and the formulas above on two replicas.

Each replica is an FSDP group of its own (parallel/fsdp/shard.py), so no gradient leaves it. Only those
groups' parameters are CO2's: under expert parallelism the experts' weights are sharded over an
expert-data group that spans the replicas, and their gradients stay synchronous.
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


class OuterSync:
    """CO2's outer step over `params` (DTensors sharded over one replica's FSDP group, `params[0]`'s mesh)
    between the replicas of `replicas` (a 1-D mesh: the ranks holding the same shards in every replica);
    `end_round()` after every `local_steps`-th optimizer step."""

    def __init__(self, params: list[DTensor], replicas, *, local_steps: int, lr: float, momentum: float,
                 clip: float, penalty: float):
        if not params:
            raise ValueError("CO2 needs parameters sharded over a replica's FSDP group (parallel/fsdp/shard.py)")
        self.replicas, self.shards = replicas, params[0].device_mesh
        self.params, self.local_steps = params, local_steps
        self.lr, self.beta, self.clip, self.keep = lr, momentum, clip, 1.0 / (1.0 + penalty)
        with torch.no_grad():
            self.start = self._flat()
        self.anchor = self.start.clone()
        self.momentum = torch.zeros_like(self.start) if momentum > 0 else None
        self.pending = None  # the last round's change, summed over the replicas in flight
        self.arrived: torch.Tensor | None = None  # ... or already received (a checkpoint's)
        self.exposed_s = 0.0  # seconds the last round end waited for the previous all-reduce
        self.rounds = 0

    def _locals(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]

    def _flat(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1).float() for t in self._locals()])

    def _write(self, flat: torch.Tensor) -> None:
        locals_ = self._locals()
        for t, part in zip(locals_, flat.split([t.numel() for t in locals_])):
            t.copy_(part.view_as(t))

    def _receive(self) -> torch.Tensor | None:
        """The previous round's summed change (waiting for it if it is still travelling), or None."""
        if self.pending is not None:
            started = time.perf_counter()
            self.arrived, self.pending = self.pending.wait(), None
            self.exposed_s = time.perf_counter() - started
        summed, self.arrived = self.arrived, None
        return summed

    @torch.no_grad()
    def end_round(self) -> None:
        delta = self.start - self._flat()
        summed = self._receive()
        if summed is not None:
            change = summed / self.replicas.size()
            if self.momentum is not None:
                change = self.momentum.mul_(self.beta).add_(change)
            if self.clip > 0:
                norm = comm.all_reduce(change.square().sum(), self.shards, label="co2_clip").sqrt()
                change.mul_(torch.clamp(self.clip / (norm + 1e-12), max=1.0))
            self.anchor.sub_(change, alpha=self.lr)
        self.start = self.anchor - delta * self.keep  # (x 1.0 is exact: no penalty changes nothing)
        self._write(self.start)
        self.pending = comm.all_reduce_async(delta, self.replicas, label="co2_outer")
        self.rounds += 1

    @torch.no_grad()
    def average_gradients(self) -> None:
        """A synchronous step's gradients: each replica's (of its own share of the global batch) replaced
        by their mean, in one all-reduce of the local shards (the replicas hold the same shards)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if len(grads) != len(self.params):
            raise RuntimeError(f"CO2's synchronous step found gradients on {len(grads)} of its {len(self.params)} "
                               f"parameters: every replica must average the same set")
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.replicas, label="co2_sync")
        flat.div_(self.replicas.size())
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    @torch.no_grad()
    def restart(self) -> None:
        """The local rounds begin here: the current weights (the same on every replica after synchronous
        steps) are the first round's start and the outer model."""
        self.finish()
        self.start = self._flat()
        self.anchor = self.start.clone()
        self.arrived = None
        if self.momentum is not None:
            self.momentum.zero_()

    def finish(self) -> None:
        """Receive the change in flight, if any (kept for the next round end, or a checkpoint)."""
        if self.pending is not None:
            self.arrived, self.pending = self.pending.wait(), None

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's CO2 state, copied: outer state, its local weights and their AdamW state."""
        self.finish()
        moments = []
        for p in self.params:
            state = optimizer.state.get(p, {})
            moments.append({k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()})
        return {"weights": self._flat().clone(), "start": self.start.clone(), "anchor": self.anchor.clone(),
                "momentum": None if self.momentum is None else self.momentum.clone(),
                "arrived": None if self.arrived is None else self.arrived.clone(), "optimizer": moments,
                "rounds": self.rounds}

    @torch.no_grad()
    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        if state["weights"].numel() != self.start.numel() or len(state["optimizer"]) != len(self.params):
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
