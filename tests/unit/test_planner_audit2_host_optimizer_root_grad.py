"""memory.model_states = host_optimizer on one rank: the device holds each weight's gradient until the
hook of step/host_optimizer.py takes it to the host, and the planner and the preflight (costs/host_bytes.py
device_state_bytes, memory/transients.py) counted the largest block's gradient alone:

- with tied embeddings the LM head's share of the [vocab, dim] table's gradient waits in autograd for the
  embedding's share (one leaf, accumulated once), beside every block's gradients (llama3-1b: 1.0 GiB under
  in every phase of the backward);
- an untied head's fp32 gradient is on the device at its own hook, in the LM head's backward, beside every
  saved activation (llama3-8b: 1.1 GiB under in that phase, the peak at 8K-16K tokens on one h100).

Measured here on a real HostOptimizer (CPU): at each hook, the gradient being taken and every [vocab, dim]
tensor the backward made that is still alive (not the host buffers: they are written in place)."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longctx.config import load_config
from longctx.costs.host_bytes import device_state_bytes, predicted_rank_bytes, rank_params
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import Llama
from longctx.step.host_optimizer import HostOptimizer, forward_units

ONE = MeshShape(1, 1, 1, 1)


class _Tables(TorchDispatchMode):
    """Keeps a weak reference to every [vocab, dim] tensor an op makes (not an in-place op's output)."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape, self.made = sorted(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and sorted(t.shape) == self.shape
                    and t.untyped_storage().data_ptr() not in inputs):
                self.made.append(weakref.ref(t))
        return out

    def alive(self, but: torch.Tensor) -> int:
        """Bytes of the tables still alive, other than `but`'s storage."""
        own = but.untyped_storage().data_ptr()
        live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in self.made)
                if t is not None}
        return sum(v for k, v in live.items() if k != own)


def _measured_grad_bytes(m, tables_too: bool = False) -> int:
    """The most gradient bytes one backward of a one-rank host_optimizer run holds on its device at a block
    weight's hook (tables_too: at the [vocab, dim] tables' hooks as well)."""
    model = Llama(m)
    model.init_weights(0)
    opt = HostOptimizer([{"params": list(model.parameters())}], forward_units(model), lr=1e-3)
    tables = _Tables((m.vocab_size, m.dim))
    most = [0]
    take = opt._take

    def measured_take(i):
        grad = opt.params[i].grad
        if tables_too or sorted(grad.shape) != sorted((m.vocab_size, m.dim)):
            most[0] = max(most[0], grad.untyped_storage().nbytes() + tables.alive(grad))
        take(i)

    opt._take = measured_take
    tokens = torch.randint(0, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, None, None, labels=tokens)
    with tables:
        loss.backward()
    assert all(p.grad is None for p in model.parameters())  # every gradient went to the host
    return most[0]


def _table_model(tie: bool):
    """A table (vocab x dim) larger than a block, as in every published model."""
    m = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 3, "heads": 2, "kv_heads": 1,
                                     "ffn_dim": 32, "vocab_size": 1024, "tie_embeddings": tie}}).model
    assert m.vocab_size * m.dim > param_counts(m)["block"]
    return m


def _counted(m) -> float:
    return device_state_bytes(m, ONE, "host_optimizer", 4)["model_states"] - 4 * rank_params(m, ONE)


def test_tied_table_gradient_waits_beside_every_block():
    m = _table_model(tie=True)
    measured = _measured_grad_bytes(m)
    assert measured > 4 * m.vocab_size * m.dim  # the table's share and a block weight's gradient at once
    assert _counted(m) >= measured


def test_untied_model_counts_a_block_beside_its_backward():
    m = _table_model(tie=False)
    assert _counted(m) == 4 * param_counts(m)["block"] >= _measured_grad_bytes(m)


def test_untied_head_gradient_is_counted_in_the_lm_head_backward():
    m = _table_model(tie=False)
    table, block = 4 * m.vocab_size * m.dim, 4 * param_counts(m)["block"]
    assert table >= _measured_grad_bytes(m, tables_too=True)  # the head's gradient, alone at its hook
    policy = MemoryPolicy("none", loss_chunk=0)  # an unchunked loss: the LM head's backward is the peak
    kw = dict(seq_len=64, micro_batch=2, grad_accum=1, dtype_bytes=4, device_type="cpu")
    device, _ = predicted_rank_bytes(m, ONE, policy, "host_optimizer", **kw)
    plain, _ = predicted_rank_bytes(m, ONE, policy, "device", **kw)
    assert device["model_states"] - 4 * rank_params(m, ONE) == block  # a block's gradient beside its backward
    # the same activations and LM head as under device: in that phase the head's gradient, beyond the block's
    assert device["transient"] - plain["transient"] == table - block


def test_no_head_gradient_term_off_one_rank_host_optimizer():
    from longctx.costs.host_bytes import head_grad_bytes

    m = _table_model(tie=False)
    assert head_grad_bytes(m, ONE, "host_optimizer") > 0
    assert head_grad_bytes(m, MeshShape(1, 2, 1, 1), "host_optimizer") == 0
    assert head_grad_bytes(m, ONE, "device") == head_grad_bytes(m, ONE, "host") == 0
    assert head_grad_bytes(_table_model(tie=True), ONE, "host_optimizer") == 0  # (in gradients_on_device)


def test_a_block_larger_than_the_table_is_still_what_is_counted():
    m = load_config(None, {"model": {"preset": "debug"}}).model  # vocabulary 320: a block is the largest
    assert param_counts(m)["block"] > m.vocab_size * m.dim
    assert _counted(m) == 4 * param_counts(m)["block"]
    assert _counted(m) >= _measured_grad_bytes(m, tables_too=True)
