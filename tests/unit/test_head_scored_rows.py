"""The LM head over the scored rows only (ops/loss.py `rows`, `scored_rows`): the same loss and gradients as
over every row, on the plain and chunked paths, with the fused norm and label weights; the index made on
the host by Batch.to; a row left out whose label is scored refused; a draft's loss alike."""

import pytest
import torch

from longctx.data.samples import Batch
from longctx.ops.loss import IGNORE, SCORED_SHARE_MAX, lm_head_loss, scored_rows


def _case(n=96, dim=16, vocab=50, share=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) >= share] = IGNORE
    return h, w, labels


def _grads(h, w, labels, norm_w=None, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    norm = None if norm_w is None else (norm_w := norm_w.clone().requires_grad_(), 1e-6)
    loss = lm_head_loss(h, w, labels, norm=norm, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, None if norm_w is None else norm_w.grad


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("fused_norm", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_scored_rows_give_the_same_loss_and_gradients(chunk, fused_norm, reduction):
    h, w, labels = _case()
    rows = scored_rows(labels)
    assert rows is not None and 0 < rows.numel() < labels.numel()
    norm_w = torch.rand(h.shape[1], dtype=torch.float64) + 0.5 if fused_norm else None
    full = _grads(h, w, labels, norm_w, chunk=chunk, reduction=reduction)
    skip = _grads(h, w, labels, norm_w, chunk=chunk, reduction=reduction, rows=rows)
    for a, b in zip(full, skip):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)  # (fp64: the same sums, only fewer zeros)
    assert full[1][labels == IGNORE].abs().sum() == 0  # (the rows left out had no gradient to lose)


def test_label_weights_follow_their_rows():
    h, w, labels = _case(seed=1)
    weights = torch.rand(labels.shape, dtype=torch.float64)
    full = _grads(h, w, labels, chunk=8, reduction="mean", label_weights=weights)
    skip = _grads(h, w, labels, chunk=8, reduction="mean", label_weights=weights, rows=scored_rows(labels))
    for a, b in zip(full[:3], skip[:3]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_no_scored_row_is_a_zero_loss_with_zero_gradients():
    h, w, labels = _case()
    labels[:] = IGNORE
    rows = scored_rows(labels)
    assert rows is not None and rows.numel() == 0
    loss, dh, dw, _ = _grads(h, w, labels, chunk=16, reduction="sum", rows=rows)
    assert loss.item() == 0.0 and dh.abs().sum().item() == 0.0 and dw.abs().sum().item() == 0.0


def test_mostly_scored_labels_keep_the_plain_path():
    labels = torch.arange(100) % 7
    labels[: int(100 * (1 - SCORED_SHARE_MAX)) - 1] = IGNORE  # (just over the share scored)
    assert scored_rows(labels) is None
    labels[: int(100 * (1 - SCORED_SHARE_MAX)) + 1] = IGNORE
    assert scored_rows(labels) is not None


def test_rows_leaving_out_a_scored_label_are_refused():
    h, w, labels = _case()
    rows = scored_rows(labels)
    with pytest.raises(RuntimeError, match="leave out a scored label"):
        lm_head_loss(h, w, labels, rows=rows[1:], reduction="sum")


def test_scored_rows_refuses_device_labels():
    with pytest.raises(ValueError, match="on the host"):
        scored_rows(torch.zeros(4, dtype=torch.long, device="meta"))


def test_batch_to_makes_the_index_on_the_host():
    labels = torch.full((2, 8), IGNORE)
    labels[0, 6:] = 3
    labels[1, 7] = 4
    batch = Batch(torch.zeros(2, 8, dtype=torch.long), labels, torch.zeros(2, 8, dtype=torch.long), None)
    moved = batch.to("cpu")
    assert moved.scored.tolist() == [6, 7, 15]
    labels[:] = 1  # every label scored: the plain path
    assert Batch(batch.tokens, labels, batch.positions, None).to("cpu").scored is None


@pytest.mark.parametrize("kind", ["glide", "clover"])
@pytest.mark.parametrize("loss,vocab", [("kd", 0), ("ce", 40), ("kd", 40)])
def test_a_drafts_loss_over_the_scored_rows_is_the_same(kind, loss, vocab):
    from test_draft_training_audit import _packed, _target, _training

    target = _target()
    tokens, positions, doc, labels = _packed()
    labels[0, :12] = IGNORE  # (a masked prompt)
    rows = scored_rows(labels)
    assert rows is not None
    out = {}
    for name, scored in (("full", None), ("skip", rows)):
        model = _training(kind, target, vocab, loss)
        total = model(tokens, positions, doc, labels=labels, loss_reduction="sum", scored=scored)
        total.backward()
        out[name] = (total.detach(), [p.grad.clone() for p in model.draft.parameters() if p.grad is not None])
    torch.testing.assert_close(out["skip"][0], out["full"][0], rtol=1e-6, atol=0)
    assert len(out["full"][1]) > 0
    for a, b in zip(out["skip"][1], out["full"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_drafts_rows_leaving_out_a_scored_label_are_refused():
    from test_draft_training_audit import _packed, _target, _training

    tokens, positions, doc, labels = _packed()
    model = _training("glide", _target(), 0, "kd")
    rows = (labels.flatten() != IGNORE).nonzero().squeeze(1)
    with pytest.raises(RuntimeError, match="leave out a scored label"):
        model(tokens, positions, doc, labels=labels, loss_reduction="sum", scored=rows[1:])
