"""Each training rank reads only the tokens it holds: its share, read from the memory-mapped store,
is bit for bit the share it used to cut from the whole global batch, under every layout; the read
ahead of the next step changes neither the batches nor the saved data position."""

import functools
import itertools
import random
import threading

import numpy as np
import pytest
import torch

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import BatchLoader, PackedSamples, stack_samples
from longctx.data.samples import IGNORE, Batch
from longctx.data.store import S_LENGTH
from longctx.job.dims import ParallelDims
from longctx.job.runtime import Runtime
from longctx.parallel.context.sequence import attach_layout, layout_of, plan_layout, shard_sequence
from longctx.parallel.context.shares import local_batch, plan_share, read_local_batch
from longctx.train.stages import StagedLoader

SEQ = 64


def bfd_store(tmp_path_factory, longest: int = 90):
    """120 documents of 3 to `longest` bytes packed best-fit into 64-token samples: several per sample,
    some padding."""
    d = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    for i in range(120):
        (d / f"d{i:03d}.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(3, longest))))
    out = tmp_path_factory.mktemp("store") / "s"
    build_store(BuildOptions([str(d)], str(out), SEQ, strategy="bfd", dedup="none", workers=1, progress=False,
                             stats=False), log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return bfd_store(tmp_path_factory)


class _Dim:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


class FakeMesh:
    """The 4-D mesh as Runtime and sequence.py see it: mesh[name].size() and .get_local_rank()."""

    def __init__(self, sizes: dict, ranks: dict):
        self.dims = {n: _Dim(sizes[n], ranks[n]) for n in sizes}

    def __getitem__(self, name):
        return self.dims[name]


NAMES = ("dp_replicate", "dp_shard", "head", "ctx")


def runtimes(dp_replicate=1, dp_shard=1, head=1, ctx=1, seq_balance="docs"):
    """One Runtime per rank of the layout, each with its coordinates in a fake mesh."""
    sizes = dict(zip(NAMES, (dp_replicate, dp_shard, head, ctx)))
    world = dp_replicate * dp_shard * head * ctx
    if world == 1:
        yield Runtime(dims=ParallelDims(world_size=1), seq_balance=seq_balance)
        return
    dims = ParallelDims(dp_replicate, dp_shard, head, ctx, world_size=world)
    for rank, coords in enumerate(itertools.product(*(range(sizes[n]) for n in NAMES))):
        yield Runtime(rank, world, dims, FakeMesh(sizes, dict(zip(NAMES, coords))), None, seq_balance=seq_balance)


# --- the reference: how a rank got its share before (the whole sample read, then cut) -----------------

def whole_sample(samples: PackedSamples, i: int):
    """PackedSamples.sample as it was: the whole row read, labels from the next token of the segment."""
    part, j = samples._locate(i)
    tokens = np.asarray(part.tokens[j], dtype=np.int64)
    segs = samples.segments(i)
    L = samples.seq_len
    real = int(segs[:, S_LENGTH].sum())
    labels = np.full(L, IGNORE, dtype=np.int64)
    if not samples.doc_mask:
        labels[:real - 1] = tokens[1:real]
        return tokens, labels, np.arange(L), None
    lengths = np.append(segs[:, S_LENGTH], L - real) if real < L else segs[:, S_LENGTH]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    doc_ids = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.arange(L) - np.repeat(starts, lengths)
    nxt = np.zeros(L, dtype=bool)
    nxt[:-1] = doc_ids[1:] == doc_ids[:-1]
    nxt[real:] = False
    labels[:-1][nxt[:-1]] = tokens[1:][nxt[:-1]]
    return tokens, labels, positions, doc_ids


def cut_share(rt: Runtime, batch: Batch) -> Batch:
    """local_batch as it was: dp rows, then shard_sequence or the planned layout's shard."""
    if rt.mesh is None:
        return batch
    rows = batch.tokens.shape[0] // rt.dp
    sl = slice(rt.dp_rank * rows, (rt.dp_rank + 1) * rows)
    layout = None
    if batch.doc_ids is not None and rt.dims.head * rt.dims.ctx > 1:
        layout = plan_layout(batch.doc_ids[sl], rt.dims.ctx, rt.dims.head, balance=rt.seq_balance)

    def part(t):
        if t is None:
            return None
        return shard_sequence(t[sl], rt.mesh, seq_dim=1) if layout is None else layout.shard(t[sl], rt.mesh)

    local = Batch(part(batch.tokens), part(batch.labels), part(batch.positions), part(batch.doc_ids))
    if layout is not None:
        attach_layout(local.doc_ids, layout)
    return local


def assert_same(a: Batch, b: Batch):
    for name in ("tokens", "labels", "positions", "doc_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), name
    la, lb = ((None if t.doc_ids is None else layout_of(t.doc_ids)) for t in (a, b))
    assert (la is None) == (lb is None)
    if la is not None:
        assert np.array_equal(la.positions, lb.positions) and np.array_equal(la.doc_ids, lb.doc_ids)


LAYOUTS = {
    "one process": {},
    "dp2": dict(dp_shard=2),
    "dp2 x ctx2 zigzag": dict(dp_shard=2, ctx=2, seq_balance="zigzag"),
    "dp2 x ctx2 docs": dict(dp_shard=2, ctx=2),
    "head2 x ctx2 docs": dict(head=2, ctx=2),
    "head4": dict(head=4),
    "replicate2 x shard2 x ctx2": dict(dp_replicate=2, dp_shard=2, ctx=2),
    "ctx4 docs": dict(ctx=4),
}


@pytest.mark.parametrize("doc_mask", [True, False], ids=["doc masks", "no doc masks"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reading_only_the_share_gives_the_share_cut_from_the_whole_batch(store, layout, doc_mask):
    samples = PackedSamples(store, doc_mask=doc_mask)
    assert (samples.real_tokens < SEQ).any() and (np.diff(samples.sq_tokens) != 0).any()  # padding, mixed docs
    itemsize = samples.parts[0].tokens.dtype.itemsize
    ranks = list(runtimes(**LAYOUTS[layout]))
    loader = BatchLoader(samples, 8, seed=1, dp=ranks[0].dp)
    for _ in range(3):
        indices = loader.next_indices()
        whole = stack_samples([whole_sample(samples, i) for i in indices], doc_mask)
        assert_same(samples.batch(indices), whole)  # the whole batch, read through the same gather
        covered = torch.zeros(len(indices), SEQ, dtype=torch.int64)
        for rt in ranks:
            before = samples.bytes_read
            share, valid = read_local_batch(rt, samples, indices)
            read = samples.bytes_read - before
            expected = cut_share(rt, whole)
            assert_same(share, expected)
            assert_same(local_batch(rt, whole), expected)
            assert valid == whole.valid_tokens
            # what it read: the tokens it holds, plus at most one label look-ahead per run of them
            held = plan_share(rt, whole.doc_ids[rt.dp_rows(len(indices))] if doc_mask else None,
                                 share.tokens.shape[0], SEQ)[1]
            held = torch.arange(SEQ).expand(share.tokens.shape[0], -1) if held is None else held
            runs = int((held[:, 1:] != held[:, :-1] + 1).sum()) + held.shape[0]
            assert share.tokens.numel() * itemsize <= read <= (share.tokens.numel() + runs) * itemsize
            covered[rt.dp_rows(len(indices))] += torch.zeros(held.shape[0], SEQ, dtype=torch.int64).scatter_(
                1, held, 1)
        assert torch.equal(covered, torch.ones_like(covered))  # every token of the batch held by one rank


def test_a_whole_process_reads_the_batch_once(store):
    samples = PackedSamples(store)
    rt = next(runtimes())
    indices = [3, 1, 4, 1 + 4]
    share, valid = read_local_batch(rt, samples, indices)
    assert samples.bytes_read == len(indices) * SEQ * samples.parts[0].tokens.dtype.itemsize
    assert valid == int((share.labels != IGNORE).sum())


def test_a_sample_set_that_cannot_read_by_position_is_read_whole_and_cut(store):
    class Whole:  # e.g. the synthetic mixture: only batch()
        def __init__(self, samples):
            self.samples = samples

        def batch(self, indices):
            return self.samples.batch(indices)

    samples = PackedSamples(store)
    for rt in runtimes(dp_shard=2, ctx=2):
        share, valid = read_local_batch(rt, Whole(samples), [0, 5, 2, 7])
        whole = samples.batch([0, 5, 2, 7])
        assert_same(share, cut_share(rt, whole))
        assert valid == whole.valid_tokens


# --- reading the next step ahead ---------------------------------------------------------------------

from test_stages import _Samples  # noqa: E402 - sample i is all i


def _loader(read_ahead, stages="8:3,16:3", read_local=None, grad_accum=2):
    cfg = load_config(None, [f"--train.stages={stages}", "--train.eval_interval=0", "--train.global_batch=4",
                             f"--train.grad_accum={grad_accum}"])
    build = lambda c: (_Samples(10 * c.train.seq_len, c.train.seq_len), None)  # noqa: E731
    kwargs = {"read_local": read_local} if read_local else {}
    return StagedLoader(cfg, build, dp=1, read_ahead=read_ahead, **kwargs)


def _steps(loader, steps):
    """Per step: the samples of each micro-batch, its length, and the data position after it."""
    out = []
    for step in steps:
        loader.enter(step)
        shares = loader.step_batches(step)
        out.append(([(b.tokens.shape[1], b.tokens[:, 0].tolist(), v) for b, v in shares], loader.state_dict()))
    return out


def _read_threads():
    return [t for t in threading.enumerate() if t.name == "longctx-read-ahead"]


def test_read_ahead_hands_out_the_same_batches_and_saves_the_position_of_those_handed_out():
    reference = _steps(_loader(False), range(1, 7))
    ahead = _loader(True)
    assert _steps(ahead, range(1, 7)) == reference
    ahead.close()
    assert not _read_threads()
    for saved_at in (1, 2, 3, 4, 5):  # inside stage 1, at its last step, inside stage 2
        first = _loader(True)
        _steps(first, range(1, saved_at + 1))
        assert first._ahead is not None or saved_at in (3, 6)  # a step was read ahead (not past a stage's end)
        state = first.state_dict()
        assert state == reference[saved_at - 1][1]
        # loading a position drops what was read ahead: the same loader goes on from the saved step
        first.load_state_dict(state)
        assert _steps(first, range(saved_at + 1, 7)) == reference[saved_at:]
        resumed = _loader(True)
        resumed.enter(1)
        resumed.load_state_dict(state)
        assert _steps(resumed, range(saved_at + 1, 7)) == reference[saved_at:], saved_at
        for loader in (first, resumed):
            loader.close()
    assert not _read_threads()


def test_a_step_out_of_turn_drops_the_read_ahead_and_the_order_stays_exact():
    reference = _steps(_loader(False), range(1, 4))
    ahead = _loader(True)
    _steps(ahead, [1])
    ahead.next_batch()  # a whole global batch drawn now: the read-ahead step is dropped first
    again = _loader(False)
    _steps(again, [1])
    again.next_batch()
    assert _steps(ahead, [2, 3]) == _steps(again, [2, 3])
    fresh = _loader(True)
    assert _steps(fresh, [1, 2]) == reference[:2]
    for loader in (ahead, fresh):
        loader.close()


def test_an_error_in_the_read_ahead_is_raised_in_the_loop_with_its_traceback():
    calls = []

    def failing_read(samples, indices):
        calls.append(indices)
        if len(calls) == 3:  # step 2's first micro-batch: read on the thread
            raise ValueError("unreadable sample")
        batch = samples.batch(indices)
        return batch, batch.valid_tokens

    earlier = set(_read_threads())  # (an earlier test's loader left unclosed may still be reading, on a busy machine)
    loader = _loader(True, read_local=failing_read)
    loader.enter(1)
    loader.step_batches(1)
    with pytest.raises(ValueError, match="unreadable sample") as err:
        loader.step_batches(2)
    assert any(entry.name == "failing_read" for entry in err.traceback)
    assert not set(_read_threads()) - earlier


def test_a_synthetic_mixture_reaches_each_step_whole_with_its_answer_labels(tmp_path):
    """The training path of a mixture (data.synthetic): its retrieval samples, not the store's rows
    under them, are what each step trains on, through the per-rank read and the read ahead."""
    from longctx.data.synthetic import SyntheticMixture
    from longctx.data.tokenizer import ByteTokenizer

    (tmp_path / "doc.txt").write_text("".join(random.Random(1).choice("abcdefgh \n") for _ in range(20000)))
    build_store(BuildOptions([str(tmp_path / "doc.txt")], str(tmp_path / "s"), 128, dedup="none", workers=1,
                             progress=False, stats=False), log=lambda *a: None)
    mix = SyntheticMixture(PackedSamples(tmp_path / "s", "train", False), "passkey", 0.5, seed=0,
                           tokenizer=ByteTokenizer())
    cfg = load_config(None, ["--train.seq_len=128", "--train.eval_interval=0", "--train.global_batch=8",
                             "--train.grad_accum=2", "--train.steps=4"])
    rt = next(runtimes())
    loader = StagedLoader(cfg, lambda c: (mix, None), dp=1, read_local=functools.partial(read_local_batch, rt),
                          read_ahead=True)
    order = StagedLoader(cfg, lambda c: (mix, None), dp=1)  # the same draws, as indices
    order.enter(1)
    seen_synthetic = 0
    for step in range(1, 5):
        loader.enter(step)
        for share, valid in loader.step_batches(step):
            indices = order.loader.next_indices()
            rows = [mix.sample(i) for i in indices]
            assert torch.equal(share.tokens, torch.as_tensor(np.stack([r[0] for r in rows])))
            assert torch.equal(share.labels, torch.as_tensor(np.stack([r[1] for r in rows])))
            assert valid == sum(int((r[1] != IGNORE).sum()) for r in rows)
            seen_synthetic += int(mix.synthetic[indices].sum())
    loader.close()
    assert seen_synthetic >= 8  # about half of the 32 samples drawn
