"""A randomized audit of the training data order over resumes, one store per length (mixes: test_mix_fuzz115.py).

Driven at the level training reads it (data/loader.py BatchLoader, train/stages.py StagedLoader), each data-parallel
rank simulated by its rows of the global batch as job/runtime.py dp_rows slices them (what local_batch takes). Random
store sizes (epochs crossed), batches, data-parallel sizes, grad accumulation, cost balance on and off, train.stages
of 1-3 lengths (a length read again later), read ahead on and off, resumes at random steps (state_dict through JSON
-> a fresh loader -> load_state_dict, as a checkpoint carries it). The reference, not taken from the code audited:

1. resumed with the same settings, every rank reads exactly the rows an uninterrupted run gives it, in order;
2. with another data-parallel size, global batch (train.global_batch or a stage's own) or grad accumulation on a
   resume (docs/running.md: "draws on from the saved cursor ... no sample is skipped or drawn twice"), each length's
   store gives, batch after batch, the next samples of its seeded order (a fresh SampleOrder's stream over the
   samples every rank read together), whose every epoch is a permutation of the store: no repeat, no skip;
3. each global batch is split over the ranks whole (rows B / dp each, together the batch);
4. a refused position (another train.seed, sample count, or a store rebuilt with other content) is refused before
   anything changes: the loader reads on exactly as a twin that was never offered it;
5. a rollback (the live loader given a position it saved earlier, maybe another stage's) reads again exactly what
   the run read from there.
"""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from letter_stores import letter_store
from longctx.config import load_config
from longctx.data.loader import BatchLoader, PackedSamples
from longctx.data.samples import SampleOrder
from longctx.errors import DataError
from longctx.job.runtime import Runtime
from longctx.train.stages import StagedLoader, stages_of

LOADER_CASES = range(14)
STAGE_CASES = range(14)
REFUSAL_CASES = range(4)


class _Samples:
    """n samples, never read (only their order and costs matter here); random costs for the balance."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self._costs = np.random.default_rng([seed, n]).integers(1, 1000, n).astype(np.float64)

    def __len__(self) -> int:
        return self.n

    def costs(self, a: float, b: float) -> np.ndarray:
        return self._costs


def _shares(indices: list[int], dp: int) -> list[list[int]]:
    """Each rank's rows of a global batch, as the runtime slices it (Runtime.dp_rows)."""
    out = [list(indices[Runtime.dp_rows(SimpleNamespace(dp=dp, dp_rank=r), len(indices))]) for r in range(dp)]
    assert sorted(i for share in out for i in share) == sorted(indices), (indices, out)  # (3: the batch, whole)
    assert {len(share) for share in out} == {len(indices) // dp}
    return out


def _stream(n: int, seed: int, count: int) -> list[int]:
    """The first `count` samples of a store's seeded order, each epoch checked to be a permutation (2)."""
    got = SampleOrder(n, seed).next_indices(count)
    for start in range(0, count - n + 1, n):
        assert sorted(got[start:start + n]) == list(range(n)), f"epoch at {start} repeats or skips"
    return got


def _through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


def _check_stream(batches: list[list[int]], stream: list[int], what) -> None:
    """Global batches (rows in any order) are the stream's consecutive slices, in order (2)."""
    at = 0
    for k, batch in enumerate(batches):
        assert sorted(batch) == sorted(stream[at:at + len(batch)]), (what, k, at)
        at += len(batch)


def _loader_case(case: int) -> dict:
    rng = random.Random(1160 + case)
    dp = rng.choice([1, 1, 2, 3, 4])
    return {"n": rng.randint(3, 30), "seed": rng.randint(0, 2 ** 31), "dp": dp,
            "batch": dp * rng.randint(1, 4), "balance": rng.random() < 0.7, "steps": rng.randint(8, 30),
            "rng": rng}


def _batch_loader(samples, c: dict, dp: int, batch: int) -> BatchLoader:
    return BatchLoader(samples, batch, c["seed"], dp=dp, balance=c["balance"], cost=(1.0, 0.0))


@pytest.mark.parametrize("case", LOADER_CASES)
def test_batch_loader_resumes_read_what_an_uninterrupted_run_reads(case):
    """BatchLoader: resumed at random steps with the same settings, each rank reads the uninterrupted run's rows
    (1); resumed at random steps with other dp / batch sizes, the samples go on in the store's order (2)."""
    c = _loader_case(case)
    rng, samples = c["rng"], _Samples(c["n"], c["seed"])
    whole = _batch_loader(samples, c, c["dp"], c["batch"])
    reference = [_shares(whole.next_indices(), c["dp"]) for _ in range(c["steps"])]
    _check_stream([[i for s in step for i in s] for step in reference],
                  _stream(c["n"], c["seed"], c["steps"] * c["batch"]), c)
    got, loader = [], _batch_loader(samples, c, c["dp"], c["batch"])
    for _ in range(c["steps"]):
        if rng.random() < 0.3:
            state = _through_json(loader.state_dict())
            loader = _batch_loader(samples, c, c["dp"], c["batch"])
            assert loader.load_state_dict(state) is None
        got.append(_shares(loader.next_indices(), c["dp"]))
    assert got == reference, c
    # the data-parallel size and the batch changed at each resume
    batches, loader, drawn = [], _batch_loader(samples, c, c["dp"], c["batch"]), 0
    for _ in range(c["steps"]):
        if rng.random() < 0.4:
            dp = rng.choice([1, 2, 3, 4])
            state = _through_json(loader.state_dict())
            loader = _batch_loader(samples, c, dp, dp * rng.randint(1, 4))
            assert loader.load_state_dict(state, allow_changes=rng.random() < 0.5) is None
            assert loader.state_dict()["cursor"] == drawn
        shares = _shares(loader.next_indices(), loader.dp)
        batches.append([i for s in shares for i in s])
        drawn += len(batches[-1])
    _check_stream(batches, _stream(c["n"], c["seed"], drawn), c)


LENGTHS = (8, 16, 32)


def _plan(rng: random.Random, dp: int, accum: int, stages: list[tuple[int, int]]) -> tuple[str, int]:
    """train.stages with random own batches (or none: train.global_batch) and train.global_batch, each a multiple of
    dp x grad_accum (the layout's rule: every micro-batch splits over the ranks whole)."""
    unit = dp * accum
    parts = [f"{length}:{steps}" + (f":{unit * rng.randint(1, 3)}" if rng.random() < 0.5 else "")
             for length, steps in stages]
    return ",".join(parts), unit * rng.randint(1, 3)


def _staged(plan: str, batch: int, accum: int, dp: int, seed: int, sizes: dict, read_ahead: bool,
            balance: bool) -> StagedLoader:
    cfg = load_config(None, [f"--train.stages={plan}", f"--train.global_batch={batch}", f"--train.grad_accum={accum}",
                             f"--train.seed={seed}", "--train.eval_interval=0", f"--data.dp_balance={balance}"])

    def read_local(samples, indices):  # (which store, each rank's rows)
        return (samples.n, _shares(list(indices), dp)), len(indices)

    return StagedLoader(cfg, lambda stage_cfg: (_Samples(sizes[stage_cfg.train.seq_len], seed), None), dp,
                        read_local=read_local, read_ahead=read_ahead)


def _stage_case(case: int) -> dict:
    rng = random.Random(11600 + case)
    k = rng.randint(1, 3)
    lengths = [rng.choice(LENGTHS) for _ in range(k)]
    stages = [(length, rng.randint(1, 5)) for length in lengths]
    dp, accum = rng.choice([1, 1, 2, 4]), rng.choice([1, 1, 2])
    plan, batch = _plan(rng, dp, accum, stages)
    return {"rng": rng, "stages": stages, "dp": dp, "accum": accum, "plan": plan, "batch": batch,
            "seed": rng.randint(0, 1000), "sizes": {n: rng.randint(3, 25) for n in LENGTHS},
            "balance": rng.random() < 0.7, "read_ahead": rng.random() < 0.5}


def _run_steps(make, steps: int, resume_at: set, change, rng: random.Random | None = None) -> list:
    """Steps 1..steps as the trainer runs them; at each step in `resume_at` (after the step before it was saved) a
    fresh loader (`change()`'s settings) given the saved position, its first stage entered before or not (`rng`).
    Each step's micro-batches, as each rank's rows."""
    out, loader = [], make(None)
    for step in range(1, steps + 1):
        if step in resume_at:
            state = _through_json(loader.state_dict())
            loader.close()
            loader = make(change())
            if rng is None or rng.random() < 0.5:
                loader.enter(1)  # (what the trainer builds before it knows the checkpoint's step)
            loader.load_state_dict(state)
        loader.enter(step)
        out.append([share for share, _ in loader.step_batches(step)])
        assert loader.position_note is None, loader.position_note
    loader.close()
    return out


@pytest.mark.parametrize("case", STAGE_CASES)
def test_staged_resumes_read_what_an_uninterrupted_run_reads(case):
    """StagedLoader: the same settings resumed at random steps read the uninterrupted run's rows on every rank (1);
    resumed with other dp / grad_accum / global and stage batches, each length's store goes on in its order (2)."""
    c = _stage_case(case)
    rng, steps = c["rng"], sum(s for _, s in c["stages"])
    same = dict(plan=c["plan"], batch=c["batch"], accum=c["accum"], dp=c["dp"])

    def make(changed):
        s = changed or same
        return _staged(s["plan"], s["batch"], s["accum"], s["dp"], c["seed"], c["sizes"], c["read_ahead"],
                       c["balance"])

    whole = _run_steps(make, steps, set(), lambda: None)
    resumes = {s for s in range(2, steps + 1) if rng.random() < 0.4}
    assert _run_steps(make, steps, resumes, lambda: None, rng) == whole, (c, resumes)
    _check_lengths(c, stages_of(make(None).cfg), whole)
    _check_rollbacks(make(None), steps, whole, rng)

    def change():
        dp, accum = rng.choice([1, 2, 4]), rng.choice([1, 2])
        plan, batch = _plan(rng, dp, accum, c["stages"])
        return dict(plan=plan, batch=batch, accum=accum, dp=dp)

    changed = _run_steps(make, steps, {s for s in range(2, steps + 1) if rng.random() < 0.4}, change)
    _check_lengths(c, None, changed)


def _check_rollbacks(loader: StagedLoader, steps: int, whole: list, rng: random.Random) -> None:
    """A rollback (train/rollback.py: the live loader given a position it saved before, maybe of another stage) reads
    again from there exactly what the run read (1)."""
    saved, step, back = {}, 1, 2
    while step <= steps:
        loader.enter(step)
        assert [share for share, _ in loader.step_batches(step)] == whole[step - 1], step
        saved[step + 1] = _through_json(loader.state_dict())  # (the position a checkpoint of `step` holds)
        if back and step > 1 and rng.random() < 0.3:
            back -= 1
            step = rng.randint(2, step + 1)
            loader.load_state_dict(saved[step])
        else:
            step += 1
    loader.close()


def _check_lengths(c: dict, stages, run: list) -> None:
    """Every micro-batch handed out, by store (every rank's rows together): each store's consecutive batches are
    its order's consecutive slices (2); with `stages`, each stage drew its planned steps x batch."""
    by_store: dict[int, list[list[int]]] = {}
    for step in run:
        for n, shares in step:
            by_store.setdefault(n, []).append([i for share in shares for i in share])
    for n, batches in by_store.items():
        _check_stream(batches, _stream(n, c["seed"], sum(map(len, batches))), (c, n))
    if stages is not None:
        want: dict[int, int] = {}
        for s in stages:
            want[c["sizes"][s.seq_len]] = want.get(c["sizes"][s.seq_len], 0) + (
                s.last_step - s.first_step + 1) * s.global_batch
        assert {n: sum(map(len, b)) for n, b in by_store.items()} == want, c


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A store, the same documents rebuilt with other text (same name), and one of another sample count."""
    tmp = tmp_path_factory.mktemp("loaderfuzz116")
    return {"a": letter_store(tmp, "a", 14, numbered=True, chars=(20, 70)),
            "rebuilt": letter_store(tmp / "v2", "a", 14, numbered=True, chars=(20, 70), seed=7),
            "more": letter_store(tmp / "v3", "a", 23, numbered=True, chars=(20, 70))}


def _position_refused(c: dict, stores: dict, what: str) -> tuple[dict, object]:
    """A position another run saved on other data or another seed, and the samples this run reads."""
    rng = c["rng"]
    other = PackedSamples(stores["rebuilt" if what == "rebuilt" else "more" if what == "count" else "a"])
    saver = BatchLoader(other, c["batch"], c["seed"] + (1 if what == "seed" else 0), dp=c["dp"], balance=c["balance"])
    for _ in range(rng.randint(0, 6)):
        saver.next_indices()
    state = _through_json(saver.state_dict())
    if what == "count":  # (a position saved before identities were recorded: the count alone tells the stores apart)
        del state["store"]
    return state, PackedSamples(stores["a"])


@pytest.mark.parametrize("case", REFUSAL_CASES)
def test_a_refused_position_changes_nothing(case, stores):
    """(4) Another seed, another sample count, a store rebuilt with other content: refused with the loader as it
    was (its position and the rows it reads next, as a twin never offered the position reads them)."""
    c = _loader_case(case)
    rng = c["rng"]
    for what, said in (("seed", "drawn with seed"), ("count", "training samples but the data has"),
                       ("rebuilt", "rebuilt with other content")):
        state, samples = _position_refused(c, stores, what)
        loader, twin = (_batch_loader(samples, c, c["dp"], c["batch"]) for _ in range(2))
        for _ in range(rng.randint(0, 5)):
            loader.next_indices()
            twin.next_indices()
        before = copy.deepcopy(loader.state_dict())
        with pytest.raises(DataError, match=said):
            loader.load_state_dict(state)
        assert loader.state_dict() == before, what
        for _ in range(len(samples) // c["batch"] + 2):  # across the epoch's end
            assert loader.next_indices() == twin.next_indices(), what
    # the rebuilt store under --checkpoint.allow_changes: the same cursor, its own order from there
    state, samples = _position_refused(c, stores, "rebuilt")
    loader = _batch_loader(samples, c, c["dp"], c["batch"])
    assert "allow_changes" in loader.load_state_dict(state, allow_changes=True)
    drawn = [loader.next_indices() for _ in range(4)]
    stream = _stream(len(samples), c["seed"], state["cursor"] + 4 * c["batch"])[state["cursor"]:]
    _check_stream(drawn, stream, c)
