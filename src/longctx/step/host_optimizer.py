"""memory.model_states = host_optimizer (ZeRO-Offload): the weights stay on the device; their fp32
master copy, the gradients and AdamW's two moments live in host memory, and the AdamW step runs on
the host.

- **Gradients leave the device as autograd finishes them.** A post-accumulate hook on each weight
  copies its gradient into the weight's host buffer (pinned, on a side stream, so the copy runs
  beside the rest of the backward) and drops the device gradient: the device never holds more
  than the gradients of the layer whose backward just ended. Under FSDP the shards' gradients are
  assigned by FSDP after its reduce-scatter, where no hook sees them; step() takes them then.
  With train.grad_accum > 1 a later micro-batch's gradient is added to the host buffer (that add
  waits for its copy: one wait per weight per micro-batch after the first).
- **The step overlaps the next forward, not the backward.** Clipping needs the global gradient
  norm and the step guard (train.on_nonfinite) the global loss, both known only when the whole
  backward is done, so no unit's AdamW step can start earlier without changing the result
  (ZeRO-Offload's own overlap, its delayed parameter update, applies each update one step late).
  What can overlap exactly is the next forward: a worker thread steps the units in the order the
  forward uses them (the root's embeddings, norm and head first, then block by block), each
  followed by the copy of its weights to the device, and each block's forward waits only for its
  own unit (a forward pre-hook). Under FSDP the shards are gathered before any hook of ours could
  run, so there the whole update is waited for before the forward starts. The step is torch's
  fused CPU AdamW over the host masters (benchmarks/cpu_adam.py: as fast per parameter as
  DeepSpeed's CPU Adam on this machine); each tensor's update is independent of the others', so
  stepping unit by unit gives the same numbers as one call. `host_step_s` and `host_exposed_s`
  say how long the last update took and how long forwards waited for it.
- **Checkpoints do not see the tier.** The optimizer's parameters are the model's own (so DCP maps
  its state to the same names as under `device`), its state (exp_avg, exp_avg_sq, step) is the
  host tensors (DTensors over host shards under FSDP, as FSDP2's CPU offload keeps them), and
  loading keeps them in host memory where torch's loader would move them to the weights' device,
  and keeps the groups' hyper-parameters (the run's config's, not the saver's). The masters are not
  state: they are the weights, copied from the model again after a load.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..ops import pinned

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (a local tensor) as the state of `param`: a DTensor over the same mesh and placements
    when `param` is one (what DCP reshards), else itself."""
    if isinstance(param, DTensor):
        return DTensor.from_local(host, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return host


class _Updates:
    """One step's update, unit by unit in forward order, on a worker thread; `wait(k)` returns once
    unit k's weights are updated (on CUDA: once the forward's stream will see them)."""

    def __init__(self, units: int):
        self.ready = [threading.Event() for _ in range(units)]
        for event in self.ready:
            event.set()
        self.uploaded: list[torch.cuda.Event | None] = [None] * units
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="host-adamw")
        self.in_flight = None
        self.error: BaseException | None = None
        self.step_s = self.exposed_s = 0.0

    def start(self, update_unit) -> None:
        """Run update_unit(k) for every unit k in order (it returns the CUDA event of its upload, or None)."""
        self.finish()
        for event in self.ready:
            event.clear()
        self.exposed_s = 0.0
        self.in_flight = self.worker.submit(self._run, update_unit)

    def _run(self, update_unit) -> None:
        t0 = time.perf_counter()
        last = len(self.ready) - 1
        try:
            for k in range(last):
                self.uploaded[k] = update_unit(k)
                self.ready[k].set()
            self.uploaded[last] = update_unit(last)
        except BaseException as e:  # raised where the forward waits
            self.error = e
        finally:
            # the time is written before the last unit reads as ready: a forward that has waited for every
            # unit then reads this update's time, not the one before it
            self.step_s = time.perf_counter() - t0
            for event in self.ready:
                event.set()

    def wait(self, k: int) -> None:
        if not self.ready[k].is_set():
            t0 = time.perf_counter()
            self.ready[k].wait()
            self.exposed_s += time.perf_counter() - t0
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the host AdamW step failed") from error
        if self.uploaded[k] is not None:
            torch.cuda.current_stream().wait_event(self.uploaded[k])
            self.uploaded[k] = None

    def busy(self) -> bool:
        """Whether an update is still running on the worker."""
        return self.in_flight is not None and not self.in_flight.done()

    def finish(self) -> None:
        """Wait for the whole update (before anything reads the weights or the optimizer state)."""
        for k in range(len(self.ready)):
            self.wait(k)
        self.in_flight = None


def forward_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The units the update goes by, in the order the forward uses them: (the module whose forward
    waits, its parameters). At world 1 the root (the model: embeddings, final norm, LM head) and then
    each block; under FSDP (sharded parameters) one unit, waited for at the model's forward."""
    if any(isinstance(p, DTensor) for p in model.parameters()) or not hasattr(model, "layers"):
        return [(model, list(model.parameters()))]
    in_blocks = {id(p) for block in model.layers for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [(model, root), *((block, list(block.parameters())) for block in model.layers)]


def _owners(root: nn.Module, params: list[nn.Parameter]) -> list[nn.Module]:
    """The submodules of `root` that hold any of `params` themselves (embeddings, final norm, LM head)."""
    wanted = {id(p) for p in params}
    return [m for m in root.modules() if m is not root and any(id(p) in wanted for p in m.parameters(recurse=False))]


class HostOptimizer(torch.optim.AdamW):
    """AdamW whose state and step live in host memory (see the module's docstring). Built on the
    model's parameters, with the same groups and hyper-parameters as the device's AdamW, and the
    model's forward units (forward_units); the trainer takes its gradient norm from
    `clip_gradients` here, the model's parameters holding none after backward."""

    def __init__(self, groups: list[dict], units: list[tuple[nn.Module, list[nn.Parameter]]], **hyper):
        super().__init__(groups, **hyper, fused=True)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.device = self.params[0].device
        cuda = self.device.type == "cuda"
        # pinned on CUDA, carved out of power-of-two slabs (ops/pinned.py: torch's host allocator would lock
        # each tensor's size rounded up to a power of two, 1.1x to 1.3x of these buffers)
        shapes = [(_local(p).shape, torch.float32) for p in self.params]
        host = pinned.carve(shapes * 2, pinned.pins(self.device))
        self.masters, self._grad_buffers = host[:len(shapes)], host[len(shapes):]
        self._pending: list[torch.cuda.Event | None] = [None] * len(self.params)
        self._copier = torch.cuda.Stream(self.device) if cuda else None
        self._uploader = torch.cuda.Stream(self.device) if cuda else None
        self._refresh = True  # masters are copied from the weights before the next step
        index = {id(p): i for i, p in enumerate(self.params)}
        self._units = [[index[id(p)] for p in params if id(p) in index] for _, params in units]
        if sorted(i for unit in self._units for i in unit) != list(range(len(self.params))):
            raise ValueError("the forward units must hold every optimized parameter exactly once")
        self._unit_of = {i: k for k, unit in enumerate(self._units) for i in unit}
        # the model's parameter order (units[0][0] is the model): the norm sums the tensors' norms in the
        # order the device's clip_gradients does, to the bit (the groups' order was an ulp off)
        position = {id(p): n for n, p in enumerate(units[0][0].parameters())}
        self._model_order = sorted(range(len(self.params)), key=lambda i: position.get(id(self.params[i]), i))
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self._inner = [self._unit_optimizer(unit, group_of) for unit in self._units]
        self._updates = _Updates(len(self._units))
        self._last_upload: list[torch.cuda.Event | None] = [None] * len(self._units)
        for k, (module, _) in enumerate(units):
            module.register_forward_pre_hook(lambda *_, k=k: self._updates.wait(k), prepend=True)
        if len(units) > 1:  # also where the root's own weights are used: a direct model.hidden_states or
            # model.logits call (generation in the loop) runs no model.forward, and read them mid-update
            for sub in _owners(*units[0]):
                sub.register_forward_pre_hook(lambda *_: self._updates.wait(0), prepend=True)
        units[0][0].register_state_dict_pre_hook(lambda *_: self._updates.finish())
        for i, p in enumerate(self.params):
            if not isinstance(p, DTensor):  # FSDP's shards are given their gradients where no hook sees
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._take(i))

    def _unit_optimizer(self, unit: list[int], group_of: list[int]) -> tuple[torch.optim.AdamW | None, list[int]]:
        """The fused CPU AdamW over one unit's masters, with the outer groups it has members in (None:
        a unit with nothing to optimize, e.g. a frozen block)."""
        if not unit:
            return None, []
        members = {g: [self.masters[i] for i in unit if group_of[i] == g] for g in range(len(self.param_groups))}
        used = [g for g, ms in members.items() if ms]
        inner = torch.optim.AdamW([{**{k: v for k, v in self.param_groups[g].items() if k != "params"},
                                    "params": members[g]} for g in used], fused=True)
        return inner, used

    def finish_update(self) -> None:
        """Wait for the update in flight: the weights and the state are this step's afterwards."""
        self._updates.finish()

    @property
    def host_step_s(self) -> float:
        """Seconds the last update took on the host (AdamW and the copies to the device)."""
        return self._updates.step_s

    @property
    def host_exposed_s(self) -> float:
        """Seconds forwards waited for the last update."""
        return self._updates.exposed_s

    # --- gradients --------------------------------------------------------------------------------

    def _take(self, i: int) -> None:
        """Move parameter i's gradient into its host buffer (added to what earlier micro-batches
        left there) and free it on the device."""
        p, master = self.params[i], self.masters[i]
        grad = _local(p.grad)
        if master.grad is None:
            buf = self._grad_buffers[i]
            if self._copier is None:
                buf.copy_(grad)
            else:  # on the side stream, after the kernels that made the gradient
                self._copier.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copier):
                    buf.copy_(grad, non_blocking=True)
                    grad.record_stream(self._copier)
                    self._pending[i] = torch.cuda.Event()
                    self._pending[i].record()
            master.grad = buf
        else:
            self._wait(i)
            master.grad.add_(grad.to("cpu"))
        p.grad = None

    def _wait(self, i: int) -> None:
        if self._pending[i] is not None:
            self._pending[i].synchronize()
            self._pending[i] = None

    def host_gradients(self) -> list[torch.Tensor]:
        """Every gradient of this step, in host memory: those FSDP assigned (or hooks did not take)
        are moved now; the copies in flight are waited for."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._take(i)
        for i in range(len(self.params)):
            self._wait(i)
        return [m.grad for m in self.masters if m.grad is not None]

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (on the device, as step/gradients.py's) and clipping to
        max_norm (0 = none), computed on the host gradients. Under FSDP each mesh's squared local
        norms are summed over the ranks that shard it, as DTensor does for the device's."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p, m in zip(self.params, self.masters):
            if p.grad is not None or m.grad is not None:
                key = (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else (None, ())
                groups.setdefault(key, []).append(m)
        self.host_gradients()
        if len(groups) == 1 and None in next(iter(groups)):  # one process, no mesh: the norm itself
            grads = [self.masters[i].grad for i in self._model_order if self.masters[i].grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            return self._clip(max_norm, norm)
        squares = []
        for (mesh, placements), members in groups.items():
            local = torch.nn.utils.get_total_norm([m.grad for m in members], norm_type=2.0, foreach=True)
            square = local.square().to(self.device)
            if mesh is not None:  # summed over the mesh dimensions the gradients are sharded on
                partial = [Partial() if isinstance(pl, Shard) else Replicate() for pl in placements]
                square = DTensor.from_local(square, mesh, partial, run_check=False).full_tensor()
            squares.append(square)
        return self._clip(max_norm, torch.stack(squares).sum().sqrt())

    def _clip(self, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
        if max_norm > 0:
            with_grads = [m for m in self.masters if m.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm.to("cpu"), foreach=True)
        return norm.to(self.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: the device's now, the host's too unless an update is using them (its
        worker drops each unit's once stepped)."""
        for p in self.params:
            p.grad = None
        if not self._updates.busy():
            for m in self.masters:
                m.grad = None

    # --- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Start the update (see the module's docstring): AdamW on the host masters, skipped by the
        fused kernel itself when `found_inf` is set (as step.guarded_step sets it), each unit's
        weights copied to the device after its step. Returns at once; forwards wait per unit."""
        if closure is not None:
            raise ValueError("HostOptimizer.step takes no closure")
        self._updates.finish()
        if self._refresh:
            for p, m in zip(self.params, self.masters):
                m.copy_(_local(p).detach())
            self._refresh = False
        self.host_gradients()
        for inner, used in self._inner:
            for g, group in zip(used, [] if inner is None else inner.param_groups):
                group.update({k: v for k, v in self.param_groups[g].items() if k not in ("params", "fused", "foreach")})
        found_inf = getattr(self, "found_inf", None)
        found_inf = None if found_inf is None else found_inf.to("cpu")
        if self._uploader is not None:  # nothing on the device still reads the weights about to change
            self._uploader.wait_stream(torch.cuda.current_stream(self.device))
        self._updates.start(lambda k: self._update_unit(k, found_inf))

    @torch.no_grad()  # (grad mode is per thread: the worker's is its own)
    def _update_unit(self, k: int, found_inf: torch.Tensor | None) -> torch.cuda.Event | None:
        """Unit k's AdamW step on the host, then its weights to the device (on the worker thread)."""
        inner, _ = self._inner[k]
        if inner is None:  # (a unit with nothing to optimize)
            return None
        if self._last_upload[k] is not None:  # (done long ago in practice: the forward waited for it)
            self._last_upload[k].synchronize()
        inner.found_inf = found_inf
        try:
            inner.step()
        finally:
            inner.found_inf = None
        for i in self._units[k]:
            self.masters[i].grad = None
            self._publish(i)
        if self._uploader is None:
            for i in self._units[k]:
                _local(self.params[i]).copy_(self.masters[i])
            return None
        with torch.cuda.stream(self._uploader):
            for i in self._units[k]:
                _local(self.params[i]).copy_(self.masters[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._last_upload[k] = event  # the masters are not written again before this copy is done
        return event

    def _inner_state(self, i: int) -> dict:
        return self._inner[self._unit_of[i]][0].state

    def _publish(self, i: int) -> None:
        """Parameter i's host state (made by the inner AdamW's first step) as this optimizer's state of
        the model parameter: what DCP saves, and what tells it the state exists."""
        p, m = self.params[i], self.masters[i]
        inner = self._inner_state(i).get(m)
        if inner and not self.state.get(p):
            self.state[p] = {"step": inner["step"], **{k: _like(p, inner[k]) for k in _MOMENTS}}

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Torch's, once the update in flight is done; the state is the host tensors, per model
        parameter (DTensors over the host shards under FSDP)."""
        self._updates.finish()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Torch's loading of the state, except that it stays in host memory (torch's would move it to
        each weight's device), and that the groups' hyper-parameters stay this optimizer's: those of
        the run's config, which a resume may change (torch's would take the saved ones; lr is the
        schedule's, set every step). The masters are taken from the weights again before the next
        step (DCP loads the optimizer before the model)."""
        self._updates.finish()
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this model's")
        ids = {pid: p for sg, g in zip(saved_groups, self.param_groups) for pid, p in zip(sg["params"], g["params"])}
        index = {id(p): i for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):  # (torch's load replaces the whole state: none kept of a weight it lacks)
            self._inner_state(i).pop(self.masters[i], None)
            self.state.pop(p, None)
        for pid, saved in state_dict["state"].items():
            p = ids[pid]
            i = index[id(p)]
            # in ordinary host memory, where a fresh run's fused AdamW makes its moments (zeros_like of the
            # masters is not pinned): the host's CPU step reads them, the device never does
            host = {k: _local(v).detach().to("cpu", torch.float32, copy=True) for k, v in saved.items()}
            self._inner_state(i)[self.masters[i]] = host
            self.state[p] = {"step": host["step"], **{k: _like(p, host[k]) for k in _MOMENTS}}
        self._refresh = True
