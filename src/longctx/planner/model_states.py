"""Model-state memory of one rank: parameter counts, the sharded states, and what FSDP gathers.

Model states are fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter; FSDP2
keeps the sharded parameters fp32 under bf16 mixed precision too, the bf16 copies are the gathered
ones) sharded over dp_shard x head x ctx (FSDP2, hybrid ZeRO) and replicated over dp_replicate
(HSDP). On top of them FSDP holds the blocks it has unsharded at a time (this one and the
prefetched next) and the root (embeddings, final norm, LM head), which stays gathered for the
whole step. tests/distributed/test_fsdp_bytes.py compares these with a real FSDP2 step.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..models.flops import matmul_params_per_layer
from .shape import MeshShape


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters of one block, of the root module (embeddings, final norm, LM head), and in total."""
    block = matmul_params_per_layer(m) + 2 * m.dim
    root = m.vocab_size * m.dim + m.dim + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return {"block": block, "root": root, "total": m.layers * block + root}


def model_state_bytes(m: ModelConfig, shape: MeshShape) -> float:
    """Bytes of model states per rank: fp32 parameters, gradients and AdamW's exp_avg and exp_avg_sq
    (16 per parameter), sharded over the FSDP group and replicated over dp_replicate."""
    return 16 * param_counts(m)["total"] / shape.fsdp


def gathered_param_bytes(m: ModelConfig, shape: MeshShape, gather_bytes: int) -> float:
    """Bytes FSDP holds unsharded per rank (0 on one rank): two blocks gathered in `gather_bytes` per
    parameter (this one + the prefetched next) and one block's fp32 gradient before its
    reduce-scatter; the root stays gathered for the step, its gradient is fp32 until reduced."""
    if shape.world == 1:
        return 0.0
    pc = param_counts(m)
    return 2 * pc["block"] * gather_bytes + pc["block"] * 4 + pc["root"] * (gather_bytes + 4)


def accumulated_grad_bytes(m: ModelConfig, shape: MeshShape, grad_accum: int, grad_sync: str) -> float:
    """With gradient sync off between micro-batches (grad_accum > 1, grad_sync "step") FSDP2
    accumulates every gradient unsharded, in fp32; 0 otherwise."""
    if shape.world > 1 and grad_accum > 1 and grad_sync == "step":
        return 4 * param_counts(m)["total"]
    return 0.0
