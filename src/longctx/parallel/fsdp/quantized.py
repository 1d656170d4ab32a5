"""ZeRO++'s quantized weight all-gather (qwZ) as FSDP2's custom all-gather (`set_custom_all_gather`).

A unit's all-gather input is the flat concatenation of its parameters' shards in the gather dtype
(bf16 on GPU, fp32 on CPU), the same length on every rank. qwZ cuts it into blocks of
`parallel.zero_pp_block` elements, sends each block as int8 with one fp32 scale (its largest
magnitude / 127), and every rank dequantises what arrives into FSDP's output buffer. The sharded
fp32 weights the optimizer updates are never touched: only the gathered copies the forward and
backward compute with carry the rounding (at most half a step, largest magnitude / 254, per
element). Bytes per rank and call: n int8 + 4 n / block, against n x 2 (bf16) or n x 4 (fp32).
With hpz too, the backward's gather within the node reads the node-sharded copy the forward's
(quantised) gather left, and stays in the gather dtype: quantising it again would round twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...job.comm import all_gather_into

try:  # FSDP2's communication hooks (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - older torch: qwZ is refused at set-up
    AllGather = object

_LEVELS = 127.0


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per block) of the flat `x`, padded with zeros to whole blocks."""
    flat = x.reshape(-1).float()
    blocks = F.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
    scale = blocks.abs().amax(dim=1) / _LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
    q = torch.round(blocks / safe[:, None]).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return q.view(-1), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `numel` values of quantize_blocks' output, back in `dtype`."""
    block = q.numel() // scale.numel()
    return (q.view(-1, block).float() * scale[:, None]).view(-1)[:numel].to(dtype)


class QuantizedAllGather(AllGather):
    """qwZ: FSDP's all-gather in int8 blocks with fp32 scales (see the module docstring). Counts the
    calls and the bytes this rank sends (`sent_bytes`), and what plain FSDP would have sent."""

    def __init__(self, block: int, node_group: int = 0):
        super().__init__()
        self.block = block
        self.node_group = node_group  # under hpz: a gather within the node (backward's) stays exact
        self.calls = self.sent_bytes = self.plain_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        world, n = group.size(), input_tensor.numel()
        if world <= self.node_group:  # hpz's gather of the node-sharded copy: already dequantised once
            all_gather_into(output_tensor, input_tensor, group, "hpz_gather")
            self.calls += 1
            self.sent_bytes += n * input_tensor.element_size()
            self.plain_bytes += n * input_tensor.element_size()
            return None
        q, scale = quantize_blocks(input_tensor, self.block)
        gathered_q = q.new_empty(world * q.numel())
        gathered_scale = scale.new_empty(world * scale.numel())
        all_gather_into(gathered_q, q, group, "qwz_values")
        all_gather_into(gathered_scale, scale, group, "qwz_scales")
        parts = dequantize_blocks(gathered_q, gathered_scale, gathered_q.numel(), output_tensor.dtype)
        parts = parts.view(world, -1)[:, :n]
        output_tensor.view(world, n).copy_(parts)
        self.calls += 1
        self.sent_bytes += q.numel() + 4 * scale.numel()
        self.plain_bytes += n * input_tensor.element_size()
        return None  # done on the calling stream: nothing for FSDP to wait on
