"""The compiled copies of the static decode functions (models/static_decode.py `static_hidden_states`,
generate/blocks.py `next_token`): a torch.compile of a copy of a function's code per setting, bucket and variant,
kept in one bounded cache per process, each decoding eagerly, said once, where dynamo refuses it another graph.

Why copies: dynamo keeps graphs, and counts recompiles against its limit (8), per code object. A copy of the code
per bucket keeps each bucket's token count static (a change of it would otherwise make it a dynamic dimension),
and a copy per variant (the device type, the model's graph key `static_decode.model_key`, the cache's dtype; the
sampling branches) keeps what changes a graph on purpose off the limit: with one copy per bucket, 9 sampling
settings in one process (greedy; top-k, top-p, min-p each on or off) compiled `next_token_1` 8 times and the 9th
generation failed with FailOnRecompileLimitHit.

Why bounded (COMPILED_COPIES): a copy keeps its graphs (dynamo's cache entries: the traced graph, its guards, the
compiled callable) for as long as it lives, and the cache was unbounded (functools.cache): a process generating
with 40 architectures in turn kept 43 copies and every graph of each. Past COMPILED_COPIES the least recently
called copy is dropped, and its graphs are freed once nothing else holds it (`CompiledCopy`: dynamo keeps them on
the code object, out of the garbage collector's reach). A later call of its key compiles a new copy: the cost of a
first generation, never another token. One model's copies are a few (greedy decoding: one `next_token`; a bucket
per speculative verification size, a `next_token` per sampling branch: 7 + 18 at most), so 64 keeps the working
set of several models. (Inductor's generated modules stay in its own process-wide code cache, torch's.)

Why an eager fallback: the copies are compiled with fullgraph, and with fullgraph dynamo's compile past the
recompile limit raised FailOnRecompileLimitHit out of the generation, half-way. Now the copy warns once
(CompiledDecodeFallback: the function, its variant, the limit and what to do) and from then on runs in dynamo's
run-only mode: a call its graphs cover runs them, any other runs the function eagerly, compiling nothing more.
The function run eagerly is the graph's own code: its tokens are the eager path's.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
import zlib
from collections import OrderedDict

import torch

from .recompiles import recompile_limit

COMPILED_COPIES = 64  # compiled copies a process keeps, the least recently called dropped first


class CompiledDecodeFallback(RuntimeWarning):
    """A compiled decode copy reached dynamo's recompile limit and decodes eagerly where its graphs do not serve."""


def _limit_hit_error() -> type[BaseException]:
    """dynamo's error for a fullgraph compile past the recompile limit (an exception no call raises where this
    torch has none)."""
    return getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", type("NeverRaised", (Exception,), {}))


class CompiledCopy:
    """One compiled copy: `__call__` runs it compiled, or past the recompile limit in run-only mode."""

    def __init__(self, function, padded: int, variant: tuple, compile_kwargs: dict):
        code = function.__code__
        name = f"{code.co_name}_{padded}"
        self.fn = types.FunctionType(_renamed(code, name), function.__globals__, name)
        self.compiled = torch.compile(self.fn, fullgraph=True, **compile_kwargs)
        self.variant = variant
        # dynamo keeps a code object's graphs in the code object itself (its cache entries), and dynamo's own
        # caches keep the code object (a few KB): a dropped copy's graphs stayed with it. They are cleared once
        # nothing holds the copy: not the bounded cache, not a running call, not a CUDA graph (generate/blocks.py
        # BlockGraph holds the copy it replays)
        reset = getattr(torch._dynamo, "reset_code", None)
        if reset is not None:
            weakref.finalize(self, reset, self.fn.__code__)
        self.eager_fallback = False  # set at the recompile limit: the copy compiles nothing more
        self.run_only = None  # from then on: dynamo's run-only mode over the copy (its graphs, else eager)

    def __call__(self, *args):
        if not self.eager_fallback:
            try:
                return self.compiled(*args)
            except _limit_hit_error() as e:
                # raised by dynamo before the frame ran (nothing of the call happened yet): run it below
                self.eager_fallback = True
                warnings.warn(_fallback_message(self.fn.__name__, self.variant, e), CompiledDecodeFallback,
                              stacklevel=2)
        if self.run_only is None:  # (made once: a wrapper per call would cost each eager token a context's set-up)
            self.run_only = torch._dynamo.run(self.fn)
        return self.run_only(*args)


def _fallback_message(name: str, variant: tuple, error: BaseException) -> str:
    # (the variant in the words: Python's default filter shows a warning's text once per place, so two copies of one
    # function, greedy's and a sampled one's `next_token_1`, said the same text and only the first was shown)
    device = variant[0] if variant else "its device"
    return (f"compiled decode: `{name}` on {device} (variant: {_variant_words(variant)}) reached torch._dynamo's "
            f"recompile limit (recompile_limit = {recompile_limit()}; {type(error).__name__}). It decodes eagerly "
            f"from now on wherever its compiled graphs do not serve a call (the same tokens, at eager speed), and "
            f"compiles nothing more. A graph per call means a value that changes from call to call reaches the graph "
            f"(TORCH_LOGS=recompiles names the guard); a larger torch._dynamo.config.recompile_limit keeps compiling.")


def _variant_words(variant: tuple) -> str:
    """A copy's variant past its device, short: the plain values as they are (the cache's dtype, final_norm, the
    sampling branches), the model's graph key (its config's repr, hundreds of characters) as its class and a digest."""
    words = []
    for value in variant[1:]:
        text = repr(value)
        if isinstance(value, tuple) and value and isinstance(value[0], str) and len(text) > 80:
            text = f"{value[0]} {zlib.crc32(text.encode()):08x}"
        words.append(text)
    return ", ".join(words) or "none"


def _renamed(code: types.CodeType, name: str) -> types.CodeType:
    """`code` under another name (its qualified name too where the code object has one: Python 3.11+;
    3.10, which the project supports, has no co_qualname and refused the keyword)."""
    return code.replace(co_name=name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {}))


class _Copies:
    """The process's copies by key, least recently called first, at most COMPILED_COPIES (read at each new copy:
    a test may lower it). Locked: generations may run in several threads."""

    def __init__(self):
        self._copies: OrderedDict[tuple, CompiledCopy] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # copies dropped past the bound, since the process started

    def get(self, key: tuple, make) -> CompiledCopy:
        with self._lock:
            copy = self._copies.pop(key, None)
            self._copies[key] = copy = copy if copy is not None else make()
            while len(self._copies) > max(1, COMPILED_COPIES):
                self._copies.popitem(last=False)
                self.dropped += 1
            return copy

    def __len__(self) -> int:
        return len(self._copies)

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()


COPIES = _Copies()


def compiled_copy(function, mode: str | None, backend, cpp_wrapper: bool, padded: int,
                  variant: tuple = ()) -> CompiledCopy:
    """The copy of `function` (static shapes, `padded` new tokens) for these settings and `variant`, compiled
    lazily by torch.compile at its first call. On a CPU, kernels of one decode step are too small to share among
    threads (`cpp.threads` 1; the GEMMs keep torch's threads)."""
    options = {"cpp_wrapper": True, "cpp.threads": 1} if cpp_wrapper else None
    return COPIES.get((function, mode, backend, cpp_wrapper, padded, variant),
                      lambda: CompiledCopy(function, padded, variant,
                                           {"mode": mode, "backend": backend, "options": options}))
