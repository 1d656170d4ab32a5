"""`eager_under_compile(fn)`: fn as torch.compiler.disable makes it (run eagerly when a torch.compile'd
caller reaches it), without importing torch._dynamo when the module that defines fn is imported.

torch.compiler.disable imports torch._dynamo at once, a second or two of a process's start on a CPU,
which a command that builds no model (`longctx --help`, `plan`, `data build`, `report`) would pay for a
decorator at module level. (One that builds a model pays it anyway: torch's own nn.init, under a device
context, imports it.) Here an eager call is a plain call of fn; a call under compilation goes
through torch's lazy form of the same decorator (torch._disable_dynamo, which Dynamo skips and which
imports torch._dynamo on its first call; torch.compiler.disable where a build lacks it)."""

from __future__ import annotations

import functools

import torch

_lazy_disable = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def eager_under_compile(fn):
    disabled = _lazy_disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
