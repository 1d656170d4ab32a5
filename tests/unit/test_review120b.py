"""Review of 835b897e against its parent's behaviour: the grouped kernel's output hooked in eager code (ops/grouped.py,
no identity Function), an all-to-all over one rank handing back its input (job/comm.py all_to_all_v_grad), and the
loss a step backwards shared by training, the planner's validation and the memory bench (step/loss.py).

The one bug found: an undefined gradient of the kernel's output (a Function that returned None for it, which torch
reads as zero) reached the hook as None, and `None.numel()` failed the backward; the identity Function got zeros
(materialised) and ran. The rest are the parent's behaviour kept: the hook runs once per kernel call on the summed
gradient whatever follows the output (two uses, an in-place write, checkpoints of every kind, saved-tensor hooks) and
keeps nothing alive; over one rank the all-to-all's gradient is AllToAllV's; the router terms join the loss as the
training hook added them, once."""

import functools
import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import longctx.ops.grouped as grouped
from longctx.job import comm
from longctx.ops.grouped import cpu_kernel_available, grouped_mm, use_loop

kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="this torch has no CPU torch._grouped_mm kernel")
COUNTS = torch.tensor([3, 0, 5, 4])


def _leaves(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(12, 8, generator=g).requires_grad_(), torch.randn(4, 8, 12, generator=g).requires_grad_())


class _NoGradientFor(torch.autograd.Function):
    """y.sum() + z.sum(), whose backward gives y no gradient (None: zero, as torch reads it)."""

    @staticmethod
    def forward(ctx, y, z):
        return y.sum() + z.sum()

    @staticmethod
    def backward(ctx, grad):
        return None, grad.expand(3)


@kernel
def test_an_undefined_gradient_of_the_output_is_no_error():
    x, w = _leaves()
    z = torch.ones(3, requires_grad=True)
    y = grouped_mm(x, w, COUNTS)
    assert "GroupedMm" in type(y.grad_fn).__name__  # (the hooked kernel path)
    _NoGradientFor.apply(y, z).backward()  # (raised AttributeError: 'NoneType' object has no attribute 'numel')
    assert torch.equal(z.grad, torch.ones(3))
    for g in (x.grad, w.grad):  # none, or zeros as the identity Function's materialised gradient gave
        assert g is None or not g.any()


def _each(fn):
    return {"plain": fn,
            "non-reentrant": lambda x, w: checkpoint(fn, x, w, use_reentrant=False),
            "reentrant": lambda x, w: checkpoint(fn, x, w, use_reentrant=True),
            "selective": lambda x, w: checkpoint(fn, x, w, use_reentrant=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, _save_kernel))}


def _save_kernel(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten._grouped_mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _twice(x, w):  # one output read twice: its gradient the sum, expanded (a .sum()) plus a strided one
    y = grouped_mm(x, w, COUNTS)
    return y.sum() + y[:, ::2].sum()


def _added_in_place(x, w):  # (refused on the identity Function's view: a Function's view takes no in-place write)
    return grouped_mm(x, w, COUNTS).add_(2.0).sum()  # (the add hands the .sum()'s expanded gradient on unchanged)


def _written_in_place(x, w):  # a slice of it written: the hook stays on the kernel's node
    y = grouped_mm(x, w, COUNTS)
    y[:, :4].mul_(3.0)
    return y.sum()


@kernel
@pytest.mark.parametrize("upstream", [_twice, _added_in_place, _written_in_place])
@pytest.mark.parametrize("wrap", ["plain", "non-reentrant", "reentrant", "selective"])
def test_the_hook_runs_once_per_call_and_gives_the_loops_gradients(upstream, wrap, monkeypatch):
    seen = []
    real = grouped._contiguous
    monkeypatch.setattr(grouped, "_contiguous", lambda g: seen.append(g.is_contiguous()) or real(g))
    grads = []
    for loop in (False, True):
        x, w = _leaves()
        with use_loop() if loop else torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            _each(upstream)[wrap](x, w).backward()  # (backward inside: a recompute reads the loop switch)
        grads.append((x.grad, w.grad))
    assert len(seen) == 1  # the kernel's one call, on its gradient summed over every use
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@kernel
def test_the_hook_keeps_no_output_alive():
    x, w = _leaves()
    y = grouped_mm(x, w, COUNTS)
    assert y._backward_hooks  # (hooked)
    ref = weakref.ref(y)
    loss = (y * 2.0).sum()  # (a product with a number saves nothing of y)
    del y
    gc.collect()
    assert ref() is None
    loss.backward()
    assert w.grad is not None


class _OneRank:
    """A 1-D mesh of one rank, as far as all_to_all_v needs one (no process group: nothing is sent)."""

    mesh_dim_names = ("expert",)  # (the refusal names the dim)

    def size(self) -> int:
        return 1


def test_one_rank_all_to_all_is_its_input_with_alltoallvs_gradient():
    g = torch.Generator().manual_seed(2)
    x0, up = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    grads = []
    for apply in (comm.all_to_all_v_grad, comm.AllToAllV.apply):  # the shortcut, then the parent's Function
        x = x0.clone().requires_grad_()
        mid = x * 3.0
        got = apply(mid, _OneRank(), [6], [6], "expert")
        assert (got is mid) == (apply is comm.all_to_all_v_grad)
        ((got * up).sum() + got.sum()).backward()
        grads.append(x.grad)
    assert torch.equal(*grads)
    with pytest.raises(ValueError, match="splits"):  # splits that do not fit x still refused
        comm.all_to_all_v_grad(x0, _OneRank(), [5], [5])


def _moe_and_batch():
    from longctx.config import build_model_config
    from longctx.data.samples import Batch
    from longctx.models.llama import build_model

    model = build_model(build_model_config({"preset": "debug-moe", "layers": 2}), device="cpu", seed=0)
    g = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, 320, (2, 64), generator=g) for _ in range(2))
    return model, Batch(tokens, labels, torch.arange(64).expand(2, 64), None)


def test_training_loss_is_the_training_hooks_sum_bit_for_bit():
    """train/step_run.py's micro-batch loss as the training hook made it before 835b897e (the LM loss times its
    weight, plus router_terms().loss times scale / micro-batches), against step/loss.py training_loss; the router
    terms taken once (their records cleared: a second read finds none)."""
    from longctx.step.loss import forward_loss_sum, router_loss, training_loss

    weight, micro, scale = 2.0 / 128, 2, 2.0
    totals, grads = [], []
    for shared in (False, True):
        model, batch = _moe_and_batch()
        if shared:
            total, loss_sum = training_loss(model, batch, None, weight, micro, scale)
            assert router_loss(model, micro, scale) == (None, None)
        else:
            loss_sum = forward_loss_sum(model, batch, None)
            total = loss_sum * weight + model.router_terms().loss * (scale / micro)
        total.backward()
        totals.append(total.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(*totals)
    assert grads[0].keys() == grads[1].keys() and any("router" in n for n in grads[0])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
