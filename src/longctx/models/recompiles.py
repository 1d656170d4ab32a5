"""Recompilations of torch.compile'd code, as they happen: what train.compile and `generate --compile` report.

Why: dynamo compiles a function again whenever a guard of its graphs fails (a Python number it read changed, a
new shape, grad mode); after torch._dynamo.config.recompile_limit (8) compiles of one function it stops trying and
runs that function EAGERLY for the rest of the process, said in one warning of torch's logging. A region that
compiles again every step (DTS-Gate's router did: its step, a Python int, was a guarded constant; commit 7a0a500)
so costs a compile per step for 8 steps, then the compiled speed for the rest of the run, without a word in the
run's own lines. Any later per-step recompile would do the same; `RecompileWatch` makes it visible.

Read from dynamo's own record of every compile, `torch._dynamo.utils.get_compilation_metrics()` (a deque of the
latest 64; the same fields in torch 2.11 and 2.13): the function (`co_name`, file, line), its compile id
("frame/attempt") and, for a compile of an already compiled function, `recompile_reason` (the guard that failed,
in dynamo's words). A compile refused by the limit is a record with that reason and fail_type `Unsupported`
("Dynamo recompile limit exceeded"), without the function's name: it is the frame's, named by its earlier
records. Nothing of dynamo's behaviour is changed (no config set, no hook or log handler installed): the
watch only reads what dynamo records anyway, so other compiled code in the process runs as it did.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

REASON_CHARS = 300  # a guard's words kept in a line (dynamo's may quote a long source line)


@dataclass(frozen=True)
class Recompile:
    """One compile of an already compiled function."""
    function: str  # `post` (models/llama.py:215)
    reason: str  # the guard that failed, as dynamo says it ("1/0: GLOBAL_STATE changed: grad_mode")
    limit_hit: bool  # refused by dynamo's recompile limit: the function runs eagerly from now on


def recompile_limit() -> int:
    """torch._dynamo.config.recompile_limit (cache_size_limit before torch 2.6)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


class RecompileWatch:
    """The recompiles dynamo recorded since the last `take()` (the first: since the watch was made)."""

    def __init__(self):
        self._names: dict[str, str] = {}  # frame id -> the function's name (a limit hit's record has none)
        self._last = None  # the newest record already taken (by identity: records carry no sequence number)
        self.take()

    def take(self) -> list[Recompile]:
        records = _records()
        new = records
        for i in range(len(records) - 1, -1, -1):
            if records[i] is self._last:
                new = records[i + 1:]
                break
        # (not found: the deque rolled over, more than 64 compiles since, or a test cleared it; all are new)
        if records:
            self._last = records[-1]
        out = []
        for r in new:
            frame = str(r.compile_id or "").lstrip("!").split("/")[0]
            if r.co_name:
                self._names[frame] = _function(r)  # (the latest: dynamo numbers frames anew after a reset)
            # (fullgraph code, as the compiled decode's copies, fails with its own type: models/compiled_copies.py)
            limit_hit = (r.fail_type == "Unsupported" and "recompile limit" in (r.fail_reason or "").lower()
                         or r.fail_type == "FailOnRecompileLimitHit")
            if r.recompile_reason is None and not limit_hit:
                continue  # a first compile, a backward's, or an inductor runtime record
            name = _function(r) if r.co_name else self._names.get(frame, "a compiled function")
            out.append(Recompile(name, _short(r.recompile_reason or "(dynamo recorded none)"), limit_hit))
        return out


def _records() -> list:
    from torch._dynamo.utils import get_compilation_metrics  # (imports dynamo: only once something compiled)

    return get_compilation_metrics()


def _function(record) -> str:
    """`post` (models/llama.py:215): the name, and its file from the package's folder (else its base name)."""
    path = record.co_filename or "?"
    parts = path.split(os.sep)
    where = os.sep.join(parts[parts.index("longctx") + 1:]) if "longctx" in parts else os.path.basename(path)
    return f"`{record.co_name}` ({where}:{record.co_firstlineno})"


def _short(reason: str) -> str:
    """dynamo's reason (`1/0: self.tick == 1   # <the source line> # <file:line> (HINT: ...)`) as the guard and
    dynamo's hint where it gives one, on one line, at most REASON_CHARS characters."""
    guard, _, comment = reason.partition("#")
    guard = re.sub(r"^\s*\d+/\d+:\s*", "", guard)  # (which graph's guard: dynamo's compile id)
    hint = re.search(r"\(HINT: .*?\)\s*$", comment, re.S)
    text = " ".join(f"{guard} {hint.group(0) if hint else ''}".split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."
