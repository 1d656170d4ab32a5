"""Each block's (offloaded, MoE, host bytes) of a MoE model's `layer_activations`, kept by every argument it was
made from: the planner's search counts a candidate's activations (memory/accounting.py estimate_activations) and
then its pinned host bytes (memory/host_parts.py pinned_activation_bytes) from the same blocks, and making them
twice was a tenth of a MoE search's time (qwen3-30b-a3b on 16 GPUs: 9,108 lists of 48 blocks made again;
docs/planner.md "How the search is timed").

The key holds the model's repr (every field: ModelConfig is a mutable dataclass, so neither its identity nor a
reference to it says what it holds now), the policy (frozen, every field) and every other argument of
layer_activations; the value is a tuple of tuples, which no caller can change (tests/unit/test_planspeed120.py)."""

from __future__ import annotations

_LAYERS: dict[tuple, tuple[tuple[bool, bool, float], ...]] = {}
_MAX = 16384  # entries (of a few hundred bytes to a few KB each) before the store starts again


def layers_key(model_repr: str, seq_len: int, micro_batch: int, head: int, ctx: int, policy, dtype_bytes: int,
               docs: bool, expert: int, expert_skew: float, autocast: bool, expert_replicas: int,
               expert_ranks_per_node: int) -> tuple:
    """The store's key: every argument of layer_activations, the model as its repr."""
    return (model_repr, seq_len, micro_batch, head, ctx, policy, dtype_bytes, docs, expert, expert_skew, autocast,
            expert_replicas, expert_ranks_per_node)


def remember(key: tuple, layers) -> tuple[tuple[bool, bool, float], ...]:
    """Keep (and return) the (offloaded, moe, host) of each of `layers` (LayerActivations, in block order)."""
    if len(_LAYERS) >= _MAX:
        _LAYERS.clear()
    kept = _LAYERS[key] = tuple((la.offloaded, la.moe, la.host) for la in layers)
    return kept


def recall(key: tuple) -> tuple[tuple[bool, bool, float], ...] | None:
    """What `remember` kept under `key`, or None."""
    return _LAYERS.get(key)
