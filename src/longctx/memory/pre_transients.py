"""The pre phase of one block's backward (models/llama.py Block.pre: the attention norm, the q/k/v projections,
RoPE), one rank's: what it holds beyond the saved activations, stage by stage. memory/transients.py
backward_phase_bytes adds the weights' terms, the credit of what the phases before it freed and the host tier.
Bytes per rank token and micro-batch, as there.

The stages follow the implementation's order, which the data dependencies fix: the attention core's backward
makes dq, dk, dv; RoPE's backward of k, then of q (autograd runs the later-made node first), each turning its
incoming gradient into the gradient of the projection's output; the projections' backward, each making an input
gradient that is summed with the others; the attention norm's backward, once that sum is whole. A recomputed
piece of pre runs its forward again first, at its first saved tensor's unpack (k's RoPE, after k's gradient is
copied to fp32). Measured on CPU to the byte, stage by stage (tests/unit/test_pre_phase_transients.py)."""

from __future__ import annotations

from ..config import ModelConfig

# the attention norm's backward (ops/norm.py rms_norm, statistics in fp32): four fp32 [tokens, dim] temporaries at
# its peak beside the residual gradient, the fp32 input's gradients through the rsqrt and the mean (measured)
NORM_BACKWARD_FP32 = 4


def rope_dtype_bytes(m: ModelConfig, c: int, autocast: bool) -> int:
    """Bytes per element of what RoPE rotates: q and k as the projections made them (`c`), or, under autocast with
    model.qk_norm, the q/k norms' fp32 outputs (rms_norm: the input's dtype times the fp32 weight's)."""
    return 4 if autocast and m.qk_norm else c


def rope_backward_bytes(q_dim: int, r: int) -> float:
    """Bytes per token of RoPE's backward of q at its peak (models/llama.py apply_rope computes in at least fp32),
    its incoming gradient freed by then. Elements of `r` bytes below 4: the gradient's fp32 copy (the result
    cast's backward), one product with cos or sin (fp32, freed once cast) and the two gradients cast back to r,
    the rotation's and x's: (8 + 2r) per element. In fp32: the two products (x's gradient and the rotation's), the
    rotated half's negation and the concatenation that makes x's second gradient: 3.5 x 4. Counted at the compute
    dtype (5 x q at c, which held the projections' outputs too), bf16's was 10 of q under its 12."""
    return (8 + 2 * r) * q_dim if r < 4 else 3.5 * 4 * q_dim


def rope_forward_bytes(q_dim: int, r: int) -> float:
    """Bytes per token of RoPE's recomputed forward of q at its peak: the rotated copy (r) and the two products
    with cos and sin and their sum, in fp32 (promoted), before the sum is cast back."""
    return (r + 3 * 4) * q_dim


def pre_phase_bytes(m: ModelConfig, tokens: int, pieces: list[tuple[float, bool, bool]], part: dict[str, float],
                    *, e: int, c: int, q_dim: int, kv_dim: int, layouts: int, autocast: bool) -> float:
    """Bytes the pre phase of a block's backward holds beyond the saved activations, for `tokens` rank tokens run
    in `pieces` (tokens, recomputed in this phase, its norms' saved tensors alive: recomputed here or, under
    `full` without block chunks, with the whole block in the post phase). `part`: block_part_bytes; `e` the
    residual stream's bytes, `c` the matmuls' and the kernel's; `layouts`: 2 when dq, dk, dv also exist in the
    head all-to-all's layout (counted beside every stage: a bound).

    One piece over all tokens, the largest of the stages (per token; X = e x dim, the residual gradient, alive
    throughout):

    - the recomputation (a recomputed piece): dq, dk, dv (k's copied to fp32 when c < 4), the norms' saved
      tensors, under autocast the fp32 norm output (the projections' argument, held while they and RoPE run),
      the projections' outputs (c (q + 2 kv)) and RoPE's forward of q (rope_forward_bytes);
    - RoPE's backward of q (rope_backward_bytes), k's done: its result (r kv) and dv;
    - the projections' backward: two input gradients (fp32 under autocast) and their sum beside X, and the
      projection output's gradient not yet consumed (q's, the largest): 4 X + c q;
    - the attention norm's backward: X and four fp32 of dim (NORM_BACKWARD_FP32).

    In pieces (memory.block_chunk, or an offloaded block's stored and recomputed tokens): over all tokens dq, dk,
    dv (the pieces' gradients are views of them until the last piece has run), X and the input gradient the pieces
    build (2 X); per piece token the stage's own tensors (the recomputation's k copy at 4 B, the projections'
    three of X), the largest piece's."""
    d = m.dim
    X = e * d
    r = rope_dtype_bytes(m, c, autocast)
    proj = c * (q_dim + 2 * kv_dim)
    norms = part["norm"] + part["qk_norm"]
    norm_out = X if c < e else 0.0  # autocast: the fp32 norm output is not saved (its casts are), but held
    rope_back, rope_fwd = rope_backward_bytes(q_dim, r), rope_forward_bytes(q_dim, r)
    copies = (layouts - 1) * proj  # (whole: beside every stage; in pieces: in the all-token part)
    whole = len(pieces) == 1 and pieces[0][0] >= tokens

    def stages(recomputed: bool, alive: bool) -> float:
        held = norms if alive else 0.0
        if whole:
            k_copy = (4 - c) * kv_dim if c < 4 else 0.0  # (it replaces dk, counted in proj)
            # the projections' backward: under autocast two of the norm output's three casts (one per projection,
            # `norms`) freed at the first sum. The norm's backward: of its saved tensors the rsqrt alone is left
            # (its fp32 values are consumed as the temporaries are made)
            casts_freed = 2 * c * d if autocast and alive else 0.0
            out = [X + rope_back + (r + c) * kv_dim + held, 4 * X + c * q_dim + held - casts_freed,
                   X + NORM_BACKWARD_FP32 * 4 * d + (4 if alive else 0)]
            if recomputed:
                out.append(X + proj + k_copy + norms + norm_out + proj + rope_fwd)
        else:
            k_copy = 4 * kv_dim if c < 4 else 0.0  # (beside dk: the pieces' dk are views of the whole)
            out = [rope_back + r * kv_dim + held, 3 * X + c * q_dim + held, NORM_BACKWARD_FP32 * 4 * d + held]
            if recomputed:
                out.append(k_copy + norms + norm_out + proj + rope_fwd)
        return max(out)

    largest = max(n * stages(recomputed, alive) for n, recomputed, alive in pieces)
    return tokens * copies + largest if whole else tokens * (2 * X + layouts * proj) + largest
