import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx.parallel.context import doc_balance as db
from longctx.parallel.context.doc_balance import docs_balanced_indices
from longctx.parallel.context.layouts import rank_runs, rank_work, token_work, zigzag_positions
from longctx.parallel.context.sequence import shard_indices


def ids_from_lengths(lengths, seed=0) -> np.ndarray:
    """doc ids for documents of these lengths, in an unsorted (shuffled) numbering."""
    lengths = [n for n in lengths if n > 0]
    labels = np.random.default_rng(seed).permutation(len(lengths)) + 7
    return np.repeat(labels, lengths).astype(np.int64)


def ratio(doc_ids, idx) -> float:
    w = rank_work(doc_ids, idx)
    return float(w.max() / w.mean())


def check_layout(doc_ids, idx, ctx, head):
    seq = doc_ids.size
    assert idx.dtype == np.int64
    assert idx.shape == (ctx, head, seq // (ctx * head))
    assert np.array_equal(np.sort(idx.ravel()), np.arange(seq))          # every position exactly once
    per_rank = idx.reshape(ctx, -1)                                       # head pieces in order
    assert (np.diff(per_rank, axis=1) > 0).all()                          # ascending within a ctx rank


def lognormal_lengths(rng, seq, median, sigma=1.2):
    lengths = []
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(median), sigma))))
    lengths[-1] -= sum(lengths) - seq
    return lengths


@st.composite
def cases(draw):
    ctx = draw(st.sampled_from([1, 2, 4, 8]))
    head = draw(st.sampled_from([1, 2, 4]))
    seq = 2 * ctx * head * draw(st.integers(1, 48))
    kind = draw(st.sampled_from(["random", "tiny", "ones", "one_long", "whole", "two"]))
    if kind == "whole":
        lengths = [seq]
    elif kind == "ones":
        lengths = [1] * seq
    elif kind == "two":
        cut = draw(st.integers(1, seq - 1)) if seq > 1 else 1
        lengths = [cut, seq - cut]
    else:
        lengths, left = [], seq
        if kind == "one_long":  # a document longer than a ctx rank's share
            first = draw(st.integers(min(seq, seq // ctx + 1), seq))
            lengths.append(first)
            left -= first
        hi = 4 if kind == "tiny" else max(1, seq // 3)
        while left > 0:
            n = min(left, draw(st.integers(1, hi)))
            lengths.append(n)
            left -= n
        lengths = draw(st.permutations(lengths))
    return ids_from_lengths(lengths, draw(st.integers(0, 3))), ctx, head


# (derandomize: the same examples on every run, so a CI run cannot fail on a draw no other run made)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_exact_partition_sorted_and_never_worse_than_zigzag(case):
    doc_ids, ctx, head = case
    idx = docs_balanced_indices(doc_ids, ctx, head)
    check_layout(doc_ids, idx, ctx, head)
    zz = zigzag_positions(doc_ids.size, ctx, head)
    assert ratio(doc_ids, idx) <= ratio(doc_ids, zz) * (1 + db.TIE) + 1e-12
    assert np.array_equal(idx, docs_balanced_indices(doc_ids, ctx, head))  # deterministic


@pytest.mark.parametrize("ctx, head", [(2, 1), (4, 2), (8, 4), (8, 1)])
def test_special_sequences(ctx, head):
    seq = 8192
    rng = np.random.default_rng(ctx * 10 + head)
    one = np.zeros(seq, dtype=np.int64)                                       # one document: zigzag is exact
    idx = docs_balanced_indices(one, ctx, head)
    check_layout(one, idx, ctx, head)
    assert ratio(one, idx) == pytest.approx(1.0, abs=1e-9)
    assert np.array_equal(idx, zigzag_positions(seq, ctx, head))

    ones = np.arange(seq, dtype=np.int64)                                     # every token its own document
    idx = docs_balanced_indices(ones, ctx, head)
    check_layout(ones, idx, ctx, head)
    assert ratio(ones, idx) == 1.0

    tiny = ids_from_lengths(lognormal_lengths(rng, seq, 3, 0.5))              # 1000+ tiny documents
    assert len(np.unique(tiny)) > 1000
    idx = docs_balanced_indices(tiny, ctx, head)
    check_layout(tiny, idx, ctx, head)
    assert ratio(tiny, idx) < 1.01

    big = seq // ctx + 100                                                    # longer than a rank's share
    rest = lognormal_lengths(rng, seq - big, 200)
    long = ids_from_lengths([*rest[: len(rest) // 2], big, *rest[len(rest) // 2:]], seed=1)
    idx = docs_balanced_indices(long, ctx, head)
    check_layout(long, idx, ctx, head)
    assert ratio(long, idx) < 1.02


def test_rank_work_counts_visible_pairs_and_zigzag_is_todays_layout():
    doc_ids = ids_from_lengths([3, 1, 6, 2, 4])                               # 16 tokens
    for ctx, head in [(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)]:
        idx = docs_balanced_indices(doc_ids, ctx, head)
        brute = []
        for i in range(ctx):
            pairs = 0
            for q in idx[i].ravel():
                pairs += sum(1 for k in range(q + 1) if doc_ids[k] == doc_ids[q] and
                             (doc_ids[k:q + 1] == doc_ids[q]).all())
            brute.append(pairs)
        assert rank_work(doc_ids, idx).tolist() == brute
        zz = zigzag_positions(16, ctx, head)
        for i in range(ctx):
            for j in range(head):
                assert zz[i, j].tolist() == shard_indices(16, ctx, head, i, j).tolist()
    # runs: contiguous same-document stretches of a ctx rank
    idx = np.array([[[0, 1, 2, 5]], [[3, 4, 6, 7]]])
    assert rank_runs(np.array([0, 0, 1, 1, 1, 1, 2, 2]), idx).tolist() == [3, 2]


def test_documents_are_runs_of_equal_ids_not_ids():
    # id 0 appears twice, as two separate documents
    doc_ids = np.array([0] * 8 + [1] * 8 + [0] * 16, dtype=np.int64)
    w = token_work(doc_ids)
    assert w[16] == 1 and w[-1] == 16
    idx = docs_balanced_indices(doc_ids, 2, 2)
    check_layout(doc_ids, idx, 2, 2)
    assert ratio(doc_ids, idx) == pytest.approx(1.0, abs=0.02)


def test_indivisible_sequence_is_an_error():
    with pytest.raises(ValueError, match="not divisible by ctx x head = 4 x 2"):
        docs_balanced_indices(np.zeros(100, dtype=np.int64), 4, 2)


@pytest.mark.parametrize("ctx", [4, 8])
def test_balance_on_real_like_documents(ctx):
    """Lognormal lengths (median ~2K tokens, long tail), concat-packed into 32K samples: the busiest
    ctx rank does at most 5% more than the mean in 90% of the samples (zigzag: ~2x)."""
    rng = np.random.default_rng(ctx)
    seq = 32768
    stream = np.cumsum(lognormal_lengths(rng, 40 * seq, 2000, 1.3))        # document ends, concatenated
    ours, zz = [], []
    for k in range(40):
        ends = stream[(stream > k * seq) & (stream < (k + 1) * seq)] - k * seq
        lengths = np.diff(np.concatenate([[0], ends, [seq]]))
        doc_ids = ids_from_lengths(lengths, seed=k)
        idx = docs_balanced_indices(doc_ids, ctx, 2)
        check_layout(doc_ids, idx, ctx, 2)
        ours.append(ratio(doc_ids, idx))
        zz.append(ratio(doc_ids, zigzag_positions(seq, ctx, 2)))
    assert np.percentile(ours, 90) <= 1.05
    assert max(ours) <= 1.10
    assert np.percentile(zz, 90) > 1.3                                       # the case is not trivial


@pytest.mark.parametrize("ctx, head, seq", [(2, 1, 6), (4, 2, 24), (8, 1, 40), (4, 1, 4)])
def test_sequence_not_divisible_by_two_ctx_still_partitions(ctx, head, seq):
    # seq divisible by ctx x head only: no zigzag to compare with, the assignment is still exact
    doc_ids = ids_from_lengths([seq // 2 + 1, 1, seq - seq // 2 - 2] if seq > 4 else [3, 1])
    idx = docs_balanced_indices(doc_ids, ctx, head)
    check_layout(doc_ids, idx, ctx, head)
