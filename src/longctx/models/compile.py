"""Regional compilation: `torch.compile` of each block's token-wise parts.

A block is `pre` (norm, q/k/v projections, RoPE), the attention core, and `post` (output
projection, residual, norm, SwiGLU MLP, residual); see models/llama.py. `pre` and `post` are
compiled, the core is not: it communicates (Ulysses all-to-all, ring transfers), plans document
segments on the host and is already one fused kernel per block pair. Compiling the parts rather
than the model (torchtitan compiles per block too) keeps every memory policy working unchanged:
the policies call `block.pre` / `block.post` and checkpoint, chunk or offload around them, and
FSDP2's hooks stay on the block's own call, outside the compiled code. All blocks share one code
object, so the compiled graph is reused across them (`inline_inbuilt_nn_modules` makes the
parameters graph inputs, not constants); only a new token count (a last, shorter chunk of
`memory.block_chunk`) compiles again, once, as a dynamic shape.
"""

from __future__ import annotations

import torch
from torch import nn


def compile_token_wise_parts(layers: nn.ModuleList) -> None:
    """Replace every block's `pre` and `post` with their compiled versions, in place (once)."""
    for block in layers:
        if hasattr(block.pre, "_torchdynamo_orig_callable"):
            continue  # compiled already
        block.pre = torch.compile(block.pre)
        block.post = torch.compile(block.post)
