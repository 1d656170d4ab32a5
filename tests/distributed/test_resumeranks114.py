"""A resume that changes a batch or a mix's weights, saved under one world and layout and resumed under another
(audit ranks114): the data position (train/stages.py `cursors`, data/store_mix.py `mix`) is job-wide, so the
samples each step trains on (the union of the data-parallel ranks' rows) are those of one process that made the
same save and resume, each store's order going on where the run left it (no sample repeated or skipped), and the
losses are that process's step by step.

(a) stages "32:2,64:1,32:2" at batch 2, saved after step 1 by 2 data-parallel ranks, resumed at batch 4 by 4
    ranks head 2 x ctx 2: the 32-token store's samples of steps 1, 2, 4 and 5 are its order's first 14.
(b) a mix of two stores at 50:50, saved after step 2 by 4 ranks head 2 x ctx 2, resumed at 80:20
    (--checkpoint.allow_changes) by 2 data-parallel ranks: each store's samples are its own order's first ones.
Every rank saves the same position, the one in trainer_state.json (rank 0 writes it; every rank reads that file),
and a position saved before the record (no `cursors`, no `mix`) resumes at world 4 (a) and 2 (b) as before: with
the config unchanged, exactly as the run never stopped.

Three spawned jobs (world 2, 4, 2: each saved run is resumed by the next); the one-process runs in the test's."""

import json
import shutil
from pathlib import Path

import pytest

from letter_stores import letter_store
from longctx.checkpoint.manifest import hash_files
from longctx.config import load_config
from longctx.data.loader import PackedSamples
from longctx.data.samples import SampleOrder
from longctx.data.store_mix import StoreMix
from longctx.job.spawn import run_spawned_many
from simulated_crash import run_until_crash

# three spawned jobs (2, 4 and 2 ranks) and four one-process runs, all in the module's fixture: 20-30 s on a 2-core
# CPU (under 40 s: not slow)
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--train.warmup_steps=1", "--train.eval_interval=0",
        "--metrics.log_interval=1"]
STAGES = [*TINY, "--train.stages=32:2,64:1,32:2", "--train.global_batch=2", "--data.max_docs=40",
          "--checkpoint.interval=1", "--checkpoint.keep=10"]
MIX = [*TINY, "--train.seq_len=64", "--train.steps=5", "--train.global_batch=4", "--data.weights=0.5,0.5",
       "--checkpoint.interval=2", "--checkpoint.keep=10"]
DP2, HEAD2_CTX2, DP2_CTX2 = [], ["--parallel.head=2", "--parallel.ctx=2"], ["--parallel.ctx=2"]
LOSS_TOLERANCE = 1e-5  # tests/distributed/test_checkpoint.py test_resume_under_another_layout's


def _ckpt(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def _resume(ckpt: Path, saves: str, *changes: str) -> list[str]:
    """A resume of checkpoint `ckpt` (of a run's directory: its config.toml), saving in <its run>/`saves`."""
    return [f"--checkpoint.resume={ckpt}", f"--checkpoint.dir={ckpt.parents[1] / saves}", *changes]


def _identity(samples, k: int) -> tuple:
    """Sample k of the set a stage reads: (blend position, store, its sample) for a mix, else (k, seq_len, k)."""
    return (k, *samples.locate(k)) if hasattr(samples, "locate") else (k, samples.seq_len, k)


def _recording(trainer) -> tuple[dict, dict, dict]:
    """{step: (dp rank, the identities of the rows it trained)}, {step: the data position it saved}, {seq_len: its
    store's samples}, as they fill. A row is recorded as it is read (read ahead too), and the step's as the trainer
    takes the shares."""
    rows, saved, sizes, read, by_share, rt = {}, {}, {}, trainer.sampler.read_local, {}, trainer.rt
    step_batches, save = trainer.sampler.step_batches, trainer.ckpt.save

    def reading(samples, indices):
        share, valid = read(samples, indices)
        mine = list(indices)[rt.dp_rows(len(indices))]  # (the rows read_local_batch read for this rank)
        by_share[id(share)] = [_identity(samples, int(k)) for k in mine]
        sizes[samples.seq_len] = len(samples)
        return share, valid

    def stepping(step):
        batches = step_batches(step)
        rows[step] = (rt.dp_rank, [row for share, _ in batches for row in by_share.pop(id(share))])
        return batches

    def saving(step, model, optimizer, position):
        saved[step] = json.loads(json.dumps(position))
        return save(step, model, optimizer, position)

    trainer.sampler.read_local, trainer.sampler.step_batches, trainer.ckpt.save = reading, stepping, saving
    return rows, saved, sizes


def _train(args: list[str], crash_at: int = 0, run_dir: str = "") -> dict:
    """One rank's (or the one process's) run of `args` (a resume when they name one: the run's saved config, this
    layout), to the start of step `crash_at` (0: the end). Returns its losses by step, rows, saved positions and
    log lines (rank 0's: the others log nothing)."""
    from longctx.config.resume import load_run_config
    from longctx.train.trainer import Trainer

    args = [*args, *([f"--train.run_dir={run_dir}"] if run_dir else [])]
    resume = any(a.startswith("--checkpoint.resume=") for a in args)
    cfg = load_run_config(None, args, layout_given=True)[0] if resume else load_config(None, args)
    lines = []
    trainer = Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    rows, saved, sizes = _recording(trainer)
    losses = {}
    if crash_at:
        run_until_crash(trainer, crash_at)
    else:
        result = trainer.run()
        losses = {result.first_step + i: loss for i, loss in enumerate(result.losses)}
    return {"losses": losses, "rows": rows, "saved": saved, "sizes": sizes, "lines": lines}


def _union(ranks: list[dict], steps) -> dict[int, list[tuple]]:
    """Each step's rows over the job, in blend (order) position: one copy of each data-parallel rank's rows (the
    head x ctx ranks of one data-parallel rank hold the same rows, checked)."""
    out = {}
    for step in steps:
        by_dp = {}
        for rank in ranks:
            dp_rank, rows = rank["rows"][step]
            assert by_dp.setdefault(dp_rank, rows) == rows, (step, dp_rank)
        out[step] = sorted(row for rows in by_dp.values() for row in rows)
    return out


def _same_as_one_process(ranks: list[dict], single: dict, steps, positions: bool = True) -> None:
    """The job's rows of `steps` are the one process's, its losses too (every rank's), every rank saved the same
    positions, and (`positions`) the one process's."""
    assert _union(ranks, steps) == {step: sorted(single["rows"][step][1]) for step in steps}
    for rank in ranks:
        assert sorted(rank["losses"]) == list(steps)
        assert max(abs(rank["losses"][s] - single["losses"][s]) for s in steps) <= LOSS_TOLERANCE
        assert rank["saved"] == ranks[0]["saved"]  # (each rank's position: the same record)
    saved = ranks[0]["saved"]
    assert saved and (not positions or saved == {s: p for s, p in single["saved"].items() if s in saved})


def _as_saved_before(ckpt: Path) -> Path:
    """A copy of checkpoint `ckpt` (in a copy of its run, <run>-before, its config.toml as it is now: a resume
    writes its own) whose data position is as a run before the record saved it: no `cursors`, no `mix` (its
    manifest lists the file's new checksum, and, as one of then could, none of its own)."""
    run = ckpt.parents[1]
    to = run.with_name(f"{run.name}-before") / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, to)
    shutil.copy(run / "config.toml", to.parents[1])
    state = json.loads((to / "trainer_state.json").read_text())
    state["sampler"] = {k: v for k, v in state["sampler"].items() if k not in ("cursors", "mix")}
    (to / "trainer_state.json").write_text(json.dumps(state))
    manifest = json.loads((to / "manifest.json").read_text())
    manifest.pop("checksum")
    entry = next(f for f in manifest["files"] if f["path"] == "trainer_state.json")
    entry.update(hash_files(to, ["trainer_state.json"])["trainer_state.json"])
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> list[str]:
    """Two stores of 64-token samples, 30 and 20 documents, of the letters a and b."""
    tmp, out = tmp_path_factory.mktemp("mix_ranks114"), []
    for letter, n in (("a", 30), ("b", 20)):
        out.append(str(letter_store(tmp, letter, n, chars=50, seed=letter)))
    return out


def _job(key: str, layout: list[str], args: list[str], crash_at: int = 0, run_dir="") -> tuple:
    return key, _train, ([*layout, *args], crash_at, str(run_dir))


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> dict:
    """{name: [each rank's _train record]} of the spawned jobs, {name: the one process's} beside them."""
    tmp = tmp_path_factory.mktemp("ranks114")
    mix = [*MIX, f"--data.path={','.join(stores)}"]
    staged, mixed = tmp / "staged", tmp / "mixed"
    out = {"staged 1": _train(STAGES, run_dir=tmp / "staged-1"), "mixed 1": _train(mix, run_dir=tmp / "mixed-1")}
    out["staged 1 resumed"] = _train(_resume(_ckpt(tmp / "staged-1", 1), "resumed", "--train.global_batch=4"))
    out["mixed 1 resumed"] = _train(_resume(_ckpt(tmp / "mixed-1", 2), "resumed", "--data.weights=0.8,0.2",
                                            "--checkpoint.allow_changes=true"))
    out |= run_spawned_many(2, [_job("staged", DP2, STAGES, 2, staged)])
    out |= run_spawned_many(4, [
        _job("staged resumed", HEAD2_CTX2, _resume(_ckpt(staged, 1), "resumed", "--train.global_batch=4")),
        _job("staged before", DP2_CTX2, _resume(_as_saved_before(_ckpt(staged, 1)), "before-resumed")),
        _job("mixed", HEAD2_CTX2, mix, 3, mixed)])
    out |= run_spawned_many(2, [
        _job("mixed resumed", DP2, _resume(_ckpt(mixed, 2), "resumed", "--data.weights=0.8,0.2",
                                           "--checkpoint.allow_changes=true")),
        _job("mixed before", DP2, _resume(_as_saved_before(_ckpt(mixed, 2)), "before-resumed"))])
    out["dirs"] = {"staged": staged, "mixed": mixed}
    return out


def test_a_batch_raised_on_a_resume_under_another_layout_goes_on_in_the_store_of_its_length(runs):
    """(a): the steps after the resume are the one process's, and the 32-token store's samples of steps 1, 2, 4
    and 5 (batch 2, then 4) its order's first 14, each step a run of them."""
    single = runs["staged 1 resumed"]
    _same_as_one_process(runs["staged resumed"], single, range(2, 6))
    steps = {1: _union(runs["staged"], [1])[1], **_union(runs["staged resumed"], range(2, 6))}
    assert steps[1] == sorted(runs["staged 1"]["rows"][1][1])  # (before the save too)
    assert [len(steps[s]) for s in range(1, 6)] == [2, 4, 4, 4, 4]
    assert {length for s in steps for _, length, _ in steps[s]} == {32, 64}
    order = SampleOrder(runs["staged 1 resumed"]["sizes"][32], 0).next_indices(14)
    drawn = [sorted(k for k, _, _ in steps[s]) for s in (1, 2, 4, 5)]
    assert drawn == [sorted(order[:2]), sorted(order[2:6]), sorted(order[6:10]), sorted(order[10:14])]


def test_a_mix_reweighted_on_a_resume_under_another_layout_goes_on_in_each_store_where_it_was(runs, stores):
    """(b): the steps after the resume are the one process's, and each store's samples over the 5 steps are its
    own order's first ones (the same cursor in the 80:20 blend would have skipped some of store a and repeated
    some of b's), 80:20 after the resume."""
    single = runs["mixed 1 resumed"]
    _same_as_one_process(runs["mixed resumed"], single, range(3, 6))
    steps = {**_union(runs["mixed"], [1, 2]), **_union(runs["mixed resumed"], range(3, 6))}
    assert [steps[s] for s in (1, 2)] == [sorted(runs["mixed 1"]["rows"][s][1]) for s in (1, 2)]  # (before the save)
    reference = StoreMix([PackedSamples(s) for s in stores], stores, [0.5, 0.5], 0)
    own = [reference.locate(k) for k in range(200)]
    for store in (0, 1):
        drawn = [j for s in range(1, 6) for _, t, j in steps[s] if t == store]
        assert drawn == [j for t, j in own if t == store][:len(drawn)], store
    assert [t for s in range(3, 6) for _, t, _ in steps[s]].count(1) < 6  # (of 12: 50:50 would give about 6)
    said = runs["mixed resumed"][0]["lines"]
    assert any("each store goes on from its own place" in line for line in said), said


def test_every_rank_saves_the_position_the_checkpoint_holds(runs):
    """Every rank's position at a save is the same record, the one trainer_state.json holds (rank 0 writes it,
    every rank reads it), and the one process's (a global cursor, a store's counts: no layout in them)."""
    for name, step in (("staged", 1), ("mixed", 2)):
        ranks, single = runs[name], runs[f"{name} 1"]
        assert all(rank["saved"] == ranks[0]["saved"] for rank in ranks) and step in ranks[0]["saved"]
        held = json.loads((_ckpt(runs["dirs"][name], step) / "trainer_state.json").read_text())["sampler"]
        assert held == ranks[0]["saved"][step] == single["saved"][step]
        assert {"cursors", *(["mix"] if name == "mixed" else [])} <= set(held)


def test_a_position_saved_before_the_record_resumes_as_before_at_world_above_one(runs):
    """No `cursors`, no `mix`, the config unchanged, another layout (2 -> 4 ranks dp 2 x ctx 2; 4 -> 2 dp 2): the
    run goes on exactly as the one process that never stopped. Every rank read the position rank 0 wrote (this
    one, edited): none records `cursors` in the positions it saves after it (the stages' cursors unknown, as
    before)."""
    _same_as_one_process(runs["staged before"], runs["staged 1"], range(2, 6), positions=False)
    _same_as_one_process(runs["mixed before"], runs["mixed 1"], range(3, 6), positions=False)
    for name in ("staged before", "mixed before"):
        assert all("cursors" not in p for rank in runs[name] for p in rank["saved"].values()), name
