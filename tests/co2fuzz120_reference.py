"""The cases of tests/distributed/test_co2fuzz120.py (seeded draws of CO2 runs over 4 ranks) and the
one-process emulation they are compared with.

The emulation is written from CO2's formulas (Sun et al., ICLR 2024; docs/parallelism.md's reading of the
staleness penalty as a scalar), not from step/co2.py: it keeps no "start" or "mark" but each replica's own
movement since its last round end, the sum of its optimizer's updates (what the round end sends, negated):

    round end (every H local steps):  delta_i = -own_i;  own_i = 0;  the deltas travel
    d local steps later (the merge):  m = beta m + mean_i delta_i  (m = the mean without momentum),
                                      m *= min(1, phi / |m|),  anchor -= alpha m,
                                      x_i = anchor + own_i / (1 + lambda)
    after the last step:              the change in flight merged with lambda = 0, then x_i averaged.

Steps 1..N (train.co2_sync_steps) average the replicas' gradients before clipping; after step N the
replicas' weights are averaged into the anchor, with no momentum. The local step is torch's AdamW (the
single-tensor one, decay on matrices only), torch's global-norm clip of the replica's own gradient, a
learning rate from docs' warmup + decay formula, and the single-device model of the config, its summed
loss scaled by R / the job's labels (each replica's gradient a share of the job's token mean).
"""

from __future__ import annotations

import math

import numpy as np
import torch

SCHEDULES = ("cosine", "linear", "1-sqrt", "constant")
DECAYS = {"cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)), "linear": lambda p: 1 - p,
          "1-sqrt": lambda p: 1 - math.sqrt(p)}
# (dp_replicate, dp_shard, zero_pp settings): FSDP across 2 ranks of each replica or none (4 replicas of one
# rank); ZeRO++ inside a replica where co2 allows it: hpz over the whole replica (a node of 2) or over 1 rank
# (Frontier's third level: groups of 1 inside nodes of 2), qwz and qgz with one-element blocks (exact int8)
LAYOUTS = (
    (2, 2, []), (4, 1, []), (2, 2, []),
    (2, 2, ["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2"]),
    (2, 2, ["--parallel.zero_pp=hpz,qwz,qgz", "--parallel.ranks_per_node=2", "--parallel.hpz_ranks=1",
            "--parallel.zero_pp_block=1"]),
    (2, 2, ["--parallel.zero_pp=qwz,qgz", "--parallel.ranks_per_node=1", "--parallel.zero_pp_block=1"]),
)


def draw_case(seed: int) -> dict:
    """One CO2 run's settings, a pure function of `seed`; `resume_at` is the step whose checkpoint a second run
    resumes from, any step but the first and the last (mid-round, at a round end, between a round end and its
    merge, or in the synchronous steps, as drawn)."""
    rng = np.random.default_rng(seed)
    rep, shard, zero_pp = LAYOUTS[seed % len(LAYOUTS)]  # (in turn: every layout in any 6 seeds)
    H = int(rng.integers(1, 5))
    steps = int(rng.integers(max(5, 2 * H + 1), 10))
    sync = int(rng.choice([0, 0, 1, 2]))
    accum = int(rng.choice([1, 1, 2]))
    case = dict(
        seed=seed, rep=rep, shard=shard, zero_pp=zero_pp, H=H, d=int(rng.integers(0, H + 1)), steps=steps,
        sync=sync, accum=accum, grad_sync=str(rng.choice(["step", "micro_batch"])),
        alpha=float(rng.choice([1.0, round(float(rng.uniform(0.5, 1.5)), 2)])),
        beta=float(rng.choice([0.0, round(float(rng.uniform(0.2, 0.9)), 2)])),
        # (a round's mean change has a norm of about 1 to 10 here: a clip far under it would make every merge the same
        # length whatever was averaged, and hide a wrong change)
        phi=float(rng.choice([0.0, 0.0, round(float(rng.uniform(1.0, 10.0)), 2)])),
        penalty=float(rng.choice([0.0, round(float(rng.uniform(0.1, 1.0)), 2)])),
        clip=float(rng.choice([0.0, 0.05, 1.0])), decay=float(rng.choice([0.0, 0.1])),
        schedule=str(rng.choice(SCHEDULES)), warmup=int(rng.integers(0, 3)),
        lr=float(rng.choice([3e-3, 1e-2])), dtype=str(rng.choice(["fp32", "fp32", "bf16"])),
        async_save=bool(rng.integers(2)), fraction=float(rng.choice([1.0, 0.5])),
        weighting=str(rng.choice(["token", "token", "sequence"])), eval=int(rng.choice([0, 0, 3])))
    case["resume_at"] = int(rng.integers(2, steps))
    if rng.integers(3) == 0:  # train.stages: a shorter first stage, its own store (the rounds go on across it)
        first = int(rng.integers(1, steps))
        case["extra"] = [f"--train.stages=32:{first}:{4 * accum},64:{steps - first}:{4 * accum}"]
    return case


def case_args(case: dict) -> list[str]:
    """The case as Trainer overrides (beside the test's fixed ones)."""
    c = case
    return [f"--parallel.dp_replicate={c['rep']}", f"--parallel.dp_shard={c['shard']}", *c["zero_pp"],
            "--train.data_parallel=co2", f"--train.co2_local_steps={c['H']}", f"--train.co2_overlap_steps={c['d']}",
            f"--train.co2_outer_lr={c['alpha']}", f"--train.co2_outer_momentum={c['beta']}",
            f"--train.co2_momentum_clip={c['phi']}", f"--train.co2_staleness_penalty={c['penalty']}",
            f"--train.co2_sync_steps={c['sync']}", f"--train.steps={c['steps']}", f"--train.grad_accum={c['accum']}",
            f"--train.global_batch={4 * c['accum']}", f"--memory.grad_sync={c['grad_sync']}",
            f"--train.grad_clip={c['clip']}", f"--train.weight_decay={c['decay']}",
            f"--train.lr_schedule={c['schedule']}", f"--train.warmup_steps={c['warmup']}", f"--train.lr={c['lr']}",
            f"--train.dtype={c['dtype']}", f"--train.lr_decay_fraction={c['fraction']}",
            f"--train.loss_weighting={c['weighting']}", f"--train.eval_interval={c['eval']}", *c.get("extra", [])]


def learning_rate(step: int, case: dict, floor_ratio: float) -> float:
    """docs/running.md: linear warmup over `warmup` updates to lr, then the decay over the last `fraction` of the
    run (its length rounded half up) to lr x floor_ratio at the last update, lr held before it (step: 1-based)."""
    i, steps, lr, warmup = step - 1, case["steps"], case["lr"], case["warmup"]
    if i < warmup:
        return lr * (i + 1) / warmup
    if case["schedule"] == "constant":
        return lr
    start = max(warmup, steps - 1 - max(1, math.floor(case["fraction"] * steps + 0.5)))
    progress = min(1.0, max(0.0, (i - start) / max(1, steps - 1 - start)))
    return lr * floor_ratio + (lr - lr * floor_ratio) * DECAYS[case["schedule"]](progress)


def _vector(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _assign(model, vector: torch.Tensor) -> None:
    with torch.no_grad():
        for p, part in zip(model.parameters(), vector.split([p.numel() for p in model.parameters()])):
            p.copy_(part.view_as(p))


class Emulation:
    """R replicas of the case's model on one process and CO2's outer state (float64 vectors)."""

    def __init__(self, case: dict, cfg, replicas: int):
        from longctx.models.llama import build_model

        self.case, self.cfg, self.models, self.optimizers = case, cfg, [], []
        for _ in range(replicas):
            model = build_model(cfg.model, device="meta")
            model.to_empty(device="cpu")
            model.init_weights(cfg.train.seed)
            self.models.append(model)
            groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": case["decay"]},
                      {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
            t = cfg.train
            self.optimizers.append(torch.optim.AdamW(groups, lr=case["lr"], betas=(t.beta1, t.beta2), eps=t.eps,
                                                     foreach=False))
        self.anchor = _vector(self.models[0])
        self.momentum = torch.zeros_like(self.anchor)
        self.own = [torch.zeros_like(self.anchor) for _ in self.models]
        self.flight: tuple[int, list[torch.Tensor]] | None = None  # (the local step it was sent at, the deltas)

    def gradients(self, step: int, shares: list, valid: int) -> float:
        """Every replica's gradient of its shares (its micro-batches); returns the job's summed loss."""
        from longctx.data.samples import Batch

        dtype = torch.bfloat16 if self.case["dtype"] == "bf16" else None
        total, R = 0.0, len(self.models)
        for model, mine in zip(self.models, shares):
            for arrays in mine:
                batch = Batch(*(None if a is None else torch.from_numpy(a) for a in arrays))
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None, cache_enabled=False):
                    loss = model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels,
                                 loss_reduction="sum", label_weights=batch.label_weights)
                (loss * R / valid).backward()
                total += float(loss.detach())
        if step <= self.case["sync"]:  # synchronous: every replica's gradient the replicas' mean
            for params in zip(*(m.parameters() for m in self.models)):
                mean = sum(p.grad for p in params) / R
                for p in params:
                    p.grad = mean.clone()
        return total

    def update(self, step: int) -> None:
        c = self.case
        lr = learning_rate(step, c, self.cfg.train.min_lr_ratio)
        for i, (model, optimizer) in enumerate(zip(self.models, self.optimizers)):
            before = _vector(model)
            if c["clip"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.own[i] += _vector(model) - before
        if step == c["sync"]:
            self._one_model()
        elif step > c["sync"]:
            self._outer(step - c["sync"])
        if step == c["steps"]:
            if self.flight is not None:
                self._merge(keep=1.0)
            self._one_model()

    def _outer(self, k: int) -> None:
        c = self.case
        if self.flight is not None and k == self.flight[0] + (c["d"] or c["H"]):
            self._merge(keep=1.0 / (1.0 + c["penalty"]))
        if k % c["H"] == 0:
            assert self.flight is None, "a round's change sent before the last one was merged"
            self.flight = (k, [-own for own in self.own])
            self.own = [torch.zeros_like(own) for own in self.own]

    def _merge(self, keep: float) -> None:
        c = self.case
        mean = sum(self.flight[1]) / len(self.models)
        self.momentum = c["beta"] * self.momentum + mean if c["beta"] > 0 else mean
        if c["phi"] > 0:
            self.momentum = self.momentum * min(1.0, c["phi"] / (float(self.momentum.norm()) + 1e-12))
        self.anchor = self.anchor - c["alpha"] * self.momentum
        for model, own in zip(self.models, self.own):
            _assign(model, self.anchor + keep * own)
        self.flight = None

    def _one_model(self) -> None:
        self.anchor = sum(_vector(m) for m in self.models) / len(self.models)
        for model in self.models:
            _assign(model, self.anchor)
        self.momentum = torch.zeros_like(self.anchor)
        self.own = [torch.zeros_like(self.anchor) for _ in self.models]
        self.flight = None

    def weights(self) -> torch.Tensor:
        return sum(_vector(m) for m in self.models) / len(self.models)


def emulate(case: dict, cfg, shares: list) -> tuple[list[float], torch.Tensor]:
    """The run's losses (the job's token mean, step by step) and its final weights; shares[r][s]: replica r's
    micro-batches of step s + 1 (each as the arrays of a Batch and the labels of its global micro-batch)."""
    run = Emulation(case, cfg, len(shares))
    losses = []
    for step in range(1, case["steps"] + 1):
        mine = [replica[step - 1] for replica in shares]
        # the step's labels: each global micro-batch's count once (a replica's first rank holds each of them once)
        valid = sum(v for *_, v in mine[0][:case["accum"]])
        total = run.gradients(step, [[m[:-1] for m in rep] for rep in mine], valid)
        losses.append(total / valid)
        run.update(step)
    return losses, run.weights()
