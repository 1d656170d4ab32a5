"""Find where host memory meets the device in a CPU run (a test tool, like host_sync.py: `from host_origin
import ...`, tests/ being on pytest's path).

Under memory.model_states = host the sharded fp32 weights, their gradients and the AdamW moments live in host
memory (FSDP2's CPU offload) while activations live on the accelerator. On a GPU an operation that takes a
tensor from each fails ("Expected all tensors to be on the same device"), and a copy between them costs a
transfer (a device-to-host one waits for the device). On a CPU run host and device are one memory, so none of
this shows: `HostOrigins` tags every tensor with where it would live on a GPU and reports, per operation, the
tensors of both kinds it mixes and the copies between them.

How a CPU run is made to tell the two apart: the "accelerator" is `ACCEL`, torch.device("cpu", 0), a device
that allocates in the same memory but compares unequal to the host's torch.device("cpu") (no index). The
run's device (Runtime.device, join_job's) and FSDP2's are patched to ACCEL (`accelerator_device`), so a
tensor made with `device=self.device` or FSDP's all-gather buffers are device tensors, and one made with no
device or device="cpu" (FSDP's CPU offload, the optimizer's states of host weights) is a host tensor. A
tagged tensor's `.device` reads back as where it lives (ACCEL or cpu), so `x.to(y.device)` moves x as it would
on a GPU. Tags spread through operations: the output of an operation is where its inputs are; a factory
takes its device argument; copies (`.to`, `copy_`) take their destination.

What a GPU allows, and this does not flag as a mix: a 0-d host tensor as an operand of an elementwise
operation on device tensors (CUDA reads it as a scalar: recorded as "scalar"). Everything else that mixes
is "mix". Copies are "h2d" / "d2h", or "h2d_sync" / "d2h_sync" when not non_blocking: on CUDA such a copy waits
for the device's queue to drain (torch's memcpy_and_sync), whichever way it goes.

What it cannot see: code behind `device.type == "cuda"` (ACCEL's type is cpu), other threads (modes are per
thread: host_optimizer's update worker), which backend carries a collective (NCCL takes no CPU tensor: the host
tier's process group adds gloo, job/launch.py backend_for), pinned memory and streams. A tensor C++ makes on
a CPU tensor's own device (autograd's) is left untagged and takes the tag of what it meets.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from collections import Counter

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

HOST, DEVICE = "host", "device"
ACCEL = torch.device("cpu", 0)  # stands in for the accelerator (see the module docstring)
aten = torch.ops.aten

# operations that copy between memories by design (the destination decides where the result is)
COPIES = {aten.copy_.default, aten._to_copy.default, aten._foreach_copy_.default, aten.copy.default}
# operations that alias their input (no computation: the output is where the input is)
ALIASES = {aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten.view.default}
# CUDA accepts a 0-d CPU tensor as a scalar operand of a TensorIterator (elementwise) operation; these take
# lists or gather their inputs and do not (torch.stack of a CPU norm and a CUDA loss failed on the H200)
STRICT = {"stack", "cat", "index", "index_put", "index_put_", "_index_put_impl_", "mm", "bmm", "matmul", "addmm",
          "where", "index_select", "scatter", "scatter_add", "scatter_add_", "gather", "masked_fill_"}


# Python's tensor factories: given no device, a tensor in host memory (a GPU run's default device is the CPU)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor}


def _where_from(t: torch.device | str | None) -> str | None:
    if t is None:
        return None
    t = torch.device(t)
    return DEVICE if (t.type != "cpu" or t.index is not None) else HOST


def _our_frames(depth: int) -> str:
    """The innermost longctx frames that issued the operation (file:line function), innermost first."""
    out = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/longctx/" in frame.filename:
            out.append(f"{frame.filename.rsplit('/longctx/', 1)[1]}:{frame.lineno} {frame.name}")
            if len(out) == depth:
                break
    return " < ".join(out) or "outside longctx"


class HostOrigins:
    """The tags and what was seen: `events` (kind, operation, where: the innermost `depth` longctx frames) in
    order, `kinds(kind)` counts them; `details`, each mix's operands."""

    def __init__(self, depth: int = 3):
        self.depth = depth  # longctx frames kept per event
        self.tags = WeakTensorKeyDictionary()
        self.events: list[tuple[str, str, str]] = []
        self.details: list = []  # each mix's operands: (operation, [(shape, dtype, where)])

    def tag(self, t, where: str | None) -> None:
        if where is None or not isinstance(t, torch.Tensor):
            return
        self.tags[t] = where
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            self.tags[local] = where

    def of(self, t) -> str | None:
        where = self.tags.get(t)
        if where is None and isinstance(getattr(t, "_local_tensor", None), torch.Tensor):
            where = self.tags.get(t._local_tensor)
        return where

    def saw(self, kind: str, op: str) -> None:
        self.events.append((kind, op, _our_frames(self.depth)))

    def kinds(self, kind: str) -> Counter:
        return Counter((op, where) for k, op, where in self.events if k == kind)

    def tag_states(self, model: torch.nn.Module, optimizer=None, tier: str = "host") -> None:
        """Seed the tags from what memory.model_states `tier` keeps where: under host the parameters (with their
        gradients and the optimizer's states) in host memory, else on the device; buffers on the device.
        (host_optimizer's own host tensors are made in host memory, and tagged so, as it builds them.)"""
        params = HOST if tier == "host" else DEVICE
        for p in model.parameters():
            self.tag(p, params)
            if p.grad is not None:
                self.tag(p.grad, params)
        for unit in model.modules():  # FSDP2's flat views of the shards, what its all-gathers copy in
            state = getattr(unit, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state is not None else None
            for fsdp_param in [] if group is None else group.fsdp_params:
                if isinstance(group.offload_policy, CPUOffloadPolicy):
                    self.tag(fsdp_param._sharded_param_data, HOST)
        for b in model.buffers():
            self.tag(b, DEVICE)
        for state in ({} if optimizer is None or tier != "host" else optimizer.state).values():
            for v in state.values():
                self.tag(v, HOST)


class _Functions(TorchFunctionMode):
    """The Python-level half: `.device` reads back as the tag says, and `.to` / `.cpu` move a tagged tensor
    (on a CPU run `.to("cpu")` of a device tensor would be the tensor itself)."""

    def __init__(self, origins: HostOrigins):
        super().__init__()
        self.o = origins

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device and args:  # the getter
            return ACCEL if self.o.of(args[0]) == DEVICE else func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu) and args:
            return self._move(func, args, kwargs)
        # (a device asked for in Python: cpu is the host's. Not Module.to_empty's empty_like: torch.utils.swap_tensors
        # refuses a tensor with a weak reference, and tag_states tags the parameters)
        if func in FACTORIES or kwargs.get("device") is not None and func is not torch.empty_like:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and self.o.of(out) is None:  # (no device: the default, the host's)
                self.o.tag(out, _where_from(kwargs.get("device")) or HOST)
            return out
        if func is torch.Tensor.backward:
            with self:  # (a mode is off while it handles a call: the backward, FSDP's hooks in it, would run untagged)
                return _backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _move(self, func, args, kwargs):
        src = args[0]
        target = HOST if func is torch.Tensor.cpu else _to_target(args[1:], kwargs, self.o)
        out = func(*args, **kwargs)
        before = self.o.of(src)
        if target is None or target == before or before is None and target == DEVICE:
            return out  # (a dtype change; or the dispatch half saw the copy)
        if out is src:  # (the same memory on a CPU run: a copy on a GPU)
            out = out.clone()
        if before == DEVICE:  # (the dispatch half records copies to ACCEL; to "cpu" it cannot tell from C++'s)
            self.o.saw("d2h" if _non_blocking(args[1:], kwargs) else "d2h_sync", "Tensor.to")
        self.o.tag(out, target)
        return out


def _non_blocking(rest, kwargs) -> bool:
    """Whether a copy's arguments ask for non_blocking (`.to(device, non_blocking=True)`, `copy_(src, True)`)."""
    return bool(kwargs.get("non_blocking")) or any(a is True for a in rest)


def _backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """Tensor.backward's body (torch.autograd.backward, which asks no mode again)."""
    return torch.autograd.backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)


def _to_target(rest, kwargs, origins) -> str | None:
    """Where Tensor.to(*rest, **kwargs) puts its result (None: where it is)."""
    if "device" in kwargs:
        return _where_from(kwargs["device"])
    for a in rest:
        if isinstance(a, torch.Tensor):
            return origins.of(a)
        if isinstance(a, (str, torch.device)):
            return _where_from(a)
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, origins: HostOrigins):
        super().__init__()
        self.o = origins

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        wheres = [self.o.of(t) for t in tensors]
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func in COPIES:
            self._copy(func, args, kwargs, out, wheres)
        elif func in ALIASES:
            pytree.tree_map_only(torch.Tensor, lambda t: self.o.tag(t, wheres[0] if wheres else None), out)
        else:
            where = self._mixed(name, tensors, wheres)
            if where is None and not tensors and _where_from(kwargs.get("device")) == DEVICE:
                where = DEVICE  # a factory given the accelerator; one given "cpu" is the host's only when Python
                # asked for it (_Functions tags it): C++ (autograd's zeros) passes a CPU tensor's device too
            mutated = name.endswith("_") or "out" in kwargs
            if not mutated:
                pytree.tree_map_only(torch.Tensor, lambda t: self.o.tag(t, where), out)
        return out

    def _mixed(self, name: str, tensors, wheres) -> str | None:
        host = [t for t, w in zip(tensors, wheres) if w == HOST]
        device = [t for t, w in zip(tensors, wheres) if w == DEVICE]
        if host and device:
            scalar = all(t.dim() == 0 for t in host) and not name.startswith("_foreach") and name not in STRICT
            self.o.saw("scalar" if scalar else "mix", name)
            self.o.details.append((name, [(tuple(t.shape), str(t.dtype)[6:], w) for t, w in zip(tensors, wheres)]))
            return DEVICE
        return HOST if host else DEVICE if device else None

    def _copy(self, func, args, kwargs, out, wheres) -> None:
        if func is aten._to_copy.default:  # (to "cpu": C++ passes a CPU tensor's own device; Python's `.to("cpu")`
            src = wheres[0] if wheres else None  # is _Functions' to tag)
            dst = DEVICE if _where_from(kwargs.get("device")) == DEVICE else src
            self.o.tag(out, dst)
        elif func is aten._foreach_copy_.default:
            src = next((w for w in wheres[len(args[0]):] if w), None)
            dst = next((w for w in wheres[:len(args[0])] if w), None)
        else:  # copy_(dst, src)
            dst, src = (wheres + [None, None])[:2]
            if func is aten.copy.default:
                self.o.tag(out, dst)
        if src and dst and src != dst:
            blocking = "" if _non_blocking(args[2:] if func is aten.copy_.default else (), kwargs) else "_sync"
            self.o.saw(("d2h" if dst == HOST else "h2d") + blocking, func.overloadpacket.__name__)


@contextlib.contextmanager
def tracking(origins: HostOrigins):
    """Tag and watch every tensor operation inside the block. The autograd engine runs a backward without
    the caller's torch-function modes: the Python code it calls (custom Functions' backward, FSDP2's hooks
    and its final callback, which copies the gradients to the host) is wrapped to run under it again."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    functions = _Functions(origins)

    def under_mode(fn):
        def wrapped(*a, **k):
            with functions:
                return fn(*a, **k)
        return wrapped

    targets = [(torch.autograd.function.BackwardCFunction, "apply"),
               (_fsdp_state.FSDPState, "_root_post_backward_final_callback"),
               (_fsdp_param_group.FSDPParamGroup, "pre_backward"), (_fsdp_param_group.FSDPParamGroup, "post_backward")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets]
    unsharded = _fsdp_param.FSDPParam.__dict__["init_unsharded_param"]

    def init_unsharded_param(fsdp_param):  # FSDP2's unsharded parameter: a new nn.Parameter over its all-gather's
        unsharded(fsdp_param)  # output, on the device (untagged, its .device would read as the host's)
        origins.tag(fsdp_param._unsharded_param, DEVICE)

    saved.append((_fsdp_param.FSDPParam, "init_unsharded_param", unsharded))
    try:
        for owner, name, fn in saved[:-1]:
            setattr(owner, name, under_mode(fn))
        _fsdp_param.FSDPParam.init_unsharded_param = init_unsharded_param
        with functions, _Dispatch(origins):
            yield origins
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def accelerator_device(origins: HostOrigins | None = None, bf16_gathers: bool = False):
    """The run's device and FSDP2's are ACCEL (see the module docstring) while the block runs; a model (a frozen
    target too) materialised under memory.model_states = host has its parameters tagged host in `origins`.
    `bf16_gathers`: FSDP gathers in bf16 as on a GPU with bf16 (parallel/fsdp/shard.py mixed_precision), so each
    MoE router is a unit of its own gathered in fp32, as there."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    from longctx.job import join, runtime
    from longctx.parallel.fsdp import shard
    from longctx.train import glide, model

    parallelize = importlib.import_module("longctx.parallel.parallelize")  # (the module, not its function)
    real_mesh_device = _fsdp_init._get_device_from_mesh
    real_create = runtime.Runtime.create.__func__
    real_resolve = join.resolve_device

    def mesh_device(mesh):
        return ACCEL if mesh.device_type == "cpu" else real_mesh_device(mesh)

    def create(cls, *a, **k):
        rt = real_create(cls, *a, **k)
        if rt.device.type == "cpu":
            rt.device = ACCEL
        return rt

    def materialize(module, cfg, device):  # (the accelerator's branch: parameters in host memory under host)
        if cfg.memory.model_states == "host" and device == ACCEL:
            shard.materialize_apart(module, device)
            if origins is not None:
                origins.tag_states(module)
            return None
        return real_materialize(module, cfg, device)

    real_materialize = shard.materialize

    def resolve(name):
        d = real_resolve(name)
        return ACCEL if d.type == "cpu" else d

    def precision(device_type, dtype):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    patches = [(_fsdp_init, "_get_device_from_mesh", mesh_device), (_fully_shard, "_get_device_from_mesh", mesh_device),
               (runtime.Runtime, "create", classmethod(create)), (join, "resolve_device", resolve),
               *[(m, "materialize", materialize) for m in (shard, model, glide)],
               *([(m, "mixed_precision", precision) for m in (shard, parallelize)] if bf16_gathers else [])]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, v in patches:
            setattr(m, n, v)
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)
