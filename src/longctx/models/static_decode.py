"""The compiled decode step: the model's cached forward for a few new tokens (a decode step, a
speculative chain or a CaPE tree to verify) written with static shapes and compiled once per shape.

Why: a small model's decode step is per-op overhead, not FLOPs. The debug model runs ~300 aten ops
of a few microseconds each per token, plus the Python between them. torch.compile fuses the
pointwise ops into a few kernels around the GEMMs; on a GPU (mode "reduce-overhead") the step is
replayed as one CUDA graph. That needs every shape to stay the same from step to step:
- the cache is the preallocated KVCache (models/kv_cache.py), written at the new tokens' slots by a
  tensor index, never grown or sliced to the held prefix (a length that changes every step);
- attention reads every slot and masks those a query must not see: the slots each row held before
  the call, and among the new tokens those `among` names (causal for a chain; a tree's ancestors),
  built inside the graph from tensors (each row's start, the [n, n] visibility);
- the new tokens are padded to a bucket (1, 2, 4, ..., 64), so a chain of K + 1 tokens or a tree of
  any size reuses one graph per bucket. A padded token writes its keys and values to the cache's
  last slot (kept spare: `handles` refuses a call that would reach it) and sees only that slot and
  the prefix; no real token sees it.
So a decode compiles once per (model, batch, bucket) and never per token; the cache's length is
marked dynamic, so generations of other prompt lengths or limits reuse the graph (a GPU records a
CUDA graph per length, without compiling): every capacity up to the model's max_seq_len (256 to
131072 slots, 56 capacities of generate/cache_pool.py) is one graph. tests/unit/test_compiled_decode.py
counts the compilations and holds the tokens to the eager path's.

Dynamo keeps graphs, and counts recompiles against its limit (8), per code object. So each function is
compiled as a copy of its code per bucket and per `variant`, what the caller knows changes the graph
(models/compiled_copies.py): the model's graph key (`model_key`: its config but for what reaches the
graphs only as tensors, such as rope_theta), the cache dtype, final_norm, the sampling branches of
`next_token`. What is left to one code object is a batch of 1 and then any other batch (dynamic) and,
for a sampled step, the first change of each sampling value (made dynamic): at most 6 graphs
(tests/unit/test_leftovers119_compile.py). A process keeps at most COMPILED_COPIES (64) copies, the
least recently called dropped; a copy that still reaches the limit warns once and decodes eagerly
where its graphs do not serve (tests/unit/test_compiledec120.py).

The step is installed on a KVCache after its prefill (generate/loop.py: `cache.fast`); the model's
cached forward (models/llama.py) hands it every call it `handles`, and runs the eager path (the
reference: per-layer cache cores, models/cached_attention.py) otherwise. The prefill stays eager:
its chunks are compute, and each chunk length would be a graph. A cache sharded over head x ctx
(generate/sharded.py) has no `fast` step: it decodes eagerly.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from .cached_attention import CacheStep, group_queries, to_device, ungroup_heads
from .compiled_copies import CompiledCopy, compiled_copy
from .llama import Llama, rope_cos_sin

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # new tokens per compiled call, padded up to the next


def bucket(new: int) -> int | None:
    """The padded size of a call of `new` tokens; None past the largest bucket (eager)."""
    return next((b for b in BUCKETS if b >= new), None)


def static_hidden_states(model, tokens, positions, slots, start, among, k_cache, v_cache, final_norm: bool):
    """The cached forward with static shapes. tokens, positions, slots [b, n] long (slots: where each
    new token's keys go); start [b] long (tokens each row held before the call); among [n, n] bool
    (new token j sees new token i; a padded token's row is all False); k_cache, v_cache [layers, b,
    kv_heads, L, head_dim], written in place. -> hidden [b, n, dim]."""
    rope = rope_cos_sin(positions, model.inv_freq, model.rope_scale)  # (Ms-PoE's layers: model.layer_rope)
    x = model.tok_embeddings(tokens)
    kv_heads = k_cache.shape[2]
    visible = _visible(start, among, k_cache.shape[3], model.cfg.heads // kv_heads)
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
    layers = torch.arange(len(model.layers), device=tokens.device)
    for i, block in enumerate(model.layers):
        q, k, v = block.pre(x, *model.layer_rope(i, positions, rope))
        # one index_put on the whole cache (a tensor layer index, not a view of layer i: the write then
        # happens in place instead of on a copy of the cache); [b, n] indexes, then [kv_heads, head_dim]
        k_cache[layers[i:i + 1, None], rows, :, slots] = k.to(k_cache.dtype)
        v_cache[layers[i:i + 1, None], rows, :, slots] = v.to(v_cache.dtype)
        x = block.post(x, _attend(q, k_cache[i], v_cache[i], visible))
    return model.norm(x) if final_norm else x


def _visible(start, among, length: int, group: int) -> torch.Tensor:
    """[b, 1, n * group, L] bool: query row i * group + j (new token i, its head j; group_queries'
    order) sees slot s when the row held s before the call, when s is new token c's slot and
    among[i, c], or, for a padded token, when s is the spare last slot."""
    n = among.shape[0]
    slot = torch.arange(length, device=start.device)
    rel = slot[None, :] - start[:, None]  # [b, L]: which new token a slot holds, when in [0, n)
    new = among[:, rel.clamp(0, n - 1)] & ((rel >= 0) & (rel < n))[None]  # [n, b, L]
    padded = ~among.any(dim=1)  # a real token always sees itself
    spare = padded[:, None, None] & (slot == length - 1)[None, None, :]
    visible = ((rel < 0)[None] | new | spare).transpose(0, 1)  # [b, n, L]
    return visible.repeat_interleave(group, dim=1)[:, None]


def _attend(q, k, v, visible) -> torch.Tensor:
    """q [b, n, h, d] over every slot of one layer's cache k, v [b, kv, L, d] that `visible` lets it
    see: scores in fp32, queries grouped per kv head (the cache is read once per kv head). One SDPA
    kernel call, as the eager path's: a bf16 matmul of q and k would round the scores to bf16 before
    the softmax (scores of std 10 to 25: 6 to 20x the eager path's error), and upcasting the cache to
    fp32 first would copy it whole each step. Every row sees a slot (itself; a padded one the spare slot)."""
    n, heads = q.shape[1], q.shape[2]
    qg = group_queries(q, k.shape[1])  # [b, kv, n * g, d]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible, scale=1.0 / math.sqrt(q.shape[-1]))
    return ungroup_heads(out, n, heads).to(q.dtype)


class CompiledStep:
    """A KVCache's `fast` step (see the module docstring): `handles(cache, step)` says whether a call
    goes through it; calling it runs the compiled static forward for the call's real tokens.

    `mode`: torch.compile's; None picks "reduce-overhead" (CUDA graphs) on a GPU and the default on a
    CPU. `backend`: torch.compile's (tests pass a counting one)."""

    def __init__(self, mode: str | None = None, backend="inductor"):
        self.mode, self.backend = mode, backend
        self._among: dict[tuple, torch.Tensor] = {}  # the causal masks, per size and device
        self.calls = 0

    def handles(self, cache, step: CacheStep) -> bool:
        """A call of up to the largest bucket's tokens that leaves the spare last slot free."""
        return bucket(step.new) is not None and int(step.start.max()) + step.new < cache.k.shape[3]

    def warm_up(self, model, sizes, batch: int = 1) -> None:
        """Compile now, on a scratch cache, the graphs of `model`'s calls of `sizes` new tokens (their
        buckets), so none is compiled inside a timed generation (the cache length is dynamic)."""
        from .kv_cache import KVCache

        with torch.inference_mode():  # (as generation runs: the graphs are specialised to it)
            cache = KVCache.for_model(model, batch, 2 * BUCKETS[-1] + 1)
            install(cache, model, self)
            device = cache.k.device
            for padded in sorted({bucket(n) for n in sizes} - {None}):
                cache.reset()
                model(torch.zeros(batch, padded, dtype=torch.long, device=device), cache=cache)

    def __call__(self, model, tokens, positions, cache, step: CacheStep, final_norm: bool = True) -> torch.Tensor:
        """Hidden states [b, new, dim] of the call's tokens [b, new] at `positions` [b, new], their
        keys and values written to the cache at their slots (start + 0..new-1)."""
        device, n = tokens.device, step.new
        b, padded = tokens.shape[0], bucket(n)
        slots = np.full((b, padded), cache.k.shape[3] - 1, dtype=np.int64)
        slots[:, :n] = step.start[:, None] + np.arange(n)
        if padded > n:
            tokens, positions = F.pad(tokens, (0, padded - n)), F.pad(positions, (0, padded - n))
        hidden = self.launch(static_hidden_states, device, padded, model, tokens, positions,
                             to_device(slots, device), to_device(step.start, device),
                             self._visibility(step.among, n, padded, device), cache.k, cache.v, final_norm,
                             variant=(model_key(model), cache.k.dtype, final_norm))
        # a CUDA graph's output is overwritten by its next replay: the caller keeps a copy
        return hidden[:, :n].clone() if device.type == "cuda" else hidden[:, :n]

    def launch(self, fn, device: torch.device, padded: int, *args, graphed_by_caller: bool = False,
               variant: tuple = ()):
        """One call of the step: `fn` (static shapes, `padded` new tokens) compiled with this step's
        settings, run on `args`. Its outputs on a GPU live until the next call (a CUDA graph's replay).
        `graphed_by_caller`: the caller captures the calls in a CUDA graph of its own (generate/blocks.py
        BlockGraph: a block of steps, one replay), so on a GPU `fn` is compiled without torch.compile's
        CUDA graphs (a graph cannot be captured inside another's capture). `variant`: hashable, what of
        `args` makes another graph (models/compiled_copies.py), each variant a code object of its own."""
        compiled = self.copy(fn, device, padded, graphed_by_caller, variant)
        if device.type == "cuda" and not graphed_by_caller:
            torch.compiler.cudagraph_mark_step_begin()
        self.calls += 1
        return compiled(*args)

    def copy(self, fn, device: torch.device, padded: int, graphed_by_caller: bool = False,
             variant: tuple = ()) -> CompiledCopy:
        """The compiled copy `launch` runs for these arguments (models/compiled_copies.py)."""
        return compiled_copy(fn, *self._settings(device, graphed_by_caller), padded, (device.type, *variant))

    def _settings(self, device: torch.device, graphed_by_caller: bool = False) -> tuple:
        if graphed_by_caller and device.type == "cuda" and self.mode in (None, "reduce-overhead"):
            return None, self.backend, False  # (inductor's kernels; the caller's graph replays them)
        mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
        # on a CPU the C++ wrapper calls the kernels without Python between them (~1.3x the step)
        cpp = mode is None and device.type == "cpu" and self.backend == "inductor"
        return mode, self.backend, cpp

    def _visibility(self, among: torch.Tensor | None, n: int, padded: int, device) -> torch.Tensor:
        """[padded, padded] bool: the call's `among` (a tree's) or causal, the padded tokens' rows False."""
        key = (n, padded, str(device))
        if among is None and key in self._among:
            return self._among[key]
        out = torch.zeros(padded, padded, dtype=torch.bool)
        out[:n, :n] = among.cpu() if among is not None else torch.ones(n, n, dtype=torch.bool).tril()
        out = out.to(device)
        if among is None:
            self._among[key] = out
        return out


_MODEL_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# where a model's weights came from and how they were initialised, and the length it is meant for: no graph reads
# them. In the key, every checkpoint of one architecture (generate/loading.py: model.init_from is the checkpoint's
# path) compiled all its graphs again, and kept them, where one code object's graphs served them all
_NOT_IN_GRAPHS = frozenset({"preset", "init_from", "init_std", "max_seq_len"})
# the fields whose values reach the graphs only as tensors, graph inputs as the weights are: RoPE's frequencies (the
# model's `inv_freq` buffer) and Ms-PoE's ratios (`ms_poe_ratios`). The one Python number RoPE's settings put in a
# graph, YaRN's attention factor (`model.rope_scale`: `if scale == 1.0` picks the code), is in the key by its value.
# In the key, configs differing only in rope_theta compiled each graph once per value, under copies of their own
_TENSOR_VALUES = frozenset({
    "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
    "rope_attention_factor", "rope_truncate", "rope_ms_poe_min", "rope_ms_poe_max", "rope_ms_poe_order"})


def model_key(model) -> tuple:
    """A model's part of a compiled step's variant: its class, its config but for _NOT_IN_GRAPHS and _TENSOR_VALUES,
    and `rope_scale` (made once per model: a decode step reads it every token). Models whose graphs are the same
    share them (one code object, its recompile limit); a field that changes a graph (layers, heads, norm_eps,
    qk_norm, Ms-PoE's layers, ...) gives a copy of its own. A field left in by mistake costs a compile, never a
    token: dynamo guards on whatever a graph reads, so a key that merged two graphs would compile again, not reuse."""
    key = _MODEL_KEYS.get(model)
    if key is None:
        cfg = getattr(model, "cfg", None)
        skip = _NOT_IN_GRAPHS | _TENSOR_VALUES
        shape = repr(cfg) if not dataclasses.is_dataclass(cfg) else repr(
            [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in skip])
        key = _MODEL_KEYS[model] = (type(model).__qualname__, shape, getattr(model, "rope_scale", None))
    return key


def compiled_step(compile: bool | CompiledStep | None) -> CompiledStep | None:
    """A generation's `compile` argument as a step: True a new one, False / None none."""
    if isinstance(compile, CompiledStep):
        return compile
    return CompiledStep() if compile else None


def install(cache, model, step: CompiledStep) -> bool:
    """Hand `step` the cached calls of `model` on `cache` it handles (`cache.fast`), where a static form
    exists: a one-device KVCache with the plain core and a dense Llama. Whether it was installed."""
    from .kv_cache import KVCache, attend

    # a cache with its own core (InfLLM's memory, a caller's cache_core) attends its own way: the static
    # step, plain attention over every slot, would bypass it (other tokens, silently); it decodes eagerly
    if not isinstance(cache, KVCache) or cache.core is not attend or not supports(model):
        return False
    for t in (cache.k, cache.v):
        # one graph for every cache length (a generation's prompt and limit decide it), not one per length
        torch._dynamo.maybe_mark_dynamic(t, 3)
        if t.device.type == "cuda":  # written in place by every replay: CUDA graphs keep its address
            torch._dynamo.mark_static_address(t)
    cache.fast = step
    return True


def supports(model) -> bool:
    """Whether `model`'s cached forward has a static form here: a dense models.llama.Llama (an MoE
    layer's routing has data-dependent shapes; it decodes eagerly)."""
    from .moe import moe_layers

    return isinstance(model, Llama) and not moe_layers(model)
