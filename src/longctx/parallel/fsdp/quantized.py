"""ZeRO++'s quantized collectives as FSDP2's custom communications: the weight all-gather (qwZ,
`set_custom_all_gather`) and the gradient reduce-scatter (qgZ, `set_custom_reduce_scatter`,
QuantizedReduceScatter below).

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

from ...job.comm import all_gather_into, all_to_all, reduce_scatter_into
from ...models.compile import compile_failure

try:  # FSDP2's communication hooks (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin, DefaultReduceScatter
except ImportError:  # pragma: no cover - older torch: qwZ and qgZ are refused at set-up
    AllGather = ReduceScatter = DefaultAllocMixin = DefaultReduceScatter = object

_LEVELS = 127.0
_TOP = torch.finfo(torch.float32).max


def _largest_scale() -> float:
    """The largest fp32 scale whose level 127 dequantises finite: fp32's largest value / 127, rounded down."""
    scale = torch.tensor(torch.finfo(torch.float32).max / _LEVELS, dtype=torch.float32)
    while not torch.isfinite(scale * _LEVELS):
        scale = torch.nextafter(scale, torch.zeros(()))
    return scale.item()


_MAX_SCALE = _largest_scale()


def _quantize_rows(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., block] -> (int8 [..., block], fp32 scale [...]: each block's largest magnitude / 127)."""
    blocks = blocks.float()
    # (no |x| copy: one read). abs: an all-zero block holding a -0.0 had the scale -0.0, and every +0.0 came back -0.0
    scale = (torch.maximum(blocks.amax(dim=-1), -blocks.amin(dim=-1)) / _LEVELS).abs()
    # a finite block within an fp32 ulp of fp32's largest value: its scale rounded up, 127 x it overflowed, and
    # the finite value came back inf (the step's guard then skipped it). Capped, it comes back within an ulp; an
    # inf keeps its inf scale (and a nan its nan), so a non-finite block still comes back non-finite
    scale = torch.where(scale.isinf(), scale, scale.clamp(max=_MAX_SCALE))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
    levels = torch.round(blocks / safe[..., None]).clamp_(-_LEVELS, _LEVELS)
    # a non-finite block's nan ratios (a nan, inf / inf) as level 0, so that level x its nan or inf scale is nan
    # from both kernels: the cast of a nan to int8 is undefined, 0 in eager and -128 from inductor on CPU, whose
    # -128 x inf came back -inf for an inf (and a level outside +-127)
    return levels.nan_to_num_(0.0).to(torch.int8), scale


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def _dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """out [r, n] (n <= blocks x block) := the first n values of each row of q [r, blocks, block]."""
    out.copy_((q.float() * scale[..., None]).flatten(1)[:, :out.shape[1]])


def _dequantize_sum(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [k, blocks, block], scale [k, blocks] -> the k rows' values summed, fp32 [blocks x block]. qgZ passes
    scales times its headroom (`_headroom`), so that no partial sum can overflow fp32."""
    return (q.float() * scale[..., None]).sum(0).flatten()


def _headroom(scale: torch.Tensor) -> torch.Tensor:
    """The power of two (0-d fp32, at most 1) that qgZ multiplies the scales of the k rows it received, `scale`
    [k, blocks], by before summing them in fp32: 1 where no block's sum can pass half of fp32's largest value
    (its rows' largest magnitudes, 127 x their scales, added), the largest sum's power below it otherwise. k
    gradients near fp32's largest value summed as they are came back inf where their exact sum is finite; a
    power of two moves only exponents, so the sum is the same but for fp32's subnormals (a value under 2^-126 x
    the headroom's inverse loses its lowest bits). A non-finite block is left out: it comes back nan anyway."""
    bound = (scale.double() * _LEVELS).sum(0).nan_to_num_(0.0, 0.0, 0.0)
    most = F.pad(bound, (0, 1)).max()  # (a zero for a row of no blocks)
    return torch.exp2(-(most / (_TOP / 2)).log2().ceil().clamp_(min=0.0)).float()


_KERNELS = {"quantize": _quantize_rows, "dequantize_into": _dequantize_into, "dequantize_sum": _dequantize_sum}
_compiled: dict[str, object] = {}


def _kernel(name: str, compiled: bool):
    """The eager function, or its torch.compile'd twin, dynamic in the number of blocks and rows (units
    of any size reuse a graph; a new dtype, a padded shard or a one-block shard compile another, a
    bounded handful per process). The compiled one fuses the passes the eager ops make over the data
    (maximum, division, rounding, clamp and cast: one read, one write; dequantisation into FSDP's
    buffer or summed over the node's rows without an fp32 copy of each): about 5x the eager rate on
    one CPU core, the same values bit for bit on CPU (tests/unit/test_zero_pp_quant.py). Not on a card
    (benchmarks/zero_pp_kernels.py on an H200, 2026-12-04: 516 / 467 GB/s, not bit-identical to eager):
    the generated kernel's fp32 division need not round as eager's does, so a value at a rounding boundary
    may land one int8 level apart (still within half a step of the scale, plus an ulp). Every rank runs
    the same kernels, so the ranks still agree; dividing by multiplying with an eager reciprocal would
    restore the identity at the cost of a second read of the data (left: a one-level difference at a
    boundary is within qwZ's own rounding)."""
    eager = _KERNELS[name]
    if not compiled:
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(eager, dynamic=True)
    return _compiled[name]


def use_compiled(kernels: str, device_type: str) -> bool:
    """parallel.zero_pp_kernels: compiled, eager, or auto (compiled on CUDA, eager elsewhere: a CPU run
    needs a C++ compiler for inductor and pays seconds of compilation per process)."""
    return kernels == "compiled" or (kernels == "auto" and device_type == "cuda")


def warm_up(device: torch.device, dtype: torch.dtype, block: int) -> None:
    """Compile the kernels a run uses (the gather dtype's, whole and padded shards, a node's rows) on
    small tensors at set-up, so that a machine that cannot compile them (no C++ compiler for a CPU's
    inductor, no Triton on a card) is one clear error before the first step, not a failure inside
    FSDP's first all-gather on every rank, and the first step does not compile inside FSDP's hooks."""
    try:
        for tail in (0, 1):  # a shard of whole blocks, and one padded to them
            x = torch.randn(4 * block - tail, device=device).to(dtype)
            q, scale = quantize_blocks(x, block, True)  # a gather's shard (2-D blocks)
            rows, row_scales = q.view(2, -1, block), scale.view(2, -1)  # as 2 ranks' rows arrive
            out = torch.empty(2, 2 * block - tail, device=device, dtype=dtype)
            _kernel("dequantize_into", True)(out, rows, row_scales)
            _kernel("dequantize_sum", True)(rows, row_scales)
            _kernel("quantize", True)(_whole_blocks(out.float(), block))  # a node's rows (3-D blocks)
    except Exception as e:  # noqa: BLE001 - whatever the compiler stack raises, the fix is the setting
        raise compile_failure(f"parallel.zero_pp_kernels: torch.compile could not build ZeRO++'s int8 kernels on "
                              f"{device.type}", e, "set --parallel.zero_pp_kernels eager (the same values, slower), "
                              "or install what the compiler needs (a C++ compiler for a CPU's inductor).") from e


def _whole_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., m] -> [..., blocks, block], the last dim padded with zeros to whole blocks (no copy when
    it is whole already and x is contiguous)."""
    pad = (-x.shape[-1]) % block
    return (F.pad(x, (0, pad)) if pad else x).reshape(*x.shape[:-1], -1, block)


def quantize_blocks(x: torch.Tensor, block: int, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per block) of the flat `x`, padded with zeros to whole blocks."""
    q, scale = _kernel("quantize", compiled)(_whole_blocks(x.reshape(-1), block))
    return q.view(-1), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `numel` values of quantize_blocks' output, back in `dtype` (the reference the hooks'
    kernels are tested against; the hooks dequantise in place: _dequantize_into, _dequantize_sum)."""
    block = q.numel() // scale.numel()
    return _dequantize_rows(q.view(-1, block), scale).view(-1)[:numel].to(dtype)


class QuantizedAllGather(DefaultAllocMixin, AllGather):
    """qwZ: FSDP's all-gather in int8 blocks with fp32 scales (see the module docstring). Counts the
    calls and the bytes this rank sends (`sent_bytes`), and what plain FSDP would have sent."""

    def __init__(self, block: int, node_group: int = 0, compiled: bool = False):
        super().__init__()
        self.block, self.compiled = block, compiled
        self.node_group = node_group  # under hpz: a gather within the node (backward's) stays exact
        self.calls = self.sent_bytes = self.plain_bytes = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        world, n = group.size(), input_tensor.numel()
        # hpz's gather of the node-sharded copy: already dequantised once. Or a unit whose parameters differ
        # in dtype, which FSDP2 gathers as raw bytes (uint8): quantising those would scramble every value
        if world <= self.node_group or not input_tensor.is_floating_point():
            all_gather_into(output_tensor, input_tensor, group, "hpz_gather")
            self.calls += 1
            self.sent_bytes += n * input_tensor.element_size()
            self.plain_bytes += n * input_tensor.element_size()
            return None
        q, scale = quantize_blocks(input_tensor, self.block, self.compiled)
        packed = pack_blocks(q, scale)  # one collective for values and scales: half the calls
        gathered = packed.new_empty(world * packed.numel())
        all_gather_into(gathered, packed, group, "qwz")
        got_q, got_scale = unpack_blocks(gathered.view(world, -1), q.numel())  # [world, ...] each
        _kernel("dequantize_into", self.compiled)(output_tensor.view(world, n), got_q.view(world, -1, self.block),
                                                  got_scale)
        self.calls += 1
        self.sent_bytes += q.numel() + 4 * scale.numel()
        self.plain_bytes += n * input_tensor.element_size()
        return None  # done on the calling stream: nothing for FSDP to wait on


class QuantizedReduceScatter(DefaultAllocMixin, ReduceScatter):
    """qgZ: FSDP's gradient reduce-scatter as two int8 all-to-alls, within the node first (ZeRO++'s
    hierarchical scheme). FSDP hands the flat gradients [group x n], chunk r for group rank r; the
    group's ranks are nodes of consecutive ranks, `mesh` ("inter", "intra") over them.

    1. within the node, each rank sends the chunks bound for local index b' (one per node) to its
       node peer b', quantised; each rank dequantises and sums its node's contributions;
    2. across nodes, among the ranks of one local index, each sends the node sum bound for node a'
       there, quantised; each rank dequantises and sums: its own chunk, over every rank.
    Only summed values cross the slow link, once, as int8 plus a scale per block. Each sum is taken in fp32
    times a power of two (`_headroom`: 1 unless gradients near fp32's largest value could overflow it), so the
    output is inf only where the sum itself passes the gradients' dtype's largest value (`saturate`). (float64
    sums, 2026-12-07, took 1.7-2.5x the time of a 64M-element unit's reduce-scatter on one CPU core, and twice
    its transient bytes.)"""

    def __init__(self, block: int, mesh, compiled: bool = False):
        super().__init__()
        self.block, self.mesh, self.compiled = block, mesh, compiled
        self.size = mesh["inter"].size() * mesh["intra"].size()
        self._plain = DefaultReduceScatter()
        self._ours: dict[str, bool] = {}  # process group name -> is it this rank's FSDP group

    def _is_fsdp_group(self, group: dist.ProcessGroup) -> bool:
        """Whether `group` is this rank's FSDP group, in the order the node mesh splits it. Its size
        alone does not say: an expert unit's expert-data group (ranks at a stride) has the FSDP group's
        size when parallel.expert = dp_replicate, and reducing over the node mesh would then sum other
        ranks' gradients."""
        name = group.group_name
        if name not in self._ours:
            rank, grid = dist.get_rank(), self.mesh.mesh.reshape(self.mesh.mesh.shape[0], -1).tolist()
            mine = next((row for row in grid if rank in row), None)
            self._ours[name] = group.size() == self.size and dist.get_process_group_ranks(group) == mine
        return self._ours[name]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if not self._is_fsdp_group(group):  # an expert unit's group: FSDP's own reduce-scatter
            return self._plain(output_tensor, input_tensor, group, op, async_op)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(f"qgz reduces with SUM or AVG, FSDP asked for {op}")
        inter, intra = self.mesh["inter"], self.mesh["intra"]
        nodes, local, n = inter.size(), intra.size(), output_tensor.numel()
        chunks = input_tensor.view(nodes, local, n).transpose(0, 1)  # [bound for local b', node a', n]
        node_sum, headroom = self._exchange(chunks.reshape(local, nodes * n), intra, "qgz_intra")
        total, headroom = self._exchange(node_sum.view(nodes, n), inter, "qgz_inter", headroom)
        band = rounding_band(self.size, (local > 1) + (nodes > 1), input_tensor.dtype)
        divide = self.size if op == dist.ReduceOp.AVG else 1
        flat, dtype = output_tensor.view(-1), output_tensor.dtype
        if dtype == torch.float32:
            saturate(total, headroom, band / divide, divide, dtype, out=flat)
        else:
            flat.copy_(saturate(total, headroom, band / divide, divide, dtype))
        return None

    def _exchange(self, parts: torch.Tensor, mesh, label: str, headroom: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """parts [k, m], values times `headroom` (a power of two; None: 1): row i to group rank i as int8 blocks,
        values and the scales of the values themselves in one message. Returns the sum of the k rows received
        times its own headroom (`_headroom`), fp32 [m], and that headroom."""
        k, m = parts.shape
        if k == 1:
            return parts[0].float(), torch.ones((), device=parts.device) if headroom is None else headroom
        q, scale = _kernel("quantize", self.compiled)(_whole_blocks(parts, self.block))  # each row whole blocks
        if headroom is not None:
            scale = scale / headroom  # (exact: a power of two; a node's sum is at most `local` x fp32's largest)
        packed = pack_blocks(q.view(k, -1), scale)  # a row per peer
        got_q, got_scale = unpack_blocks(all_to_all(packed, mesh, label), q[0].numel())
        headroom = _headroom(got_scale)
        total = _kernel("dequantize_sum", self.compiled)(got_q.view(k, -1, self.block), got_scale * headroom)
        return total[:m], headroom


def rounding_band(size: int, exchanges: int, dtype: torch.dtype) -> float:
    """How far qgZ's sum over `size` ranks may lie from the exact sum of `dtype` gradients: each exchange moves
    each summand by at most half a step of its block (within the node, `size` gradients' steps in all, each at
    most dtype's largest value / 127; across nodes, `nodes` node sums' of up to `local` gradients each), plus
    fp32's own rounding of the sums (a relative 2^-24 per term)."""
    return size * torch.finfo(dtype).max * exchanges * (1 / (2 * _LEVELS) + size * 2.0 ** -23)


def saturate(total: torch.Tensor, headroom: torch.Tensor, band: float, divide: int, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """qgZ's output, fp32 (into `out` if given) with `dtype`'s range: `total` (fp32 sums times `headroom`, a power
    of two) divided by `divide` (AVG: the group's size). A sum that int8 rounding carried past dtype's largest
    value by at most `band` comes back as that value (its exact sum may lie within it; fp32's own reduce-scatter
    returns inf only past it), one further as inf, as dtype's own sum gives; nan as it is."""
    top = torch.finfo(dtype).max
    divisor = headroom * divide  # (exact: a power of two times the group's size)
    edge = ((top + band) * divisor.double()).float()  # in `total`'s units (inf where past fp32's largest: all in)
    high, low = total > edge, total < -edge  # (nan: neither)
    value = torch.div(total, divisor, out=out)  # (inf where the sum passes fp32's largest value)
    # in place and masked: where(|total| <= edge, ...) took 4 passes more, each a fresh buffer of the shard
    return value.clamp_(-top, top).masked_fill_(high, float("inf")).masked_fill_(low, -float("inf"))


def pack_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_blocks' values and scales as one byte buffer, values first (row by row for 2-D ones)."""
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def unpack_blocks(packed: torch.Tensor, values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of pack_blocks' buffers [r, bytes] -> (int8 values [r, values], a view of the buffer; fp32
    scales [r, blocks], copied: a row's scales need not start 4-byte aligned)."""
    scales = packed[:, values:].clone(memory_format=torch.contiguous_format)  # (one row's slice is no copy)
    return packed[:, :values].view(torch.int8), scales.view(torch.float32)


class CountedAllGather(DefaultAllocMixin, AllGather):
    """FSDP's all-gather in full precision through job/comm.py: what a benchmark's emulated link
    (bench/emulated_link.py) paces and counts when qwz is off (parallel/fsdp/shard.py installs it only
    under a link hook; training keeps FSDP's own)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        all_gather_into(output_tensor, input_tensor, group, "fsdp_gather")
        return None


class CountedReduceScatter(DefaultAllocMixin, ReduceScatter):
    """FSDP's gradient reduce-scatter in full precision through job/comm.py (see CountedAllGather)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        reduce_scatter_into(output_tensor, input_tensor, group, op, "fsdp_reduce")
        return None
