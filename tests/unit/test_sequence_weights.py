"""train.loss_weighting = sequence (LongAlign's loss weighting, data/sequence_weights.py): each trained
sequence of a step counts once, as the mean of its own labels' losses. Checked against brute force at each
layer: the weights (1 / a sequence's labels), the weighted LM-head loss (plain and chunked, values and
gradients), the store's count of trained sequences (from its segment index), each rank's share of the
weights under every layout (read from the store, bit for bit the whole batch's), and a training step's
loss (the mean over sequences of each one's mean, computed from the model's per-token losses)."""

import numpy as np
import pytest
import torch
from test_answer_gaps import _gapped_store
from test_local_reads import LAYOUTS, bfd_store, runtimes

from longctx.data.loader import PackedSamples
from longctx.data.samples import IGNORE
from longctx.data.sequence_weights import sequence_weights, trained_sequences
from longctx.ops.loss import lm_head_loss
from longctx.parallel.context.shares import read_local_batch


def _by_hand(labelled, doc_ids):
    """(weights, K) by loops: 1 / labels of the (row, document) at each labelled token."""
    weights, k = np.zeros(labelled.shape), 0
    for r in range(labelled.shape[0]):
        docs = np.zeros(labelled.shape[1], dtype=int) if doc_ids is None else doc_ids[r]
        for d in set(docs.tolist()):
            here = (docs == d) & labelled[r]
            if here.any():
                weights[r][here] = 1.0 / here.sum()
                k += 1
    return weights, k


@pytest.mark.parametrize("docs", ["packed", "none", "sparse ids"])
def test_each_label_weighs_one_over_its_sequences_labels(docs):
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows, seq = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        labelled = rng.random((rows, seq)) < rng.choice([0.0, 0.3, 0.9])
        doc_ids = None if docs == "none" else np.cumsum(rng.random((rows, seq)) < 0.2, axis=1)
        if docs == "sparse ids":
            doc_ids = doc_ids * 1_000_003 + 7
        expected, k = _by_hand(labelled, doc_ids)
        assert np.allclose(sequence_weights(labelled, doc_ids), expected, rtol=1e-6, atol=0)
        assert trained_sequences(labelled, doc_ids) == k


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("norm", [False, True])
def test_the_weighted_loss_and_its_gradients_are_the_weighted_sum(chunk, norm):
    torch.manual_seed(0)
    n, dim, vocab = 29, 16, 50
    h = torch.randn(n, dim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, dim, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.1 * torch.randn(dim, dtype=torch.float64)).requires_grad_(norm)
    labels = torch.randint(0, vocab, (n,))
    labels[torch.rand(n) < 0.3] = IGNORE
    weights = torch.rand(n, dtype=torch.float64) + 0.1  # (also where ignored: those must not count)
    got = lm_head_loss(h, w, labels, chunk=chunk, reduction="sum", norm=(g, 1e-5) if norm else None,
                       label_weights=weights)
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g if norm else h
    each = torch.nn.functional.cross_entropy(x @ w.t(), labels.clamp(min=0), reduction="none")
    expected = (each * weights * (labels != IGNORE)).sum()
    assert torch.allclose(got, expected, rtol=1e-10, atol=0)
    params = [h, w] + ([g] if norm else [])
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(expected, params)):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    mean = lm_head_loss(h, w, labels, chunk=chunk, norm=(g, 1e-5) if norm else None, label_weights=weights)
    assert torch.allclose(mean, expected / (weights * (labels != IGNORE)).sum(), rtol=1e-10, atol=0)
    unweighted = lm_head_loss(h, w, labels, chunk=chunk, reduction="sum", norm=(g, 1e-5) if norm else None)
    assert not torch.allclose(got, unweighted)  # (the weights are taken)


@pytest.mark.parametrize("doc_mask", [True, False])
def test_a_stores_count_of_trained_sequences_is_its_frames_count(tmp_path, doc_mask):
    """From the segment index (loader.py sequence_counts), per sample: documents cut across samples and
    conversations trained on several answers (gaps written into a store of long documents)."""
    root, _, _ = _gapped_store(tmp_path)
    samples = PackedSamples(root, "train", doc_mask=doc_mask)
    for i in range(len(samples)):
        frames = samples.frames([i])
        assert samples.sequence_count([i]) == trained_sequences(frames.labelled, frames.doc_ids), i
    indices = list(range(len(samples)))
    frames = samples.frames(indices)
    assert samples.sequence_count(indices) == trained_sequences(frames.labelled, frames.doc_ids) > len(indices) // 2


@pytest.fixture(scope="module")
def short_store(tmp_path_factory):
    return bfd_store(tmp_path_factory, longest=30)  # (several documents to a sample)


class _Whole:
    """The store, read whole (no reads by position): read_local_batch cuts the whole global batch."""

    def __init__(self, samples):
        self.samples = samples

    def batch(self, indices):
        return self.samples.batch(indices)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_ranks_weights_are_the_whole_batchs_at_its_tokens(short_store, layout):
    samples = PackedSamples(short_store, "train")
    indices = list(range(0, 16, 2))
    whole = samples.batch(indices)
    labelled, docs = (whole.labels != IGNORE).numpy(), whole.doc_ids.numpy()
    expected, k = _by_hand(labelled, docs)
    assert k > 2 * len(indices)  # (several documents to a sample)
    total = 0.0
    for rt in runtimes(**LAYOUTS[layout]):
        local, count = read_local_batch(rt, samples, indices, loss_weighting="sequence")
        cut, cut_count = read_local_batch(rt, _Whole(samples), indices, loss_weighting="sequence")
        assert count == cut_count == k
        assert torch.equal(local.label_weights, cut.label_weights) and torch.equal(local.labels, cut.labels)
        assert local.label_weights.dtype == torch.float32 and not local.label_weights[local.labels == IGNORE].any()
        total += float(local.label_weights.double().sum())
        plain, labels = read_local_batch(rt, samples, indices)
        assert plain.label_weights is None and labels == int(labelled.sum())
    # each token is held by one rank (dp ranks hold other rows, head x ctx cut a row), each sequence's weights
    # sum to 1
    assert total == pytest.approx(k, rel=1e-6) and expected.sum() == pytest.approx(k, rel=1e-9)


def test_a_steps_loss_is_the_mean_over_sequences_of_their_mean_loss(tmp_path):
    """One step of the debug model: the loss the trainer reports is (1/K) sum_k mean_k, from the model's own
    per-token losses on the step's batch (not the mean over tokens, which differs by more than the check)."""
    import random

    from longctx.config import load_config
    from longctx.step.loss import forward_token_losses
    from longctx.train.trainer import Trainer

    corpus, rng = tmp_path / "docs", random.Random(1)
    corpus.mkdir()
    for i in range(200):  # (several documents to a 128-token sample, of unequal lengths)
        (corpus / f"d{i:03d}.txt").write_text(" ".join(rng.choice(["def", "return", "x", "yield"])
                                                       for _ in range(rng.randint(2, 25))))

    def trainer(name):
        return Trainer(load_config(overrides=[f"--data.corpus={corpus}", "--data.max_docs=0",
            f"--train.run_dir={tmp_path / name}", "--train.steps=1", "--train.seq_len=128", "--train.global_batch=4",
            "--train.eval_interval=0", "--metrics.progress=false", "--metrics.plots=false",
            "--train.device=cpu", "--checkpoint.final=false", "--train.loss_weighting=sequence"]),
            log=lambda *a, **k: None)

    peek = trainer("peek")
    peek.sampler.enter(1)
    ((batch, k),) = peek.sampler.step_batches(1)
    with torch.no_grad():
        each = forward_token_losses(peek.model, batch, None).double()
    labelled = batch.labels != IGNORE
    means = []
    for r in range(batch.tokens.shape[0]):
        for d in batch.doc_ids[r].unique():
            here = (batch.doc_ids[r] == d) & labelled[r]
            if here.any():
                means.append(float(each[r][here].mean()))
    assert len(means) == k > batch.tokens.shape[0]
    by_sequence, by_token = sum(means) / k, float(each[labelled].mean())
    assert abs(by_sequence - by_token) > 1e-3
    loss = trainer("run").run().losses[0]
    assert loss == pytest.approx(by_sequence, rel=1e-5)
