"""`eager_under_compile(fn)`: fn as torch.compiler.disable makes it (run eagerly when a torch.compile'd
caller reaches it), without importing torch._dynamo when the module that defines fn is imported.

torch.compiler.disable imports torch._dynamo at once, a second or two of a process's start on a CPU,
which a command that builds no model (`longctx --help`, `plan`, `data build`, `report`) would pay for a
decorator at module level. Here fn is wrapped by torch's lazy form of the same decorator
(torch._disable_dynamo, which imports torch._dynamo on the wrapper's first call; torch.compiler.disable
where a build lacks it). A call of a wrapped function needs a model, and building one imports
torch._dynamo anyway (torch's nn.init under a device context), so the first call costs nothing more.

Why the wrapper is torch's and not one of ours: Dynamo keeps compiled entries, and counts recompiles
against its limit (8), per code object. The wrapper this module had (a `call` that chose between fn and
the disabled fn on torch.compiler.is_compiling()) was ONE code object for every wrapped function, and
Dynamo compiled it as a frame of its own wherever a compiled caller broke its graph at it, guarding on
each call's argument count, types, shapes and grad mode: a MoE model with a capacity under
train.compile compiled `call` 6 times in its first step, and wrapped functions called with 9 argument
counts hit the limit (a "recompile limit" warning of a function never meant to compile; the calls past
it ran through Dynamo's fallback). torch's wrapper lives in a file Dynamo skips: a compiled caller
breaks its graph at the call and nothing of the wrapper or of fn is compiled, guarded or counted
(tests/unit/test_leftovers119_compile.py). An eager call goes through the same wrapper (~0.6 us more
than a plain call, Dynamo's callback set off and back; the old one ~0.2 us): a MoE layer calls wrapped
functions per call and per piece of memory.block_chunk, never per token or expert (debug-moe with a
capacity in pieces of 64: 171 calls, ~0.1 ms of a 340 ms CPU step)."""

from __future__ import annotations

import torch

_lazy_disable = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def eager_under_compile(fn):
    return _lazy_disable(fn)
