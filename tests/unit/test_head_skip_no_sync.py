"""The LM head over the scored rows never reads the device (ops/loss.py `rows`): on a GPU a host read of a
device tensor (.item(), .tolist(), bool(), nonzero, a boolean-mask index) makes the step wait for the device.
torch.cuda.set_sync_debug_mode is CUDA-only, so the contract is checked on CPU at the dispatcher: every such
read lowers to one of the aten ops below (.item/.tolist/bool -> _local_scalar_dense or is_nonzero; nonzero;
a boolean-mask index -> index/index_put with a bool index), so a guard that refuses them while the head's forward and
backward run finds any sync that a later change would add."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.ops.loss import IGNORE, lm_head_loss, scored_rows

_HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::nonzero_static",
               "aten::nonzero_numpy", "aten::equal", "aten::masked_select"}
# A boolean-mask index runs nonzero inside the CPU kernel (no nonzero op is dispatched), so these count as a
# host read when one of their indices is a bool tensor (on CUDA they sync on the mask's count)
_MASKABLE = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _has_mask(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)


class _RefuseHostReads(TorchDispatchMode):
    """Records every op that would read a tensor's values back to the host."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_READS or (name in _MASKABLE and _has_mask(args)):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _case(n=128, dim=16, vocab=64, share=0.1):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, dim, generator=g, requires_grad=True)
    w = (torch.randn(vocab, dim, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) >= share] = IGNORE
    return h, w, labels


def test_guard_sees_a_host_read():
    """The guard is live: .item() and a mask index are recorded (else the tests below would prove nothing)."""
    x = torch.arange(4.0)
    with _RefuseHostReads() as guard:
        x.sum().item()
        x[x > 1].sum()
    assert "aten::_local_scalar_dense" in guard.reads and "aten::index" in guard.reads


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("fused_norm", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_head_over_scored_rows_reads_nothing_back(chunk, fused_norm, weighted):
    h, w, labels = _case()
    rows = scored_rows(labels)  # (on the host, before the batch's copy: Batch.to)
    assert rows is not None and 0 < rows.numel() < labels.numel()
    norm_w = (torch.rand(h.shape[1]) + 0.5).requires_grad_()
    weights = torch.rand(labels.shape) if weighted else None
    with _RefuseHostReads() as guard:
        loss = lm_head_loss(h, w, labels, chunk=chunk, reduction="sum", rows=rows, label_weights=weights,
                            norm=(norm_w, 1e-6) if fused_norm else None)
        loss.backward()
    assert guard.reads == [], guard.reads


def test_zero_scored_rows_read_nothing_back():
    h, w, labels = _case()
    labels[:] = IGNORE
    rows = scored_rows(labels)
    assert rows is not None and rows.numel() == 0
    with _RefuseHostReads() as guard:
        lm_head_loss(h, w, labels, chunk=16, reduction="sum", rows=rows).backward()
    assert guard.reads == [], guard.reads
    assert torch.isfinite(h.grad).all() and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_guard_catches_the_scoring_paths_host_read():
    """Evaluation's scoring (lm_head_token_scores) counts its rows on the host by design (commit 7d4e6c8): the
    guard must flag it, the same head path as training's with one sync."""
    from longctx.ops.loss import lm_head_token_scores

    h, w, labels = _case()
    with _RefuseHostReads() as guard:
        lm_head_token_scores(h.detach(), w.detach(), labels, chunk=16)
    assert "aten::nonzero" in guard.reads
