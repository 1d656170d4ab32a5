"""What each spawned rank of a validation case runs (planner/validate.py spawns them and compares): the case's
training set up as `longctx train` sets it up, a random global batch packed from documents, its micro-batches,
one optimizer step, the model-state bytes the rank holds, and the workers that time the steps, count their
bytes and measure the activations."""

from __future__ import annotations

import time

import torch

from ..config import build_config
from ..data.samples import Batch
from ..job import comm
from ..job.runtime import Runtime
from ..job.traffic import library_traffic
from ..memory.measured import measure_activations
from ..models.llama import build_model
from ..parallel.context.shares import local_batch
from ..parallel.fsdp.shard import grad_scale
from ..parallel.parallelize import apply_memory, parallelize, use_sequence_parallel_attention
from ..step.gradients import set_gradient_sync
from ..step.loss import router_loss, training_loss
from ..step.optimizer import make_optimizer
from .validate_experts import install_expert_parallel
from .validate_hier import LEVEL_DIMS

SEED = 0
COUNTED = ("head", "ctx", "dp_shard", "dp_replicate")  # the comm counters' dims compared


def random_batch(cfg, n_docs: int = 6):
    """A global batch (train.global_batch sequences) of random tokens packed from n_docs documents
    per sequence (doc ids, positions)."""
    g = torch.Generator().manual_seed(SEED)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    doc_ids = torch.empty(b, s, dtype=torch.long)
    positions = torch.empty(b, s, dtype=torch.long)
    for row in range(b):
        cuts = sorted(torch.randperm(s - 1, generator=g)[: n_docs - 1].add(1).tolist())
        bounds = [0, *cuts, s]
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            doc_ids[row, lo:hi] = i
            positions[row, lo:hi] = torch.arange(hi - lo)
    return Batch(tokens, labels, positions, doc_ids if cfg.data.doc_mask else None)


def micro_batches(cfg, rt, batch) -> list:
    """This rank's parts of the grad_accum micro-batches of a global batch."""
    n = cfg.train.global_batch // cfg.train.grad_accum

    def rows(t, i):
        return None if t is None else t[i * n:(i + 1) * n]

    return [local_batch(rt, Batch(*(rows(t, i) for t in (batch.tokens, batch.labels, batch.positions,
                                                          batch.doc_ids))))
            for i in range(cfg.train.grad_accum)]


def setup_case(raw_cfg: dict):
    """(cfg, runtime, model, optimizer, the global batch, loss scale) of one case."""
    cfg = build_config(raw_cfg)
    mesh = comm.world_mesh()
    rt = Runtime.create(cfg, mesh.get_rank(), mesh.size(), "cpu")
    model = parallelize(build_model(cfg.model, device="cpu", seed=SEED), rt.dims, cfg, rt.mesh, "cpu")
    batch = random_batch(cfg)
    scale = grad_scale(rt.dims) / max(batch.valid_tokens, 1)
    return cfg, rt, model, make_optimizer(model, cfg), batch, scale


def train_step(cfg, rt, model, opt, batch, scale, zero_grad: bool = True) -> None:
    """One optimizer step: forward/backward of every micro-batch (gradients accumulate), AdamW. The
    micro-batches are cut anew each step, as the training loop's are (new tensors: nothing a
    previous step attached to them, such as a planned sequence layout, carries over). Each micro-batch backwards
    what training's does (step/loss.py training_loss): an MoE model's router terms included."""
    locals_ = micro_batches(cfg, rt, batch)
    for i, local in enumerate(locals_):
        set_gradient_sync(model, i == len(locals_) - 1 or cfg.memory.grad_sync == "micro_batch")  # as training
        training_loss(model, local, None, scale, len(locals_), grad_scale(rt.dims))[0].backward()
    opt.step()
    if zero_grad:
        opt.zero_grad(set_to_none=True)


def measured_model_state_bytes(model, opt) -> int:
    """Bytes of this rank's shards of the parameters, their gradients and the optimizer's state
    tensors (AdamW: exp_avg, exp_avg_sq), measured on the tensors."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # not the scalar step counter
                total += local(v)
    return total


def case_worker(raw_cfg: dict, steps: int, warmup: int):
    cfg, rt, model, opt, batch, scale = setup_case(raw_cfg)
    times, counters = [], {}
    for i in range(warmup + steps):
        comm.barrier()
        comm.reset_counters()
        t0 = time.perf_counter()
        train_step(cfg, rt, model, opt, batch, scale)
        counters = comm.counters()
        comm.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    # one more step, untimed (the dispatch mode slows every op): FSDP's own traffic, then the
    # model states before zero_grad drops the gradients
    with library_traffic() as fsdp:
        train_step(cfg, rt, model, opt, batch, scale, zero_grad=False)
    states = measured_model_state_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    counters = {d: v for d, v in counters.items() if d in COUNTED}
    out = {"rank": rt.rank, "times": times, "counters": counters, "fsdp": dict(fsdp), "model_states": states}
    del model, opt
    # activation bytes this rank holds after the forward, measured as `longctx bench memory` does,
    # on a model without FSDP (the accounting counts activations, not gathered parameters)
    bare = build_model(cfg.model, device="cpu", seed=SEED)
    use_sequence_parallel_attention(bare, rt.dims, rt.mesh)
    counts = install_expert_parallel(bare, cfg, rt)  # (at expert 1: nothing)
    apply_memory(bare, cfg.memory, "cpu")
    local = micro_batches(cfg, rt, batch)[0]
    comm.reset_counters()  # (the step's were read above): the hierarchy's levels in this forward and backward
    got = measure_activations(bare, local.tokens, local.positions, local.doc_ids, labels=local.labels,
                              extra_loss=lambda m: router_loss(m, cfg.train.grad_accum, grad_scale(rt.dims))[0])
    out["activations"] = {"device": got["total_device"], "host": got["total_host"]}
    out["expert_counts"] = counts
    out["expert_levels"] = {d: v for d, v in comm.counters().items() if d in LEVEL_DIMS}
    return out


def ranking_worker(raws: list[dict], rounds: int):
    """All cases in ONE job of the same processes, interleaved round by round, so that every case
    sees the same machine load (this CPU is shared); returns per-case step times of this rank."""
    jobs = [setup_case(raw) for raw in raws]  # (cfg, runtime, model, optimizer, global batch, scale)
    times = [[] for _ in jobs]
    counters = [None] * len(jobs)
    for r in range(rounds + 1):  # round 0 is the warm-up
        for i, job in enumerate(jobs):
            comm.barrier()
            comm.reset_counters()
            t0 = time.perf_counter()
            train_step(*job)
            comm.barrier()
            if r:
                times[i].append(time.perf_counter() - t0)
            counters[i] = {d: v for d, v in comm.counters().items() if d in COUNTED}
    return {"times": times, "counters": counters}
