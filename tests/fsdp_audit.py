"""Shared worker of the FSDP audit tests: a few optimizer steps of a tiny model through the training path
(planner/validate_ranks.py setup_case / train_step: build_model -> parallelize -> make_optimizer, micro-batches cut
as the loop cuts them), returning the global loss of every step, the final full weights, the number of
FSDP collectives per step and each rank's peak of parameter bytes it holds."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.config import build_config, to_dict

SCATTERS = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"}
GATHERS = {"_allgather_base_", "allgather_into_tensor_coalesced_"}
REDUCES = {"allreduce_", "allreduce_coalesced_"}


class CountCollectives(TorchDispatchMode):
    """Counts the c10d collectives that dispatch inside it (FSDP2's and comm.py's alike) and the dtype
    of each reduce-scatter's input."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()
        self.scatter_dtypes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in SCATTERS:
            self.calls["reduce_scatter"] += 1
            inp = args[1][0] if isinstance(args[1], (list, tuple)) else args[1]
            self.scatter_dtypes[str(inp.dtype)] += 1
        elif name in GATHERS:
            self.calls["all_gather"] += 1
        elif name in REDUCES:
            self.calls["all_reduce"] += 1
        return func(*args, **(kwargs or {}))


def config(preset="debug", layers=2, seq_len=64, global_batch=4, grad_accum=1, **kw) -> dict:
    """A raw config dict (to_dict) of a tiny case: `kw` keys `section__key` go to the sections."""
    raw = {"model": {"preset": preset, "layers": layers},
           "parallel": {"dp_replicate": 1, "dp_shard": -1, "head": 1, "ctx": 1},
           "memory": {}, "train": {"seq_len": seq_len, "global_batch": global_batch, "grad_accum": grad_accum,
                                   "device": "cpu", "dtype": "fp32", "seed": 1234, "eval_interval": 0,
                                   "lr": 3e-3, "warmup_steps": 0}, "data": {"doc_mask": True}}
    for key, value in kw.items():
        section, name = key.split("__")
        raw[section][name] = value
    return to_dict(build_config(raw))


def _local_loss(cfg, rt, model, batch):
    from longctx.planner.validate_ranks import micro_batches
    from longctx.step.loss import forward_loss_sum
    with torch.no_grad():
        return sum(float(forward_loss_sum(model, m, None)) for m in micro_batches(cfg, rt, batch))


def held_param_bytes(model) -> int:
    """Bytes of the gathered (unsharded, or hpz's post-forward node-sharded) parameter storages this rank
    holds now, over every FSDP unit of the model, each storage once."""
    seen = {}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else []):
            for attr in ("_unsharded_param", "_sharded_post_forward_param_data"):
                t = getattr(fp, attr, None)
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            for t in getattr(fp, "all_gather_outputs", []) or []:
                if t.untyped_storage().nbytes():
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def watch_peak(model) -> dict:
    """Samples held_param_bytes at every leaf module's forward and backward (pre and post): {"peak": ...,
    "after_forward": the bytes held as the root's forward returns (what waits for backward)}."""
    out = {"peak": 0, "after_forward": 0}

    def sample(*_):
        out["peak"] = max(out["peak"], held_param_bytes(model))

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_pre_hook(sample)
            m.register_forward_hook(sample)
            m.register_full_backward_pre_hook(sample)
            m.register_full_backward_hook(sample)

    def after(*_):
        out["after_forward"] = held_param_bytes(model)

    model.register_forward_hook(after)
    return out


def _full_state(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone().float()
    return out


def run(raw: dict, steps: int = 4, freeze: tuple = ()) -> dict:
    """Train `steps` steps; rank 0's result: losses (global mean per step, before each update), the final
    full weights, collectives per step (the last step's), reduce-scatter input dtypes, optimizer-state
    parameter names, the peak parameter bytes this rank holds (max over ranks) and its sharded bytes."""
    from longctx.planner.validate_ranks import setup_case, train_step
    cfg, rt, model, opt, batch, scale = setup_case(raw)
    if freeze:  # requires_grad False after the optimizer exists would differ: rebuild its groups
        from longctx.step.optimizer import make_optimizer
        for name, p in model.named_parameters():
            if any(name.startswith(f) for f in freeze):
                p.requires_grad_(False)
        opt = make_optimizer(model, cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads, norm = {}, []

    def first_grads(optimizer, *_):  # the step's reduced gradients and their global norm, before the first update
        if not grads:
            from longctx.step.gradients import clip_gradients
            norm.append(float(clip_gradients(model, 0.0)))  # (a device optimizer's: the model holds them)
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[name] = g.detach().clone().float()
    opt.register_step_pre_hook(first_grads)
    peak = watch_peak(model)
    losses, counts, dtypes = [], None, None
    for _ in range(steps):
        local = torch.tensor(_local_loss(cfg, rt, model, batch), dtype=torch.float64)
        if world > 1:
            dist.all_reduce(local)
        losses.append(float(local) / batch.valid_tokens)
        with CountCollectives() as seen:
            train_step(cfg, rt, model, opt, batch, scale)
        counts, dtypes = dict(seen.calls), dict(seen.scatter_dtypes)
    getattr(opt, "finish_update", lambda: None)()  # (memory.model_states = host_optimizer steps on a thread)
    state = _full_state(model)
    names = {id(p): n for n, p in model.named_parameters()}
    with_state = sorted(names[id(p)] for p in opt.state if opt.state[p])
    sharded = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                  for p in model.parameters())
    whole = sum(t.numel() * 4 for t in state.values())
    return {"losses": losses, "state": state, "grads": grads, "norm": norm[0] if norm else None,
            "peak_param_bytes": peak["peak"],
            "after_forward_bytes": peak["after_forward"], "sharded_bytes": sharded, "whole_bytes": whole,
            "collectives": counts, "scatter_dtypes": dtypes, "optimizer_params": with_state, "rank": rt.rank}


def run_cases(cases: list) -> dict:
    """Every case (name, raw config, steps, frozen prefixes) in turn on this job's ranks: {name: result},
    the weights and gradients from rank 0 only, the bytes as per-rank lists (gathered by the caller)."""
    out = {}
    for name, raw, steps, freeze in cases:
        got = run(raw, steps, tuple(freeze))
        if got["rank"] != 0:
            got = {k: got[k] for k in ("peak_param_bytes", "after_forward_bytes", "sharded_bytes", "collectives",
                                       "optimizer_params", "rank")}
        out[name] = got
        if dist.is_initialized():
            dist.barrier()
    return out
