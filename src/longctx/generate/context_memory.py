"""`--context-memory infllm`: generation past the trained window with InfLLM's context memory, on one process
or sharded over ctx ranks (generate/sharded_infllm.py).

The attention is models/context_memory.py's (InfLLMMemory.core on the KVCache); this module holds the
flags, their checks (every one before any weight is read) and the backend that uses it.

Why InfLLM prompts pass the length guard (config/positions.py's reach, which refuses prompts past the
trained positions unless --allow-extrapolation): with the memory every distance a query sees is below the
shape's `positions_needed`, whatever the prompt's length: init + window + block under --infllm-positions shared (the
local span keeps real distances below window + block, the initial tokens and retrieved units sit at one
distance), init + topk x block + window + block - 1 under ordered (all of them laid end to end). So the check
is moved from the prompt to the memory's shape: that sum must be within the model's reach, and the
prompts and their continuations may then be as long as the cache fits.

Prefill runs in chunks of at most window / 2 tokens (--prefill-chunk if smaller): each chunk's units are
chosen for it, and every query of a chunk keeps at least window / 2 real neighbours in its local span.
Prompts run one at a time (rows of one length; their --num-samples copies share the prefill).
Refused, each with its fix: --parallel.head > 1 (the memory shards over ctx ranks only), --draft (speculation
verifies several tokens against one selection, not built), --compile (its static step bypasses this
core), Ms-PoE (its per-head RoPE tables and InfLLM's re-rotation are not combined here), a window
larger than a prompt, a block that does not divide the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ..models.context_memory import InfLLMMemory, InfLLMShape
    from ..models.kv_cache import KVCache

# (imported by generate/cli.py for its flags: torch and the models load only when a memory is made)
# the defaults, for a model trained on 8K positions: 128 + 4 x 128 + 4096 + 128 - 1 = 4,863 of them at most,
# 4,863 keys per query. Measured on SmolLM2-135M (8K), passkey at 32K (docs/benchmarks.md, "InfLLM's placement of
# the retrieved units"): these find 17 of 20 keys, as many as plain attention at 4K; the paper's placement with
# the earlier defaults (shared, window 2048, top 8) found 4.
DEFAULTS = {"block": 128, "repr": 4, "topk": 4, "window": 4096, "init": 128, "positions": "ordered"}


def add_flags(p) -> None:
    """--context-memory and the --infllm-* sizes."""
    p.add_argument("--context-memory", choices=("none", "infllm"), default="none",
                   help="infllm: attend to the first --infllm-init tokens, the last --infllm-window and the "
                        "--infllm-topk best units of --infllm-block tokens of the rest, every distance within "
                        "the trained window (prompts past it run; one prompt at a time, on one process or over "
                        "--nproc N ctx ranks)")
    for name, text in (("block", "tokens per memory unit"),
                       ("repr", "representative keys per unit (scored against the query)"),
                       ("topk", "memory units each call attends to"),
                       ("window", "recent tokens attended at their real distance (a multiple of the block)"),
                       ("init", "initial tokens always attended (attention sinks)")):
        p.add_argument(f"--infllm-{name}", type=int, default=DEFAULTS[name],
                       help=f"{text} (default {DEFAULTS[name]})")
    p.add_argument("--infllm-positions", choices=("shared", "ordered"), default=DEFAULTS["positions"],
                   help="where the initial tokens and retrieved units are seen: shared, all at one distance past "
                        "the window (the paper's); ordered, laid end to end in their order right before the "
                        "window, each token at its own distance (needs init + topk x block + window + block - 1 "
                        f"trained positions; default {DEFAULTS['positions']})")


def memory_shape(args, cfg) -> InfLLMShape | None:
    """--context-memory's shape (None without it), every flag and combination checked: one error."""
    if getattr(args, "context_memory", "none") != "infllm":
        return None
    from ..models.context_memory import InfLLMShape

    shape = InfLLMShape(args.infllm_block, args.infllm_repr, args.infllm_topk, args.infllm_window, args.infllm_init,
                        getattr(args, "infllm_positions", DEFAULTS["positions"]))
    problems = shape.problems()
    if cfg.parallel.head > 1:
        problems.append(f"--context-memory infllm shards its memory over ctx ranks only (got --parallel.head "
                        f"{cfg.parallel.head}); use --parallel.ctx N with --nproc N")
    if args.draft:
        problems.append("--context-memory infllm does not verify a --draft's proposals (one unit selection per "
                        "call of several tokens); drop --draft")
    if args.compile:
        problems.append("--compile's static decode step bypasses InfLLM's attention; drop --compile")
    if cfg.model.rope_ms_poe:
        problems.append("--context-memory infllm re-rotates keys with one RoPE table, not Ms-PoE's per-head ones; "
                        "drop --model.rope_ms_poe")
    if problems:
        raise ConfigError("; ".join(problems) + ".")
    return shape


def check_reach(shape: InfLLMShape, reach) -> None:
    """The farthest distance the memory shows (shape.positions_needed - 1) within the model's reach."""
    need = shape.positions_needed
    if need <= reach.positions:
        return
    if shape.positions == "ordered":
        what, fix = ("--infllm-init + --infllm-topk x --infllm-block + --infllm-window + --infllm-block - 1",
                     "a smaller --infllm-topk or --infllm-window (a multiple of --infllm-block), or "
                     "--infllm-positions shared")
    else:
        what, fix = ("--infllm-init + --infllm-window + --infllm-block",
                     "a smaller --infllm-window (a multiple of --infllm-block)")
    raise ConfigError(f"{what} = {need:,} positions, past the {reach.positions:,} the model reaches "
                      f"({reach.said()}): InfLLM keeps every distance below that sum. Use {fix}.")


def memory_reach(shape: InfLLMShape, m):
    """The reach prompts are checked against under the memory: the model's (config/positions.py) must
    cover the shape's reach (check_reach); then no prompt length is past it (the memory never shows a larger
    distance), so it is unbounded."""
    import dataclasses

    from ..config.positions import model_reach

    reach = model_reach(m)
    check_reach(shape, reach)
    return dataclasses.replace(reach, positions=UNBOUNDED)


UNBOUNDED = 2 ** 62  # (a reach no prompt meets: generate/prompts.py then neither refuses nor caps)


def describe(backend, prefill_chunk: int) -> str:
    """The line generate says about the memory (`backend`: memory_backend's)."""
    s = backend.shape
    mesh = getattr(backend, "mesh", None)  # (the sharded backend's layout)
    where = f", its units over {mesh['ctx'].size()} ctx ranks" if mesh is not None else ""
    return (f"generate: InfLLM context memory: {s.init} initial tokens, a {s.window}-token window, the top "
            f"{s.topk} of units of {s.block} tokens ({s.repr} representative keys each, seen {s.positions}); at "
            f"most {s.max_keys:,} keys per query, every distance < {s.positions_needed:,}; prefill chunks of "
            f"{backend.chunk(prefill_chunk):,} tokens, one prompt at a time{where}")


def check_prompts(shape: InfLLMShape, prompts: list[dict]) -> None:
    """A window larger than a prompt is an error (the issue's rule: nothing there to remember)."""
    short = [(i, len(p["ids"])) for i, p in enumerate(prompts) if len(p["ids"]) < shape.window]
    if short:
        i, n = min(short, key=lambda x: x[1])  # (the shortest: a window that fits it fits every prompt)
        line = prompts[i].get("line")  # (as prompts.py prompt_name says it, which would import this module back)
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}" + (f" (--prompts line {line})" if line else "")
        fit = n // shape.block * shape.block  # (a window of whole units; none fits a prompt shorter than a unit)
        fix = f"--infllm-window {fit}" if fit else f"an --infllm-block and --infllm-window of at most {n:,}"
        raise ConfigError(f"--infllm-window {shape.window} is larger than {which} ({n:,} tokens"
                          f"{f'; {len(short)} prompts are' if len(short) > 1 else ''}): the memory would never "
                          f"hold anything. Use {fix} or drop --context-memory.")


def memory_backend(shape: InfLLMShape, layout_backend):
    """InfLLM's backend on this process's layout: the one device's, or, on the ranks of a ctx layout
    (generate/sharded.py ShardedGeneration), the memory sharded over them (generate/sharded_infllm.py)."""
    from .sharded import ShardedGeneration

    if isinstance(layout_backend, ShardedGeneration):
        from .sharded_infllm import ShardedInfLLMGeneration

        return ShardedInfLLMGeneration(shape, layout_backend.mesh)
    return InfLLMGeneration(shape)


class InfLLMGeneration:
    """The one-device backend (contracts.Backend; not a FlatPrefill, whose one varlen call would bypass
    the memory: rows prefill in chunks) whose cache attends through an InfLLMMemory. `memory`: the last
    cache's (tests read its keys_read)."""

    def __init__(self, shape: InfLLMShape):
        self.shape = shape.checked()
        self.memory: InfLLMMemory | None = None

    def cache(self, model, batch: int, max_len: int, core=None) -> KVCache:
        from ..models.context_memory import InfLLMCache, InfLLMMemory

        if core is not None:
            raise ValueError("InfLLM's cache attends through its own core; pass no cache_core")
        self.memory = InfLLMMemory(self.shape, model, batch, max_len)
        return InfLLMCache.for_memory(self.memory, model, batch, max_len)

    def prefill(self, model, cache: KVCache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
        from .local import prefill

        return prefill(model, cache, tokens, self.chunk(chunk))

    def chunk(self, chunk: int) -> int:
        """Prefill tokens per call: --prefill-chunk, at most window / 2 (each query keeps >= window / 2
        real neighbours)."""
        return max(1, min(chunk if chunk > 0 else self.shape.window, self.shape.window // 2))

    def repeat_rows(self, cache: KVCache, rows: int, times: int) -> None:
        from .local import LOCAL

        LOCAL.repeat_rows(cache, rows, times)
        self.memory.copy_rows(rows, times)
