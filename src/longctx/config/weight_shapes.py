"""What decides a model's weight shapes, read from two model configs as their manifests record them
(config keys, "moe.experts"): a checkpoint loads only into a model that agrees on every one.

Checked where a checkpoint is loaded (checkpoint/manifest.py check_model_matches) and, before that,
where a resume is asked to change the model (config/resume.py): no flag makes such a change loadable,
so that is said at once instead of advice that the load would refuse in turn.
"""

from __future__ import annotations

from .layer_lists import parse_layer_list

# model fields that decide tensor shapes
SHAPE_FIELDS = ("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
# parameters that exist only in some families; manifests older than them had none
OPTIONAL_PARAM_FIELDS = ("qkv_bias", "out_bias", "qk_norm")


def shape_differences(saved: dict, configured: dict) -> dict:
    """{field: (saved's, configured's)} for each difference in the weights' shapes or which weights exist."""
    diff = {k: (saved.get(k), configured.get(k)) for k in SHAPE_FIELDS if saved.get(k) != configured.get(k)}
    diff.update({k: (saved.get(k, False), configured.get(k, False)) for k in OPTIONAL_PARAM_FIELDS
                 if saved.get(k, False) != configured.get(k, False)})
    diff.update(_moe_structure_differences(saved, configured))
    # the q/k norms' weights are one head wide (span head) or the whole projection (all): else a size-mismatch
    # trace from inside DCP, or (one head of each) weights of the other meaning loaded at the same width
    span = tuple(c.get("qk_norm_span", "head") for c in (saved, configured))
    if saved.get("qk_norm", False) and configured.get("qk_norm", False) and span[0] != span[1]:
        diff["qk_norm_span"] = span
    if saved.get("head_dim", 0) or configured.get("head_dim", 0):
        def hd(c):
            return c.get("head_dim") or c["dim"] // c["heads"]

        if hd(saved) != hd(configured):
            diff["head_dim"] = (hd(saved), hd(configured))
    return diff


def _moe_structure(c: dict) -> dict:
    """What decides which MoE parameters a model has and their shapes (a dense model: experts 0 only):
    a checkpoint of another structure failed inside DCP with a size or missing-key trace."""
    experts = c.get("moe.experts", 0)
    if not experts:
        return {"moe.experts": 0}
    expert_dim = c.get("moe.expert_dim", 0) or c.get("ffn_dim")
    shared = c.get("moe.shared_experts", 0)
    # (ModelConfig.resolved_shared_dim: moe.shared_dim alone, with moe.shared_experts 0, builds a shared expert)
    shared_dim = c.get("moe.shared_dim", 0) or shared * expert_dim
    return {"moe.experts": experts, "moe.expert_dim": expert_dim, "moe.shared_experts": shared,
            "moe.shared_dim": shared_dim, "moe.shared_gate": bool(c.get("moe.shared_gate", False)) and bool(shared_dim),
            "moe layers": [i for i in range(c.get("layers", 0))
                           if i not in parse_layer_list(str(c.get("moe.dense_layers", "")))]}


def _moe_structure_differences(saved: dict, configured: dict) -> dict:
    a, b = _moe_structure(saved), _moe_structure(configured)
    if not (a["moe.experts"] and b["moe.experts"]):  # (dense on one side: that is the difference, not its keys')
        return {} if a == b else {"moe.experts": (a["moe.experts"], b["moe.experts"])}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
