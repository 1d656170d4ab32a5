"""Which samples each optimizer step trains on, with data.dp_balance active (a sample set with costs), through
the staged loader as the trainer drives it: epochs, stage boundaries, read-ahead, resumes under another
data-parallel degree and grad_accum, and rollbacks. (The other loader tests use sample sets without costs,
where the balancing permutation is never applied.)"""

import numpy as np
import pytest

from longctx.config import load_config
from longctx.data.loader import SampleSet
from longctx.train.stages import StagedLoader

SIZES = {8: 13, 16: 7}  # neither divides its stage's global batch: batches straddle epoch boundaries
STAGES = "8:5:16,16:4:8"
STEPS = 9


class _Costed(SampleSet):
    """n samples of varied real length (so varied cost); batches are never read (read_local names them)."""

    def __init__(self, n, seq_len):
        self.n, self.seq_len, self.doc_mask = n, seq_len, False
        self.real_tokens = np.random.default_rng(seq_len).integers(1, seq_len + 1, n).astype(np.float64)
        self.sq_tokens = self.real_tokens ** 2

    def __len__(self):
        return self.n


_DATA = {length: _Costed(n, length) for length, n in SIZES.items()}


def _loader(dp, grad_accum, read_ahead):
    cfg = load_config(None, [f"--train.stages={STAGES}", "--train.eval_interval=0", "--train.global_batch=8",
                             f"--train.grad_accum={grad_accum}", "--train.seed=7"])
    return StagedLoader(cfg, lambda c: (_DATA[c.train.seq_len], None), dp=dp, read_ahead=read_ahead,
                        read_local=lambda samples, idx: ((samples.seq_len, list(idx)), len(idx)))


def _steps(loader, steps):
    """Per step: its rows in order, as (seq_len, sample) over its micro-batches."""
    out = []
    for step in steps:
        loader.enter(step)
        out.append([(length, i) for (length, idx), _ in loader.step_batches(step) for i in idx])
    return out


def _sets(steps):
    return [sorted(s) for s in steps]


def test_every_epoch_of_every_stage_is_each_sample_once():
    reference = _steps(_loader(1, 1, False), range(1, STEPS + 1))
    assert [len(s) for s in reference] == [16] * 5 + [8] * 4  # each stage's global batch
    assert [{seq for seq, _ in s} for s in reference] == [{8}] * 5 + [{16}] * 4  # each from its own length's data
    for length, n in SIZES.items():
        ids = [i for s in reference for (seq, i) in s if seq == length]
        for e in range(len(ids) // n):
            assert sorted(ids[e * n:(e + 1) * n]) == list(range(n)), (length, e)


@pytest.mark.parametrize("dp, grad_accum", [(1, 4), (4, 1)])
def test_a_balanced_resume_under_another_layout_trains_each_step_on_the_same_samples(dp, grad_accum):
    reference = _steps(_loader(1, 1, False), range(1, STEPS + 1))
    whole = _steps(_loader(2, 2, True), range(1, STEPS + 1))
    assert _sets(whole) == _sets(reference) and whole != reference  # balanced: reordered rows, same samples
    other = _steps(_loader(dp, grad_accum, False), range(1, STEPS + 1))
    for cut in range(1, STEPS):  # mid-epoch, at and after the stage boundary (step 5 is stage 1's last)
        first = _loader(2, 2, True)
        seen = _steps(first, range(1, cut + 1))
        state = first.state_dict()
        first.close()
        resumed = _loader(dp, grad_accum, cut % 2 == 0)
        resumed.load_state_dict(state)
        rest = _steps(resumed, range(cut + 1, STEPS + 1))
        resumed.close()
        assert _sets(seen + rest) == _sets(reference), cut
        assert rest == other[cut:], cut  # the rows in the order an uninterrupted run at that layout has them


@pytest.mark.parametrize("bad, read_at", [(2, 4), (5, 6), (5, 7), (7, 9)])
def test_a_balanced_rollback_goes_on_with_the_batches_after_the_bad_step(bad, read_at):
    reference = _steps(_loader(2, 2, True), range(1, STEPS + 1))
    loader, positions = _loader(2, 2, True), {}
    for step in range(1, read_at + 1):
        _steps(loader, [step])
        positions[step] = loader.state_dict()
    loader.load_state_dict(positions[bad])
    assert _steps(loader, range(bad + 1, STEPS + 1)) == reference[bad:]
    loader.close()


def test_a_stage_that_repeats_its_store_says_how_many_epochs():
    """Stage 1 draws 5 x 16 = 80 samples of a 13-sample store (6.15 epochs), stage 2 4 x 8 = 32 of 7 (4.57):
    each said once, when the stage is entered; a stage within one pass says nothing."""
    said = []
    loader = _loader(1, 1, False)
    loader.log = said.append
    _steps(loader, range(1, STEPS + 1))
    assert said == ["data: stage 1's 80 samples are 6.15 epochs of the store's 13 (each epoch reshuffled; a batch "
                    "across an epoch's end may hold a sample twice)",
                    "data: stage 2's 32 samples are 4.57 epochs of the store's 7 (each epoch reshuffled; a batch "
                    "across an epoch's end may hold a sample twice)"], said
    big = {8: _Costed(80, 8), 16: _Costed(32, 16)}
    cfg = load_config(None, [f"--train.stages={STAGES}", "--train.eval_interval=0", "--train.global_batch=8"])
    quiet = []
    StagedLoader(cfg, lambda c: (big[c.train.seq_len], None), dp=1, log=quiet.append).enter(1)
    assert quiet == []
