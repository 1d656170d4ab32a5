"""One process in bf16 off the `host` tier is autocast over fp32 weights: each matmul autograd saves keeps a bf16
cast of its weight (memory/accounting.py layer_activations: one per matmul parameter of a stored block). Under
selective + offload_fraction with memory.block_chunk, the stored pieces of a block each cast every weight and
each kept its own copy: 6 copies of every weight here (a MoE layer's experts too), 64 x 0.44 GB = 28 GB per
llama3-8b block at 512K tokens in pieces of 8192 with fraction 1, where one copy was counted. They now share one
(memory/weight_casts.py), bit for bit. With fraction < 1 the recomputed pieces' backward cast every weight again
beside the stored pieces' copy (2 copies at the backward's peak, 0.41 GiB more for an 8B block); they now alias it."""

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import longctx.memory.apply_policy as apply_policy
from longctx.config import load_config
from longctx.data.samples import Batch
from longctx.memory.accounting import activation_dtype, layer_activations
from longctx.memory.apply_policy import apply_memory_policy
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.memory.weight_casts import SharedCasts
from longctx.memory.weight_grads import autocast_weight_bytes
from longctx.models.flops import matmul_params_per_layer
from longctx.models.llama import build_model
from longctx.parallel.parallelize import use_attention_chunks
from longctx.step.loss import forward_loss_sum
from probes import packed_batch

SEQ, BATCH, CHUNK = 96, 2, 32  # 192 tokens: 6 pieces, 3 of them stored at fraction 0.5


class _CastStorages(TorchDispatchMode):
    """The storage of every bf16 cast of a block's matrix weight (or of a view of it: a MoE layer's experts
    cast their transposed weights), held weakly, by weight; with `tracking`, the most storages of each
    weight alive at once after any op, the most bytes of them all, and the casts made."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.layers.named_parameters() if p.dim() >= 2}
        self.storages, self.peak, self.peak_bytes, self.made, self.tracking = [], {}, 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.storages.append((name, weakref.ref(out.untyped_storage())))
                self.made += self.tracking
        if self.tracking:
            for name, n in self.alive().items():
                self.peak[name] = max(self.peak.get(name, 0), n)
            self.peak_bytes = max(self.peak_bytes, sum(s.nbytes() for s in {id(s): s for s in self._live()}.values()))
        return out

    def _live(self):
        return [s for s in (ref() for _, ref in self.storages) if s is not None]

    def alive(self) -> dict[str, int]:
        counts = dict.fromkeys(self.names.values(), 0)
        for name, ref in self.storages:
            counts[name] += ref() is not None
        return counts


def _model(preset: str, recompute: str, fraction: float, chunk: int, attention_chunk: int = 0, skip_last: int = 0):
    """(model, its config, a packed batch): fp32 weights, as one GPU process of the device tier keeps them."""
    cfg = load_config(overrides=[f"--model.preset={preset}", "--model.layers=2"]).model
    model = build_model(cfg, seed=0)
    use_attention_chunks(model, attention_chunk, False)
    model.memory_offloader = apply_memory_policy(model.layers, recompute, fraction, offload_skip_last=skip_last,
                                                 block_chunk=chunk)
    model.loss_chunk = 64
    tokens, positions, doc, labels = packed_batch(cfg, seq=SEQ, batch=BATCH)
    return model, cfg, Batch(tokens, labels, positions, doc)


def _copies_in_backward(model, batch) -> tuple[dict[str, int], _CastStorages]:
    """(live casts of each weight at the forward's end, the mode that tracked the backward)."""
    mode = _CastStorages(model)
    with mode:
        loss = forward_loss_sum(model, batch, torch.bfloat16)
        after_forward = mode.alive()
        mode.tracking = True
        loss.backward()
    return after_forward, mode


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
@pytest.mark.parametrize("fraction,chunk,attention_chunk", [(1.0, CHUNK, 0), (0.5, CHUNK, 0), (0.25, CHUNK, 0),
                                                            (0.5, CHUNK, 64), (0.5, 0, 0)])
def test_a_blocks_pieces_keep_one_copy_of_each_weight(preset, fraction, chunk, attention_chunk):
    """The stored pieces share one copy, and the recomputed ones reuse it in backward (they run before the stored
    ones' backward), casting nothing. Before: 6 (fraction 1) and 3 (0.5) copies of each weight after the forward;
    then 1, and 2 at the backward's peak with fraction < 1 (a recomputed piece's own cast besides the stored one),
    also without block chunks (one stored and one recomputed piece)."""
    model, _, batch = _model(preset, "selective", fraction, chunk, attention_chunk)
    after_forward, mode = _copies_in_backward(model, batch)
    cast = {name for name, _ in mode.storages}  # (not a MoE router's weight: routers run in fp32)
    assert {after_forward[n] for n in cast} == {1}, after_forward
    assert {mode.peak[n] for n in cast} == {1}, mode.peak
    assert mode.made == 0, mode.made


@pytest.mark.parametrize("recompute,fraction,chunk,after_forward", [("full", 0.5, CHUNK, 0), ("full", 0.0, CHUNK, 0),
                                                                    ("selective", 0.0, CHUNK, 0), ("none", 0.0, 0, 1)])
def test_other_policies_keep_what_they_kept(recompute, fraction, chunk, after_forward):
    """Where no piece is stored beside a recomputed one nothing is shared (nor changed): full recomputation and
    selective without offload recast in each piece's backward, one piece at a time; `none` keeps its one copy."""
    model, _, batch = _model("debug", recompute, fraction, chunk)
    kept, mode = _copies_in_backward(model, batch)
    assert set(kept.values()) == {after_forward}, kept
    assert max(mode.peak.values()) == 1, mode.peak


@pytest.mark.parametrize("skip_last", [0, 1])
def test_the_weight_copies_counted_are_those_kept(skip_last):
    """The copies the accounting counts, measured: one saved per offloaded block (accounting.py layer_activations),
    none recast in an offloaded block's backward, one in a kept block's (weight_grads.py autocast_weight_bytes).
    Before the recomputed pieces reused the stored copy, an offloaded block's backward held two."""
    model, cfg, batch = _model("debug", "selective", 0.5, CHUNK, skip_last=skip_last)
    _, mode = _copies_in_backward(model, batch)
    block = 2 * matmul_params_per_layer(cfg)
    policy = MemoryPolicy("selective", 0.5, skip_last, block_chunk=CHUNK)
    recast = {off: autocast_weight_bytes(cfg, dataclasses.replace(policy, offload_fraction=0.5 if off else 0.0))
              - autocast_weight_bytes(cfg, MemoryPolicy()) for off in (True, False)}
    offloaded = cfg.layers - skip_last
    counted = offloaded * block + max(recast[True], recast[False] if skip_last else 0)
    assert recast == {True: 0, False: block}
    assert mode.peak_bytes <= counted, (mode.peak_bytes, counted)
    # exact with every block offloaded; a kept block's recast copies are counted for its whole backward, which
    # holds post's (wo and the MLP's) and later pre's (wq, wk, wv), never all at once
    assert mode.peak_bytes == counted if not skip_last else mode.peak_bytes > offloaded * block, mode.peak_bytes


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
@pytest.mark.parametrize("recompute,fraction,chunk", [("selective", 1.0, CHUNK), ("selective", 0.5, 48),
                                                      ("selective", 0.25, CHUNK), ("selective", 0.5, 0),
                                                      ("full", 0.5, CHUNK)])
def test_sharing_the_casts_changes_no_bit(monkeypatch, preset, recompute, fraction, chunk):
    """Loss and every gradient equal (torch.equal) those of the pieces casting each weight for themselves (the
    stored ones each keeping theirs, the recomputed ones casting again in backward)."""
    runs = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(apply_policy, "_stored_pieces_casts", lambda *_: None)
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
    layers = layer_activations(cfg, SEQ, BATCH, policy=policy, dtype_bytes=e, docs=True, autocast=copies)
    assert len(measured["blocks"]) == len(layers) == 2
    for got, counted in zip(measured["blocks"], layers):
        assert got["device"] <= counted.device and got["host"] <= counted.host, (got, counted)


def test_the_casts_are_shared_only_where_stored_pieces_cast_weights():
    """No dispatch mode (a Python call per op) where nothing would be shared: one piece, only recomputed pieces
    (each recasts in its own backward, one at a time), no autocast, or weights already in autocast's dtype (FSDP's
    bf16 gathers on a GPU). A stored piece beside a recomputed one shares (the recomputation reuses its copy)."""
    model, _, _ = _model("debug", "selective", 1.0, CHUNK)
    block, two, one = model.layers[0], [(slice(0, 32), False), (slice(32, 64), False)], [(slice(0, 64), False)]
    shared = lambda pieces: isinstance(apply_policy._stored_pieces_casts(block, pieces, "cpu"), SharedCasts)  # noqa: E731
    recomputed = [(slice(0, 32), True), (slice(32, 64), True)]
    assert not shared(two)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shared(two) and not shared(one) and shared([*two, (slice(64, 96), True)][1:]) and not shared(recomputed)
        block.to(torch.bfloat16)
        assert not shared(two)


def test_after_the_call_a_cast_is_shared_only_while_autograd_keeps_it():
    """SharedCasts.release(): a recomputation aliases the first cast while something else holds it, never for a
    weight changed since, and once nothing holds it casts afresh (the released table held nothing)."""
    weight = torch.randn(8, 4)
    casts = SharedCasts([weight])
    with casts:
        first = weight.to(torch.bfloat16)
    casts.release()
    with casts:
        same = weight.to(torch.bfloat16)
        view = weight.t().to(torch.bfloat16)  # (a view not cast before: cast afresh)
    assert same.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and torch.equal(same, first)
    assert view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    with torch.no_grad():
        weight.mul_(2)
    with casts:
        changed = weight.to(torch.bfloat16)
    assert changed.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert torch.equal(changed, first * 2)
    kept = weakref.ref(first.untyped_storage())
    del first, same
    assert kept() is None
