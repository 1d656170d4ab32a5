"""Activation memory policies, applied to a model's blocks without renaming any module.

A block is three stages (models/llama.py): `pre` (norm, q/k/v projections, RoPE) and `post`
(output projection, residuals, MLP) are token-wise and cheap; `attention.core` is the only place
tokens meet and, sequence-parallel, the only place ranks communicate. The policies:

- `none`: autograd keeps everything it saves.
- `full`: each block keeps only its input and recomputes itself in backward (attention included,
  with its communication).
- `selective` (LoongTrain's Selective Checkpoint++): `pre` and `post` are recomputed from the
  block input; the attention core keeps what its backward needs (q, k, v in its own layout, the
  output and the log-sum-exp), so backward never re-runs attention nor its all-to-all / ring.
- `selective` + `offload_fraction` A > 0 (MEMO's token-wise offload): in every block but the last
  `offload_skip_last`, the block input and the attention core's saved tensors (q, k, v, output,
  log-sum-exp) always go to the host, as in MEMO; of the other activations (norms, projections,
  MLP), the first A of the tokens store theirs on the host and the remaining tokens are recomputed
  in backward from the block input and attention output (brought back from the host). An
  offloaded block leaves nothing on the device; A trades host memory and transfer volume against
  recomputation.

Token-splitting is exact because `pre` and `post` treat every token independently.
The wrappers replace the block's bound `forward`, so parameter names (`layers.3.attention.wq.weight`)
stay the same for checkpoints and HF export.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .offload import HostOffloader

POLICIES = ("none", "full", "selective")


def _checkpointed(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _full_forward(x, cos, sin, doc_ids, *, block):
    return _checkpointed(functools.partial(type(block).forward, block), x, cos, sin, doc_ids)


def _selective_forward(x, cos, sin, doc_ids, *, block):
    q, k, v = _checkpointed(block.pre, x, cos, sin)
    out = block.attention.core(q, k, v, doc_ids)
    return _checkpointed(block.post, x, out)


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _offload_forward(x, cos, sin, doc_ids, *, block, offloader: HostOffloader, index: int, fraction: float):
    b, tokens = x.shape[:2]
    # pre and post are token-wise, so they may see the batch as one row of b x tokens; then "the
    # first tokens" is a contiguous slice (with batch > 1 a slice per row would be strided)
    row = lambda t: t.reshape(1, b * tokens, *t.shape[2:])
    unrow = lambda t: t.reshape(b, tokens, *t.shape[2:])
    x1, cos1, sin1 = row(x), row(cos), row(sin)
    cut = round(fraction * b * tokens)
    head, rest = slice(0, cut), slice(cut, b * tokens)
    # Everything saved in here goes to the host, including what the checkpoints of the recomputed
    # tokens keep (their inputs: the block input and the attention output), so the block leaves
    # nothing on the device; `fraction` only decides which tokens' other activations are stored
    # (host) rather than recomputed.
    with offloader.block(index, shared=(cos, sin, doc_ids)), offloader.offload(1.0):
        xh, xr = x1[:, head], x1[:, rest]  # xh goes to pre and post as ONE object: copied once
        qkv = []
        if cut:
            qkv.append(block.pre(xh, cos1[:, head], sin1[:, head]))
        if cut < b * tokens:
            qkv.append(_checkpointed(block.pre, xr, cos1[:, rest], sin1[:, rest]))
        q, k, v = (unrow(_cat(parts)) for parts in zip(*qkv))
        out = row(block.attention.core(q, k, v, doc_ids))
        y = []
        if cut:
            y.append(block.post(xh, out[:, head]))
        if cut < b * tokens:
            y.append(_checkpointed(block.post, xr, out[:, rest]))
        y = unrow(_cat(y))
        # a block must not return a view: FSDP2 hooks its output, and an in-place op on a view
        # would bypass that hook (FSDP warns); one copy of the block output is cheap next to the MLP
        return y.clone() if y._is_view() else y


def check_policy(checkpoint_policy: str, offload_fraction: float) -> None:
    if checkpoint_policy not in POLICIES:
        raise ConfigError(f"memory.checkpoint '{checkpoint_policy}' is not available; choose one of {POLICIES}.")
    if offload_fraction > 0 and checkpoint_policy != "selective":
        raise ConfigError(
            f"memory.offload_fraction = {offload_fraction} needs memory.checkpoint = selective (got "
            f"'{checkpoint_policy}'): the tokens that are not offloaded are recomputed, which is the selective "
            f"policy's job. Add --memory.checkpoint selective."
        )


def apply_memory_policy(layers: nn.ModuleList, checkpoint_policy: str, offload_fraction: float = 0.0,
                        offload_skip_last: int = 1, device="cpu") -> HostOffloader | None:
    """Wrap every block's forward for the policy; returns the offloader when anything is offloaded."""
    check_policy(checkpoint_policy, offload_fraction)
    if checkpoint_policy == "none":
        return None
    offloader = HostOffloader(torch.device(device)) if offload_fraction > 0 else None
    offloaded = len(layers) - offload_skip_last
    for i, block in enumerate(layers):
        if checkpoint_policy == "full":
            forward = functools.partial(_full_forward, block=block)
        elif offloader is not None and i < offloaded:
            forward = functools.partial(_offload_forward, block=block, offloader=offloader, index=i,
                                        fraction=offload_fraction)
        else:
            forward = functools.partial(_selective_forward, block=block)
        block.forward = forward
    return offloader
