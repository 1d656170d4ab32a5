"""Where the model states live (memory.model_states), and what a rank holds in host memory.

Per rank, bytes per parameter of the rank's share (predicted_model_state_bytes / 16: the FSDP
group's shard, the routed experts over every rank under expert parallelism):

- device: device 16 (fp32 weights, gradients, exp_avg, exp_avg_sq) + what FSDP gathers (world > 1);
  host 0; host link 0.
- host_optimizer: device 4 (fp32 weights) + the fp32 gradients on their way to the host (world 1, no
  FSDP: the largest block's, and the [vocab, dim] table's when tied: gradients_on_device), or
  4 + 4 (the shards' gradients, taken at the step) + FSDP's gathers (world > 1); host 16 (masters,
  gradients, two moments); host link per step: gradients down 4 per micro-batch, updated weights up 4.
- host: device only what FSDP gathers (two blocks, the root, one block's fp32 gradient), at world 1
  too (a one-rank FSDP group); host 16 (FSDP2's CPU offload: sharded weights, gradients, moments);
  host link per micro-batch: weights up 4 for the forward and 4 again for the backward,
  gradients down 4.

On CUDA the host tiers' fp32 weights and gradients are pinned, and torch's host allocator locks each
pinned request rounded up to a power of two (ops/pinned.py): under host_optimizer they are carved out of
power-of-two slabs (a few percent over), under host FSDP2 pins each shard by itself (host_state_bytes
counts each rounded: llama3-8b 1.05x of 16, small-100m 1.15x); the moments are ordinary memory. Nothing
is pinned on a CPU run: its figures are the exact bytes (what the RSS tests measure). The offloaded
activations and the attention core's offloaded state are pinned part by part (offloaded_host_bytes:
memory/host_parts.py lists the parts).

The AdamW step of both host tiers runs on the host's cores (torch's fused CPU AdamW), which the
node's ranks share: `Hardware.host_adam_gparams_per_s` is the node's rate. Clipping and the step
guard need the whole backward first, so no step overlaps the backward. Under host_optimizer
(step/host_optimizer.py) the gradients go down on a side stream during the backward, and at world
1 a worker thread steps the units in forward order, each unit's weights copied up as it is done,
while the next step's forward runs: each block waits only for its own unit, so the update and the
upload hide behind the next forward (as far as `comm_overlap` allows: 0 on a CPU, whose cores do
both); under FSDP the forward waits for the whole update (exposed). Under host the step follows the
backward (FSDP2's CPU offload; exposed) and FSDP prefetches each unit one block ahead, so its
copies hide behind compute as FSDP's gathers do.

`predicted_host_bytes` is a rank's host memory by part, the one figure the planner (host memory
per node) and the preflight (a run refused before work when its node's ranks would not fit) read:

- model_states: the tier's host states above;
- activations, attention_offload: offloaded activations and the attention core's offloaded state
  (memory/accounting.py estimate_activations' total_host, memory/transients.py
  attention_offload_host_and_traffic), given by the caller;
- checkpoint_staging: under checkpoint.async, DCP's stager keeps a host copy of what a save
  writes (fp32 weights and both moments: 12 bytes per parameter of the rank's share) between saves
  (on CUDA page-locked at their exact sizes by DefaultStager: checkpoint_staging_bytes);
- co2_checkpoint: under train.data_parallel = co2, a save's host copy of the rank's own CO2 state
  (costs/model_states.py co2_checkpoint_bytes: 24 or 28 bytes per parameter it averages);
- data_loader: the training loop holds this step's local batches while the read-ahead thread reads
  the next step's (data/loader.py: tokens, labels, positions and document ids, int64 each, for
  the rank's share of every micro-batch), and, while reading, the segment frames of the rank's
  whole rows (positions and document ids int64, the labelled mask) and the held positions.
"""

from __future__ import annotations

import functools
import math

from ..config import ModelConfig
from ..config.per_model import per_model
from ..memory.accounting import activation_dtype, estimate_activations
from ..memory.core_transients import attention_offload_host_and_traffic
from ..memory.expert_transients import shared_overlap_transient_bytes
from ..memory.hier_transients import hier_transient_bytes
from ..memory.host_parts import pinned_activation_bytes, pinned_attention_offload_bytes
from ..memory.policy import MemoryPolicy
from ..memory.transients import transient_bytes
from ..ops.pinned import pinned_bytes, pins, planned_pinned_bytes
from .hardware import Hardware
from .model_states import (
    _shard_numels,
    accumulated_grad_bytes,
    co2_checkpoint_bytes,
    co2_state_bytes,
    even_shards,
    gathered_param_bytes,
    param_counts,
    predicted_model_state_bytes,
)
from .shape import MeshShape
from .timing import exposed

TIERS = ("device", "host_optimizer", "host")  # config/schema.py MODEL_STATE_TIERS, cheapest to run first
HOST_STATE_BYTES = {"device": 0, "host_optimizer": 16, "host": 16}  # per parameter of the rank's share


def rank_params(m: ModelConfig, shape: MeshShape) -> float:
    """Parameters whose states one rank keeps (the FSDP shard; with expert parallelism the routed
    experts over every rank)."""
    return predicted_model_state_bytes(m, shape) / 16


def device_state_bytes(m: ModelConfig, shape: MeshShape, tier: str, gather_bytes: int,
                       bucket_blocks: int = 1) -> dict[str, float]:
    """{"model_states", "gathered_params"}: the tier's model-state bytes on one rank's device, FSDP's
    units `bucket_blocks` blocks each (parallel.grad_bucket_blocks)."""
    n = rank_params(m, shape)
    gathered = gathered_param_bytes(m, shape, gather_bytes, bucket_blocks=bucket_blocks)
    if tier == "device":
        return {"model_states": 16 * n, "gathered_params": gathered}
    if tier == "host_optimizer":
        if shape.world == 1:  # no FSDP: the weights, and the gradients on their way to the host
            return {"model_states": 4 * n + 4 * gradients_on_device(m), "gathered_params": 0.0}
        return {"model_states": 8 * n, "gathered_params": gathered}
    if tier == "host":
        return {"model_states": 0.0,
                "gathered_params": gathered_param_bytes(m, shape, gather_bytes, True, bucket_blocks)}
    raise ValueError(f"unknown model-state tier {tier!r}; one of {', '.join(TIERS)}")


def gradients_on_device(m: ModelConfig) -> int:
    """Gradient elements a one-rank host_optimizer run holds on its device beside a block's backward.
    step/host_optimizer.py takes each weight's gradient to the host as autograd accumulates it: the
    largest block's at most, and with tied embeddings the [vocab, dim] table's share from the LM head,
    which waits in autograd for the embedding's share (one leaf, accumulated once) from the head's
    backward to the end: beside every block's. (Counting the block's alone read llama3-1b 1.0 GiB under:
    tests/unit/test_planner_audit2_host_optimizer_root_grad.py.) An untied head's gradient is on the
    device only in the LM head's own backward, whose transient (memory/transients.py) does not count it.
    """
    block = param_counts(m)["block"]
    return block + m.vocab_size * m.dim if m.tie_embeddings else block


def head_grad_bytes(m: ModelConfig, shape: MeshShape, tier: str) -> float:
    """What a one-rank host_optimizer run holds in the LM head's backward beyond the model states'
    gradients (gradients_on_device): an untied head's fp32 [vocab, dim] gradient, on the device until its
    hook takes it, where it is larger than the block's counted there (memory/transients.py adds it to
    the LM head's phase only). 0 elsewhere: the device tier counts every gradient, FSDP takes the shards'."""
    if tier != "host_optimizer" or shape.world > 1 or m.tie_embeddings:
        return 0.0
    return 4.0 * max(0, m.vocab_size * m.dim - gradients_on_device(m))


@per_model
def _pinned_fp32_shards(m: ModelConfig, carved: bool, group: int, expert: int, expert_data: int, even: bool) -> int:
    """Host bytes pinned for one fp32 tensor per parameter shard: each by itself, rounded up to a power of
    two (torch's host allocator), or `carved` with a second such set out of power-of-two slabs (halved)."""
    sizes = [4 * k for k in _shard_numels(m, group, expert, expert_data, even)]
    if carved:
        return planned_pinned_bytes(sizes * 2) // 2
    return sum(pinned_bytes(s) for s in sizes)


def pinned_fp32_shard_bytes(m: ModelConfig, shape: MeshShape, carved: bool = False) -> int:
    """_pinned_fp32_shards for one rank of `shape`."""
    return _pinned_fp32_shards(m, carved, shape.fsdp if shape.world > 1 else 1, shape.expert, shape.expert_data,
                               even_shards(shape))


def host_state_bytes(m: ModelConfig, shape: MeshShape, tier: str, pinned: bool = False) -> float:
    """The tier's model-state bytes in one rank's host memory. `pinned` (a CUDA run; nothing is pinned on a
    CPU run): fp32 weights and gradients are pinned (AdamW's moments are not: the optimizer makes them
    with zeros_like, unpinned), as torch's host allocator pins them (ops/pinned.py): under host_optimizer
    carved out of power-of-two slabs (plan_slabs), under host each tensor's shard by itself, by FSDP2's
    CPU offload, its size rounded up to a power of two (both the weight shard and the gradient's copy)."""
    n = rank_params(m, shape)
    if not pinned or tier == "device":
        return HOST_STATE_BYTES[tier] * n
    return 2 * pinned_fp32_shard_bytes(m, shape, carved=tier == "host_optimizer") + 8 * n


def _grads_every_micro_batch(shape: MeshShape, grad_sync: str) -> bool:
    return grad_sync == "micro_batch" or shape.reduces_alone


def host_link_bytes(m: ModelConfig, shape: MeshShape, tier: str, grad_accum: int,
                    grad_sync: str = "step") -> dict[str, float]:
    """Bytes one rank moves over the host link per optimizer step for its model states: {"down",
    "up"} (device -> host, host -> device); {} under the device tier. Gradients go down after each
    micro-batch where they are reduced after each (memory.grad_sync = micro_batch, or one rank: no
    reduction to defer, step/gradients.py), else once, after the step's last."""
    n = rank_params(m, shape)
    down = 4 * n * (grad_accum if _grads_every_micro_batch(shape, grad_sync) else 1)
    if tier == "host_optimizer":
        return {"down": down, "up": 4 * n}
    if tier == "host":
        return {"down": down, "up": 8 * n * grad_accum}
    return {}


def host_adam_seconds(m: ModelConfig, shape: MeshShape, tier: str, hw: Hardware, ranks_per_node: int) -> float:
    """Seconds of the AdamW step on the host, whose cores the node's ranks share (0 under device)."""
    if tier == "device":
        return 0.0
    return adam_seconds(rank_params(m, shape), hw.host_adam_gparams_per_s, ranks_per_node)


def adam_seconds(params: float, gparams_per_s: float, ranks_per_node: int) -> float:
    """Seconds of a host AdamW step over a rank's `params` at the node's rate (1e9 parameters/s), which its
    ranks share."""
    rate = gparams_per_s * 1e9 / max(1, ranks_per_node)
    return params / rate if rate > 0 else float("inf")


def exposed_host_state_seconds(m: ModelConfig, shape: MeshShape, tier: str, hw: Hardware, grad_accum: int,
                               forward_s: float, backward_s: float, ranks_per_node: int,
                               grad_sync: str = "step") -> dict[str, float]:
    """Seconds per optimizer step the model states' tier adds: {"host_link", "host_adam"} (module
    docstring: what hides behind what). forward_s, backward_s: one micro-batch's compute (the
    backward with its recomputation)."""
    if tier == "device":
        return {"host_link": 0.0, "host_adam": 0.0}
    link = hw.host_link_gbps * 1e9
    moved = host_link_bytes(m, shape, tier, grad_accum, grad_sync)
    adam = host_adam_seconds(m, shape, tier, hw, ranks_per_node)
    if tier == "host":
        return {"host_link": exposed((moved["down"] + moved["up"]) / link, grad_accum * (forward_s + backward_s), hw),
                "host_adam": adam}
    behind = grad_accum * backward_s if _grads_every_micro_batch(shape, grad_sync) else backward_s
    down = exposed(moved["down"] / link, behind, hw)  # beside the backward(s) that send them
    if shape.world > 1:  # FSDP gathers before any hook of ours: the forward waits for the whole update
        return {"host_link": down + moved["up"] / link, "host_adam": adam}
    # world 1: the update, then each unit's upload, beside the next step's first forward
    hidden_adam = exposed(adam, forward_s, hw)
    return {"host_link": down + exposed(moved["up"] / link, forward_s - min(forward_s, adam), hw),
            "host_adam": hidden_adam}


def data_loader_bytes(seq_len: int, micro_batch: int, grad_accum: int, sequence_degree: int,
                      doc_mask: bool = True) -> float:
    """Host bytes of the data loader per rank: two steps of local batches (int64 tokens, labels,
    positions and, with document masks, document ids), and the frames of one micro-batch being read
    (positions and document ids int64 and the labelled mask over the whole rows, the held positions)."""
    local = micro_batch * seq_len // max(1, sequence_degree)
    per_token = 8 * (4 if doc_mask else 3)
    held = 2 * grad_accum * local * per_token
    reading = micro_batch * seq_len * (8 * (2 if doc_mask else 1) + 1) + 8 * local
    return float(held + reading)


def checkpoint_staging_bytes(m: ModelConfig, shape: MeshShape, async_save: bool, pinned: bool = False) -> float:
    """DCP's reusable host staging under checkpoint.async: fp32 weights and both AdamW moments. `pinned` (a
    CUDA run: checkpoint/background.py stages into pinned memory): its DefaultStager (torch's StateDictStager)
    allocates ordinary storages of the exact size and page-locks them in place (cudaHostRegister): nothing
    rounded. Only a torch without DefaultStager (DCP's own staging, `.to("cpu")` per tensor) goes through
    torch's host allocator, each tensor rounded up to a power of two (ops/pinned.py)."""
    if not async_save:
        return 0.0
    if not pinned or stager_registers():
        return 12 * rank_params(m, shape)
    return 3 * pinned_fp32_shard_bytes(m, shape)


@functools.cache
def stager_registers() -> bool:
    """Whether checkpoint/background.py's reusable_stager is torch's DefaultStager (page-locks exact sizes)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError:
        return False
    return True


def offloaded_host_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, *, seq_len: int, micro_batch: int,
                         act_bytes: int, dtype_bytes: int, activations: float, attention: float, docs: bool,
                         pinned: bool, expert_skew: float = 1.0, autocast: bool = False) -> tuple[float, float]:
    """(offloaded activations, the attention core's offloaded state) in one rank's host memory, from their
    exact bytes (`activations`: estimate_activations' total_host at `act_bytes` per element, `attention`:
    attention_offload_host_and_traffic's at `dtype_bytes`). `pinned` (a CUDA run): each part the offloader or
    the ChunkStore copies out is one pinned request, locked rounded up to a power of two (memory/host_parts.py;
    a [74752, 4096] bf16 part of 612 MB locks 1 GiB), so the figures are those rounded sums. `autocast`
    (activation_dtype's second value): each part at its own dtype, as `activations` counts them."""
    if not pinned:
        return activations, attention
    kw = {"head": shape.head, "ctx": shape.ctx, "policy": policy}
    acts = pinned_activation_bytes(m, seq_len, micro_batch, dtype_bytes=act_bytes, docs=docs, expert=shape.expert,
                                   expert_skew=expert_skew, autocast=autocast, expert_replicas=shape.expert_replicas,
                                   expert_ranks_per_node=shape.expert_ranks_per_node,
                                   **kw) if activations else 0.0
    attn = pinned_attention_offload_bytes(m, seq_len, micro_batch, dtype_bytes=dtype_bytes, **kw) if attention else 0.0
    return acts, attn


def predicted_host_bytes(m: ModelConfig, shape: MeshShape, tier: str, *, seq_len: int, micro_batch: int,
                         grad_accum: int, offloaded_activations: float = 0.0, attention_offload: float = 0.0,
                         doc_mask: bool = True, async_checkpoint: bool = False,
                         co2_momentum: bool = False, pinned: bool = False) -> dict[str, float]:
    """One rank's host memory by part (the module's docstring) and their "total". pinned: a CUDA run's
    (host_state_bytes: the pinned model states as torch's host allocator locks them)."""
    fixed = host_parts_but_offloaded(m, shape, tier, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                                     doc_mask=doc_mask, async_checkpoint=async_checkpoint, co2_momentum=co2_momentum,
                                     pinned=pinned)
    return host_bytes_with(fixed, offloaded_activations, attention_offload)


def host_parts_but_offloaded(m: ModelConfig, shape: MeshShape, tier: str, *, seq_len: int, micro_batch: int,
                             grad_accum: int, doc_mask: bool = True, async_checkpoint: bool = False,
                             co2_momentum: bool = False, pinned: bool = False) -> tuple[float, float, float, float]:
    """predicted_host_bytes' parts that no memory policy changes (model_states, checkpoint_staging,
    co2_checkpoint, data_loader): the planner keeps them per layout, tier and micro-batch."""
    return (host_state_bytes(m, shape, tier, pinned), checkpoint_staging_bytes(m, shape, async_checkpoint, pinned),
            co2_checkpoint_bytes(m, shape, co2_momentum),
            data_loader_bytes(seq_len, micro_batch, grad_accum, shape.sequence_degree, doc_mask))


def host_bytes_with(fixed: tuple[float, float, float, float], offloaded_activations: float,
                    attention_offload: float) -> dict[str, float]:
    """predicted_host_bytes from host_parts_but_offloaded and the offloaded bytes: the parts in their order, summed
    in it."""
    states, staging, co2, loader = fixed
    parts = {"model_states": states, "activations": float(offloaded_activations),
             "attention_offload": float(attention_offload), "checkpoint_staging": staging, "co2_checkpoint": co2,
             "data_loader": loader}
    parts["total"] = sum(parts.values())
    return parts


FOREACH_ADAMW_TEMP = 4  # bytes per parameter: the foreach AdamW's sqrt of the second moments, during its step


def one_memory_bytes(m: ModelConfig, shape: MeshShape, tier: str, device: dict[str, float],
                     host: dict[str, float], grad_accum: int = 1) -> float:
    """A CPU run's peak, its device being host memory: device["total"] + host["total"], where the two
    parts' peaks are known not to meet, or where a CPU run holds what a GPU's does not, corrected:

    - host: the rank's gradients (FSDP2's CPU offload, 4 per parameter) exist from the backward to
      zero_grad, while the saved activations are freed block by block as the backward reaches them,
      so one memory holds the larger of the two at either end of the backward, not both (with
      grad_accum > 1 the first micro-batch's gradients stay through the next forward: both);
    - device: a CPU run's AdamW is the foreach one (step/optimizer.py; fused on a GPU), whose step
      holds a temporary copy of the second moments (4 per parameter) when the activations are gone:
      the peak is the larger of the backward's (the sum, gradients beside activations: the kept heap
      of job/host_malloc.py holds the activations' freed blocks) and the step's (16 + 4);
    - host_optimizer: the host's gradient buffers are allocated once and meet the activations: the sum.
    """
    n = rank_params(m, shape)
    if tier == "host" and grad_accum == 1:
        return device["total"] + host["total"] - min(4 * n, device["activations"])
    if tier == "device":
        return max(device["total"], (16 + FOREACH_ADAMW_TEMP) * n) + host["total"]
    return device["total"] + host["total"]


def hpz_copy_bytes(m: ModelConfig, shape: MeshShape, gather_bytes: int) -> float:
    """parallel.zero_pp = hpz: after its forward every block unit keeps its weights sharded over the
    node (1 / node of them per rank, in the gather dtype; 1 / hpz_ranks on a group inside the node) until
    its backward gathers them again. Under expert parallelism the routed experts are units of their own
    over the expert-data group that keep plain resharding (parallel/fsdp/shard.py): no copy of them."""
    pc = param_counts(m)
    blocks = pc["total"] - pc["root"] - (pc["experts"] if shape.expert > 1 else 0)
    return blocks * gather_bytes / max(shape.hpz_ranks or shape.node, 1)


@per_model
def _state_parts(m: ModelConfig, shape: MeshShape, tier: str, grad_sync: str, grad_accum: int,
                 gather_bytes: int, bucket_blocks: int) -> tuple[tuple[str, float], ...]:
    """device_bytes' parts before the activations, in its order, remembered: the planner asks them of
    every memory policy of a layout."""
    memory = device_state_bytes(m, shape, tier, gather_bytes, bucket_blocks)
    if "hpz" in shape.zero_pp.split(","):  # each block unit's node-sharded copy, kept from forward to backward
        memory["gathered_params"] = memory.get("gathered_params", 0.0) + hpz_copy_bytes(m, shape, gather_bytes)
    accumulated = accumulated_grad_bytes(m, shape, grad_accum, grad_sync)
    if accumulated:
        memory["accumulated_grads"] = accumulated
    return tuple(memory.items())


def device_bytes(m: ModelConfig, shape: MeshShape, tier: str, grad_sync: str, grad_accum: int, gather_bytes: int,
                 activations: float, transient: float, bucket_blocks: int = 1,
                 co2_momentum: bool = False) -> dict[str, float]:
    """One rank's device bytes by part and their "total": the tier's model states and FSDP's gathers
    (units of `bucket_blocks` blocks: parallel.grad_bucket_blocks), the unsharded gradients accumulated
    under grad_sync "step" (only where there are any), under co2 its outer state (the round's start, the
    outer model, the change in flight, and the outer momentum with `co2_momentum`), the saved activations
    and the backward's transient on top of them (with the weights' gradients summed over a block's pieces,
    memory.block_chunk's among them: memory/weight_grads.py weight_grad_sum_bytes)."""
    before = device_parts_before_activations(m, shape, tier, grad_sync, grad_accum, gather_bytes, bucket_blocks,
                                             co2_momentum)
    return device_bytes_with(before, activations, transient)


def device_parts_before_activations(m: ModelConfig, shape: MeshShape, tier: str, grad_sync: str, grad_accum: int,
                                    gather_bytes: int, bucket_blocks: int = 1,
                                    co2_momentum: bool = False) -> tuple[tuple[str, float], ...]:
    """device_bytes' parts that no memory policy but its grad_sync changes, in its order: the model states,
    FSDP's gathers, the accumulated gradients, co2's state. The planner keeps them per layout, tier, gradient
    sync and micro-batch."""
    parts = _state_parts(m, shape, tier, grad_sync, grad_accum, gather_bytes, bucket_blocks)
    co2 = co2_state_bytes(m, shape, co2_momentum)
    return parts + ((("co2_state", co2),) if co2 else ())


def device_bytes_with(before: tuple[tuple[str, float], ...], activations: float, transient: float) -> dict[str, float]:
    """device_bytes from device_parts_before_activations, the activations and the transient: the parts in their
    order, summed in it."""
    memory = dict(before)
    memory["activations"] = activations
    memory["transient"] = transient
    memory["total"] = sum(memory.values())
    return memory


def predicted_rank_bytes(m: ModelConfig, shape: MeshShape, policy: MemoryPolicy, tier: str, *, seq_len: int,
                         micro_batch: int, grad_accum: int, dtype_bytes: int, doc_mask: bool = True,
                         async_checkpoint: bool = False, offload_cap: float = math.inf, bucket_blocks: int = 1,
                         co2_momentum: bool = False,
                         device_type: str = "cuda") -> tuple[dict[str, float], dict[str, float]]:
    """(device bytes, host bytes) of one rank of a run, each by part with its "total", from the
    activation formulas (memory/accounting.py, memory/transients.py) and the tier: what the
    preflight checks against free host memory and benchmarks/host_bytes.py against RSS.
    offload_cap: the most offloaded activations may take (memory.offload_fraction auto's bound);
    bucket_blocks, co2_momentum: device_bytes'; device_type: where it runs (activation_dtype: bf16 on CPU is
    autocast over fp32 weights at any world size; "cuda": the pinned host bytes as torch locks them)."""
    kw = {"head": shape.head, "ctx": shape.ctx, "policy": policy, "dtype_bytes": dtype_bytes}
    # (one process off the host tier in bf16: autocast over fp32 weights, activations and the backward's
    # transient counted by each tensor's dtype, the residual stream at 4 B and the matmuls' outputs at 2 B
    # (`copies`: autocast), as the planner counts them: planner/activation_costs.py rank_activations)
    act_bytes, copies = activation_dtype(dtype_bytes == 2, shape.world, tier, device_type)
    acts_kw = {**kw, "dtype_bytes": act_bytes}
    acts = estimate_activations(m, seq_len, micro_batch, docs=doc_mask, expert=shape.expert, autocast=copies,
                                expert_replicas=shape.expert_replicas,
                                expert_ranks_per_node=shape.expert_ranks_per_node, **acts_kw)
    transient = transient_bytes(m, seq_len, micro_batch, window=shape.window, docs=doc_mask, acts=acts,
                                autocast=copies, head_grad=head_grad_bytes(m, shape, tier), **acts_kw)
    transient += shared_overlap_transient_bytes(m, acts.tokens, shape.expert, policy, act_bytes, copies)
    transient += hier_transient_bytes(m, acts.tokens, shape.expert, shape.expert_ranks_per_node, policy, act_bytes,
                                      autocast=copies)
    attn_host, _ = attention_offload_host_and_traffic(m, seq_len, micro_batch, **kw)
    acts_host, attn_host = offloaded_host_bytes(m, shape, policy, seq_len=seq_len, micro_batch=micro_batch,
                                                act_bytes=act_bytes, dtype_bytes=dtype_bytes,
                                                activations=acts.total_host, attention=attn_host, docs=doc_mask,
                                                pinned=pins(device_type), autocast=copies)
    device = device_bytes(m, shape, tier, policy.grad_sync, grad_accum, dtype_bytes, acts.total_device, transient,
                          bucket_blocks, co2_momentum)
    host = predicted_host_bytes(m, shape, tier, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                                offloaded_activations=min(acts_host, offload_cap), attention_offload=attn_host,
                                doc_mask=doc_mask, async_checkpoint=async_checkpoint, co2_momentum=co2_momentum,
                                pinned=pins(device_type))
    return device, host
