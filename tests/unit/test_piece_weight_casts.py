"""One process in bf16 off the `host` tier is autocast over fp32 weights: each matmul autograd saves keeps a bf16
cast of its weight (memory/accounting.py weight_copies: one per matmul parameter of a stored block). Under
selective + offload_fraction with memory.block_chunk, the stored pieces of a block each cast every weight and
each kept its own copy: 6 copies of every weight here (a MoE layer's experts too), 64 x 0.44 GB = 28 GB per
llama3-8b block at 512K tokens in pieces of 8192 with fraction 1, where one copy was counted. They now share one
(memory/weight_casts.py), bit for bit."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import longctx.memory.apply_policy as apply_policy
from longctx.config import load_config
from longctx.data.samples import Batch
from longctx.memory.accounting import activation_dtype, layer_activations, measure_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.policy import MemoryPolicy
from longctx.memory.weight_casts import SharedCasts
from longctx.models.llama import build_model
from longctx.step.loss import forward_loss_sum
from probes import packed_batch

SEQ, BATCH, CHUNK = 96, 2, 32  # 192 tokens: 6 pieces, 3 of them stored at fraction 0.5


class _CastStorages(TorchDispatchMode):
    """The storage of every bf16 cast of a block's matrix weight (or of a view of it: a MoE layer's experts
    cast their transposed weights), held weakly, by weight; with `tracking`, the most storages of each
    weight alive at once after any op."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.layers.named_parameters() if p.dim() >= 2}
        self.storages, self.peak, self.tracking = [], {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.storages.append((name, weakref.ref(out.untyped_storage())))
        if self.tracking:
            for name, n in self.alive().items():
                self.peak[name] = max(self.peak.get(name, 0), n)
        return out

    def alive(self) -> dict[str, int]:
        counts = dict.fromkeys(self.names.values(), 0)
        for name, ref in self.storages:
            counts[name] += ref() is not None
        return counts


def _model(preset: str, recompute: str, fraction: float, chunk: int):
    """(model, its config, a packed batch): fp32 weights, as one GPU process of the device tier keeps them."""
    cfg = load_config(overrides=[f"--model.preset={preset}", "--model.layers=2"]).model
    model = build_model(cfg, seed=0)
    model.memory_offloader = apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=0,
                                                 block_chunk=chunk)
    model.loss_chunk = 64
    tokens, positions, doc, labels = packed_batch(cfg, seq=SEQ, batch=BATCH)
    return model, cfg, Batch(tokens, labels, positions, doc)


@pytest.mark.parametrize("fraction,recomputed_pieces", [(1.0, 0), (0.5, 3)])
def test_a_blocks_stored_pieces_keep_one_copy_of_each_weight(fraction, recomputed_pieces):
    model, _, batch = _model("debug", "selective", fraction, CHUNK)
    mode = _CastStorages(model)
    with mode:
        loss = forward_loss_sum(model, batch, torch.bfloat16)
        after_forward = mode.alive()
        mode.tracking = True
        loss.backward()
    # before: 6 (fraction 1) and 3 (0.5) copies of each weight after the forward
    assert set(after_forward.values()) == {1}, after_forward
    # in backward, a recomputed piece's own cast besides the stored one (before: 3 + 1 at fraction 0.5)
    assert max(mode.peak.values()) == 1 + (recomputed_pieces > 0), mode.peak


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
@pytest.mark.parametrize("recompute,fraction,chunk", [("selective", 1.0, CHUNK), ("selective", 0.5, 48),
                                                      ("selective", 0.5, 0), ("full", 0.5, CHUNK)])
def test_sharing_the_casts_changes_no_bit(monkeypatch, preset, recompute, fraction, chunk):
    """Loss and every gradient equal (torch.equal) those of the pieces casting each weight for themselves."""
    runs = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(apply_policy, "_stored_pieces_casts", lambda *_: apply_policy.contextlib.nullcontext())
        model, _, batch = _model(preset, recompute, fraction, chunk)
        loss = forward_loss_sum(model.train(), batch, torch.bfloat16)
        terms = model.router_terms()
        (loss + (terms.loss if terms is not None else 0)).backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (reference_loss, reference_grads) = runs
    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[n], reference_grads[n]) for n in grads), \
        [n for n in grads if not torch.equal(grads[n], reference_grads[n])]


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_accounting_holds_with_stored_pieces(preset, fraction):
    """Each block keeps on the device no more than layer_activations counts (one weight copy per matmul parameter):
    before, a dense block kept 6x the count at fraction 1, 3x at 0.5 (the copies are all it keeps there)."""
    model, cfg, batch = _model(preset, "selective", fraction, CHUNK)
    forward = model.forward

    def autocast_forward(*a, **k):  # (uncached, as step/loss.py runs it)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return forward(*a, **k)

    model.forward = autocast_forward
    measured = measure_activations(model, batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels)
    e, copies = activation_dtype(True, 1, "device")
    policy = MemoryPolicy("selective", fraction, 0, loss_chunk=64, block_chunk=CHUNK)
    layers = layer_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, weight_copies=copies)
    assert len(measured["blocks"]) == len(layers) == 2
    for got, counted in zip(measured["blocks"], layers):
        assert got["device"] <= counted.device and got["host"] <= counted.host, (got, counted)


def test_the_casts_are_shared_only_where_stored_pieces_cast_weights():
    """No dispatch mode (a Python call per op) where nothing would be shared: one stored piece, no autocast,
    or weights already in autocast's dtype (FSDP's bf16 gathers on a GPU)."""
    model, _, _ = _model("debug", "selective", 1.0, CHUNK)
    block, two, one = model.layers[0], [(slice(0, 32), False), (slice(32, 64), False)], [(slice(0, 64), False)]
    shared = lambda pieces: isinstance(apply_policy._stored_pieces_casts(block, pieces, "cpu"), SharedCasts)  # noqa: E731
    assert not shared(two)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shared(two) and not shared(one) and not shared([*two, (slice(64, 96), True)][1:])
        block.to(torch.bfloat16)
        assert not shared(two)
