"""A MoE layer's router statistics (models/moe_stats.py record) keep nothing past a block's backward, whatever the
caller backwards (helper zleak).

The balancing losses (router_terms) join the backward only where the caller adds them to its loss, as training does
(train/moe_hooks.py). A backward of the LM loss alone (the memory tests' harness, `longctx bench memory`'s step,
the planner's layout validation, a library caller's own loss) never ran the records' own nodes, and autograd kept
what they saved until the next forward dropped the records: without recomputation the logits and their
log-sum-exp (4 E + 4 bytes per token and MoE layer), and in a recomputed block (memory.recompute full, selective,
with or without offload) the tensors its recomputation made again for them AND the block's checkpoint with its
saved input (the records' nodes held its holders): debug-moe at 2,048 tokens, fp32, full: 1,122,304 B per MoE
layer alive at the end of backward (548 B per token: the block input 512, logits 32, log-sum-exp 4), 8,118,784 B
with 8 layers (7 MoE), 1,384,528 B with 2; selective 2,170,880 B per MoE layer (its post checkpoint keeps two
inputs). With padding the balancing loss's weighted probability sum held the checkpoint too, without a z-loss.
A training backward (router terms added) freed them in each block's post phase and is unchanged, to the byte.
Now the record's sums are outputs of one node (_RouterSums) that the routing weights pass through, so it runs in
every backward of the layer's output and frees its tensors there. memory/transients.py's z_loss_held_bytes (which
counted the harness's leftovers as a transient of training) is gone: measured with a z-loss = without, exactly."""

import dataclasses

import pytest
import torch
from test_autocast_transients import _batch

from live_storage import LiveStorages
from longctx.config import load_config
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from longctx.parallel.parallelize import apply_memory
from longctx.step.loss import forward_loss_sum

SEQ = 512
SHAPE = {"preset": "debug-moe", "dim": 128, "heads": 8, "kv_heads": 2, "head_dim": 16, "vocab_size": 1024,
         "tie_embeddings": False}  # (layer 0 dense, the others MoE: 8 experts, z_loss 0.001)
POLICIES = {"full": MemoryPolicy("full", loss_chunk=256), "selective": MemoryPolicy("selective", loss_chunk=256),
            "selective-offload": MemoryPolicy("selective", 1.0, 1, loss_chunk=256),
            "full-chunks": MemoryPolicy("full", loss_chunk=256, block_chunk=128), "none": MemoryPolicy("none")}
# what a call's record itself keeps until the next forward: [E] choices and probability sums, two scalars (72 B)
RECORD = 128


def _calls(policy: MemoryPolicy) -> int:
    """A MoE layer's calls (records) per forward: one per piece under block_chunk."""
    return -(-SEQ // policy.block_chunk) if policy.block_chunk else 1


def _model(policy: MemoryPolicy, layers: int, **moe):
    shape = {**SHAPE, "layers": layers, **{f"moe.{k}": v for k, v in moe.items()}}
    cfg = load_config(None, {"model": shape, "memory": policy.to_config()})
    model = build_model(cfg.model, seed=0)  # fp32
    apply_memory(model, cfg.memory, "cpu")
    if model.memory_offloader is not None:
        model.memory_offloader._fetch = lambda host: host.clone()  # a device copy, as CUDA's .to(device) makes
    return cfg, model


def _step(policy: MemoryPolicy, layers: int, *, terms: bool, pad: bool = False, **moe):
    """(bytes alive at the end of each block's backward, at the end of backward), the parameters' gradients aside:
    the LM loss alone backwarded, or (`terms`) with the router terms as training adds them."""
    _, model = _model(policy, layers, **moe)
    batch = _batch(SEQ)
    if pad:  # (the last eighth padding: models/moe_stats.py leaves it out of every sum)
        real = torch.ones(1, SEQ, dtype=torch.bool)
        real[:, -SEQ // 8:] = False
        batch = dataclasses.replace(batch, real=real)
    mode, ends = LiveStorages(), {}

    def mark(i):  # the block's backward ends when its input's gradient is made
        def hook(_module, args):
            if args[0].requires_grad:
                args[0].register_hook(lambda _g: ends.__setitem__(i, len(mode.steps)))
        return hook
    handles = [block.register_forward_pre_hook(mark(i)) for i, block in enumerate(model.layers)]
    with mode:
        loss = forward_loss_sum(model, batch, None)
        if terms:
            loss = loss + model.router_terms().loss
        loss.backward()
    for h in handles:
        h.remove()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    skip = {mode.held[p][0] for p in grads if p in mode.held}
    alive = lambda j: sum(n for s, n in mode.steps[j].items() if s not in skip)  # noqa: E731
    return {i: alive(j - 1) for i, j in ends.items()}, alive(len(mode.steps) - 1)


@pytest.mark.parametrize("policy", ["full", "selective", "selective-offload", "full-chunks", "none"])
def test_nothing_of_the_records_outlives_the_backward_of_the_lm_loss_alone(policy):
    """Before (512 tokens, 2 / 4 layers: 1 / 3 MoE), alive at the end: full 346,192 / 907,488 B (548 B per token and
    MoE layer more), selective 1,060, selective-offload 72 (its inputs on the host), none 36 (the logits and their
    log-sum-exp); after 80 / 224 B (the records), 296 / 872 with block_chunk's 4 calls a layer."""
    held = RECORD * _calls(POLICIES[policy])
    ends = [_step(POLICIES[policy], layers, terms=False)[1] for layers in (2, 4)]
    assert ends[0] <= held and ends[1] <= 3 * held, ends


@pytest.mark.parametrize("policy", ["full", "selective", "selective-offload"])
def test_each_blocks_backward_ends_as_the_training_backwards_does(policy):
    """Alive at the end of every block's backward: the LM loss alone = training's backward (router terms in the
    loss), but for the records' few bytes. Before, each MoE block's checkpoint, its recomputed logits and log-sum-exp
    stayed alive beside every block below it (+1,060 B per token and MoE layer above, selective)."""
    alone, _ = _step(POLICIES[policy], 4, terms=False)
    trained, end = _step(POLICIES[policy], 4, terms=True)
    assert end <= 8  # (the loss)
    assert alone.keys() == trained.keys() == set(range(4))
    for i in range(4):
        assert 0 <= alone[i] - trained[i] <= 3 * RECORD, (i, alone[i], trained[i])


def test_padding_keeps_no_checkpoint_past_the_backward_without_a_z_loss():
    """The balancing loss's probability sum over the real tokens (a product with the padding weight) held each
    recomputed MoE block's checkpoint too, with moe.z_loss = 0: before, +1,056,844 B per MoE layer at 2,048 tokens."""
    ends = [_step(POLICIES["full"], layers, terms=False, pad=True, z_loss=0.0)[1] for layers in (2, 4)]
    assert ends[0] <= RECORD and ends[1] <= 3 * RECORD, ends


def _grads(policy: str, fraction: float = 0.0):
    pol = dataclasses.replace(POLICIES[policy], offload_fraction=fraction, offload_skip_last=1)
    _, model = _model(pol, 4)
    batch = _batch(256)
    real = torch.ones(1, 256, dtype=torch.bool)
    real[:, -40:] = False
    loss = forward_loss_sum(model, dataclasses.replace(batch, real=real), None)
    terms = model.router_terms()
    (loss + terms.loss).backward()
    return loss.detach(), terms, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_losses_and_gradients_under_recomputation_equal_none():
    """z_loss 0.001, fp32, padding: the loss, the router figures and every gradient under full, selective and
    selective + offload equal the run that recomputes nothing (1e-6, as the recompute parity tests ask)."""
    loss0, terms0, grads0 = _grads("none")
    assert terms0.stats[1] > 0 and grads0["layers.1.feed_forward.router.gate.weight"].abs().max() > 0
    for policy, fraction in [("full", 0.0), ("selective", 0.0), ("selective", 0.5), ("full-chunks", 0.0)]:
        loss, terms, grads = _grads(policy, fraction)
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(terms.loss, terms0.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(terms.stats, terms0.stats, rtol=1e-6, atol=1e-7)
        assert grads.keys() == grads0.keys()
        for key in grads0:
            torch.testing.assert_close(grads[key], grads0[key], rtol=1e-5, atol=1e-6, msg=f"{policy} {key}")


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("z_grad", [True, False])
def test_the_sums_node_gives_the_ops_values_and_gradients_bit_for_bit(padded, z_grad):
    from longctx.models.moe_stats import _RouterSums

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 16, generator=g, requires_grad=True)
    weight = (torch.rand(300, generator=g) > 0.2).float() if padded else None
    probs = logits.softmax(-1)
    weights = probs.topk(2, dim=-1).values

    def ops():
        p = probs if weight is None else probs * weight[:, None]
        sq = (logits if z_grad else logits.detach()).logsumexp(-1).square()
        return weights, p.sum(0), (sq if weight is None else sq * weight).sum()
    mix = torch.randn(300, 2, generator=g), torch.randn(16, generator=g), 0.37
    out = []
    for run in (ops, lambda: _RouterSums.apply(weights, probs, logits, weight, z_grad)):
        w, prob_sum, z = run()
        assert z.requires_grad == z_grad
        loss = (w * mix[0]).sum() + (prob_sum * mix[1]).sum() + (z * mix[2] if z_grad else 0)
        out.append((prob_sum, z, *torch.autograd.grad(loss, logits, retain_graph=True)))
    for a, b in zip(*out):
        assert torch.equal(a, b)
