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
`memory.block_chunk`) compiles again, once, as a dynamic shape. A MoE model compiles more graphs, all in the
first step too: `post` once per kind of feed-forward where dense and MoE layers mix (a guard on the type of
`feed_forward`; moe.dense_layers), and its MoE layer's code in several graphs between the parts that run eagerly
(the routing decisions and records; the grouped GEMMs of fp32 operands, ops/grouped.py), the experts' functions
once per weight shape (w1 and w3; w2). With a capacity (moe.capacity_factor > 0) the routed rows (dispatch,
experts, combine) run eagerly: their number is data-dependent, and compiled, a step after the first compiled them
again (models/moe.py `_kept_experts_of`, tests/unit/test_moe_recompile118.py).

`check_compiler` runs first, before any data or model work (train/preflight.py in `longctx train`'s launcher,
again on each rank at the Trainer's start, and at eval's): inductor builds C++ kernels on a CPU and Triton ones on
a GPU, and a machine without what it needs failed in the first step's forward (inductor's traceback, after the
whole set-up) rather than with a line saying what to set.

A compiled part that compiles again after the run's first step (a guard of its graph failed) is said in the run's
lines and counted in its metrics (train/recompile_hook.py, models/recompiles.py): past torch._dynamo's recompile
limit it would otherwise run eagerly for the rest of the run, silently.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError


def check_compiler(device_type: str) -> None:
    """A ConfigError unless inductor can build kernels for `device_type` (a C++ compiler on a CPU, Triton on a
    GPU). Cheap: the compiler's `--version` or Triton's import, no kernel built."""
    try:
        if device_type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()  # (raises InvalidCxxCompiler; cached, as inductor's own search is)
        elif device_type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                raise RuntimeError("no usable Triton for this GPU (not installed, or the GPU too old for it)")
    except Exception as e:  # noqa: BLE001 - whatever the compiler stack raises, the fix is the setting
        raise compile_failure(f"train.compile: torch.compile (inductor) cannot build kernels on {device_type}", e,
                              "on a CPU it needs a C++ compiler (g++, or the one the CXX variable names), on a GPU "
                              "Triton. Set --train.compile=false (the same training, eager), or install what the "
                              "compiler needs.") from e


def compile_failure(what: str, e: Exception, fix: str) -> ConfigError:
    """The error of a compiler stack that failed: `what` could not be compiled, the first line of torch's reason,
    and `fix` (the setting that runs it eagerly)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ConfigError(f"{what} ({type(e).__name__}: {first[:300]}); {fix}")


def compile_token_wise_parts(layers: nn.ModuleList) -> None:
    """Replace every block's `pre` and `post` with their compiled versions, in place (once)."""
    for block in layers:
        if hasattr(block.pre, "_torchdynamo_orig_callable"):
            continue  # compiled already
        block.pre = torch.compile(block.pre)
        block.post = torch.compile(block.post)
