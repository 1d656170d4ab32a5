"""Full recomputation with checkpoint offload (memory.recompute = full, offload_fraction 1.0, chunked
blocks / attention / loss, bf16 autocast over fp32 weights: issue 49's llama3-8b blocks probe, scaled
down): depth must not change the device peak.

The H200 run (docs/results/gpu_frontier_nvidia-h200_2026-12-04_rerun.json) peaked 9.63 GiB higher with
4 layers than with 2: the fp32 weights of two blocks (by design, 0.81 GiB each) and one 8 GiB block
input, the block before's, prefetched from the start of each offloaded block's backward, so sitting
beside that block's peak (with 2 layers no block has an offloaded one before it to prefetch).
memory/offload.py now brings it back after the block's attention core has run backward.

On CPU the offloader uses a host part where it is; `_fetch` is made a copy here, as the device copy
on CUDA is, so the live bytes outside the host tier are what a GPU's device would hold."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model
from longctx.ops.chunked import ChunkedLocalCore
from longctx.step.host_optimizer import HostOptimizer, forward_units
from longctx.step.loss import forward_loss_sum

SEQ, DIM, CHUNK = 1024, 64, 128
HIDDEN = SEQ * DIM * 4  # one fp32 block input (the residual stream under autocast over fp32 weights)


class DeviceLive(TorchDispatchMode):
    """The most bytes alive after any op, among the storages the mode saw made, less the host tier's."""

    def __init__(self, host_ptrs):
        super().__init__()
        self.held, self.host_ptrs, self.peak = {}, host_ptrs, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.held.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        self.held = {p: s for p, s in self.held.items() if torch._C._storage_Use_Count(s._cdata) > 1}
        host = self.host_ptrs()
        self.peak = max(self.peak, sum(s.nbytes() for p, s in self.held.items() if p not in host))
        return out


class _Batch:
    def __init__(self, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (1, SEQ), generator=g)
        self.labels = torch.randint(0, vocab, (1, SEQ), generator=g)
        self.positions = torch.arange(SEQ)[None]
        self.doc_ids = torch.zeros(1, SEQ, dtype=torch.long)
        self.doc_ids[:, SEQ // 3:] = 1


def _model(layers: int):
    cfg = load_config(None, {"model": {"preset": "debug", "dim": DIM, "layers": layers, "heads": 4, "kv_heads": 1,
                                       "head_dim": 16, "ffn_dim": DIM * 7 // 2, "vocab_size": 128}})
    model = build_model(cfg.model, seed=0)
    for block in model.layers:
        block.attention.core = ChunkedLocalCore(CHUNK)
    offloader = apply_memory_policy(model.layers, "full", 1.0, offload_skip_last=1, block_chunk=CHUNK)
    model.loss_chunk = CHUNK
    # memory.model_states = host_optimizer: each gradient leaves the device as autograd finishes it
    model.host_optimizer = HostOptimizer([{"params": list(model.parameters())}], forward_units(model), lr=1e-3)
    return model, offloader


def _device_copies(offloader, log=None):
    """The offloader's host parts come back as copies of their own (what CUDA's `.to(device)` makes);
    returns the counts of parts fetched and of those a prefetch had brought back before their unpack."""
    counts = {"fetched": 0, "prefetched": 0}
    take = offloader._host_part_on_device

    def fetch(host):
        counts["fetched"] += 1
        return host.clone()

    def host_part_on_device(saved):
        counts["prefetched"] += saved.prefetched is not None
        if log is not None:
            log.append(("unpack", saved.block))
        return take(saved)

    offloader._fetch = fetch
    offloader._host_part_on_device = host_part_on_device
    return counts


def _peak(layers: int) -> tuple[int, dict, float]:
    model, offloader = _model(layers)
    counts = _device_copies(offloader)
    mode = DeviceLive(offloader.host_storage_ptrs)
    with mode:
        loss = forward_loss_sum(model, _Batch(128), torch.bfloat16)
        loss.backward()
    return mode.peak, counts, loss.item()


def test_depth_leaves_the_device_peak_as_it_is():
    peaks, prefetched = {}, {}
    for layers in (2, 4):
        peaks[layers], counts, _ = _peak(layers)
        assert counts["fetched"] == layers - 1  # each offloaded block input came back as a device copy
        prefetched[layers] = counts["prefetched"]
    # before: 4 layers held one more block input (HIDDEN) at the peak than 2 (the block before's,
    # prefetched through an offloaded block's whole backward)
    assert abs(peaks[4] - peaks[2]) < HIDDEN // 8, (peaks, HIDDEN)
    # and each still came back ahead of its block's recompute (the first kept block brings back the last
    # offloaded one too)
    assert prefetched == {2: 1, 4: 3}


class _CoreDone(torch.autograd.Function):
    """Identity on the core's inputs that logs when their gradients are in (the core's backward is done)."""

    @staticmethod
    def forward(ctx, log, index, q, k, v):
        ctx.log, ctx.index = log, index
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.log.append(("core done", ctx.index))
        return None, None, dq, dk, dv


def schedule_log(model, offloader) -> list:
    """One forward + backward of `model` with its host parts made device copies, and the order of what happened:
    ("unpack", block), ("prefetch", block) and ("core done", block) (its attention core's backward finished)."""
    log = []
    _device_copies(offloader, log)
    prefetch = offloader.prefetch
    offloader.prefetch = lambda block: (log.append(("prefetch", block)), prefetch(block))[1]
    for i, block in enumerate(model.layers):
        core = block.attention.core
        block.attention.core = lambda q, k, v, doc_ids, i=i, core=core: core(*_CoreDone.apply(log, i, q, k, v), doc_ids)
    forward_loss_sum(model, _Batch(128), torch.bfloat16).backward()
    return log


def test_the_block_before_comes_back_after_the_core_backward_and_before_its_recompute():
    layers = 4
    log = schedule_log(*_model(layers))
    for i in range(1, layers):  # block i brings back block i - 1 (the first kept block, 3, too)
        done, fetched, used = log.index(("core done", i)), log.index(("prefetch", i - 1)), log.index(("unpack", i - 1))
        assert done < fetched < used, log
    assert ("prefetch", -1) not in log and log.count(("unpack", 0)) == 1


def _loss_and_grads(emulate: bool):
    model, offloader = _model(3)
    if emulate:
        _device_copies(offloader)
    loss = forward_loss_sum(model, _Batch(128), torch.bfloat16)
    loss.backward()
    return loss.item(), model.host_optimizer.host_gradients()


def test_device_copies_and_their_schedule_change_no_value():
    """The schedule moves transfers, never values: the same loss and gradients with device copies."""
    loss, grads = _loss_and_grads(True)
    ref_loss, ref_grads = _loss_and_grads(False)
    assert loss == ref_loss
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
