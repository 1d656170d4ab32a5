"""Checkpoints: save under one layout, resume under another; atomic commit; verify; export.

Starting ranks costs seconds per job, so the 4-rank runs of the resume, async-save and auto-resume
tests run in two spawned jobs (run_spawned_many, fixture `halves`): every first half (the run that
saves), then, once the files are as each test wants them, every second half (the run that
resumes); each configuration keeps its own run directory, and the tests check their own."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from longctx.checkpoint.manager import CheckpointManager, latest_checkpoint, verification_shares
from longctx.checkpoint.manifest import CheckpointError, hash_files, owner_rank, verify, write_manifest
from longctx.checkpoint.rng_states import _load_rng
from longctx.config import load_config
from longctx.durable import DirectoryInUse, lock_directory
from longctx.job.spawn import run_spawned, run_spawned_many
from longctx.train.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
# (a command whose test reads what it writes and says, not how its process ends, runs in this process: a new
# interpreter's imports cost seconds)
from test_newcomer import longctx_here  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--train.steps=6", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=300", "--train.seq_len=256"]
LAYOUTS = {
    "single": (1, []),
    "dp2-ctx2": (4, ["--parallel.ctx=2"]),
    "head2-ctx2": (4, ["--parallel.head=2", "--parallel.ctx=2"]),
    "ctx4-window2": (4, ["--parallel.ctx=4", "--parallel.window=2"]),
    "dp4": (4, []),
    "dp2-ctx2-ctxfirst": (4, ["--parallel.ctx=2", "--parallel.placement=ctx-first"]),
}


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    res = train(cfg, log=lambda *a, **k: None)
    return res.first_step, res.losses


def _train_logged(args, run_dir):
    """(first step, losses, rank 0's log lines)."""
    lines = []
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    res = train(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return res.first_step, res.losses, lines


def run_layout(layout, args, run_dir, fn=_train):
    world, layout_args = LAYOUTS[layout]
    if world == 1:
        return fn([*layout_args, *args], run_dir)
    return run_spawned(world, fn, [*layout_args, *args], str(run_dir))[0]


def flip_byte(path: Path) -> None:
    """Damage a file the way a bad disk or a partial copy would: same size, one byte different."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    # (only its losses are read: no final checkpoint to save)
    return run_layout("single", ["--checkpoint.final=false"], tmp_path_factory.mktemp("full"))[1]


RESUMES = [("dp2-ctx2", "head2-ctx2"), ("head2-ctx2", "single"), ("single", "ctx4-window2"),
           ("dp4", "dp2-ctx2-ctxfirst")]
SAVE = ["--checkpoint.interval=3", "--checkpoint.keep=2"]  # train to step 6 saving at 3 and 6, keep both
AUTO = ["--checkpoint.resume=auto", "--checkpoint.interval=0", "--checkpoint.final=false"]  # resume without saving
DAMAGED = "head2-ctx2"  # test_auto_resume_skips_a_damaged_checkpoint's 4-rank layout


def _resume_args(run_dir):
    return [f"--checkpoint.resume={run_dir / 'checkpoints' / 'step-00000003'}",
            "--checkpoint.dir=" + str(run_dir / "b")]


def flip_last_shard(run_dir, world) -> Path:
    """One flipped byte in the last rank's shard of the latest checkpoint: same size, only its
    checksum tells; with 4 ranks another rank than 0 may be the one that finds it."""
    shard = run_dir / "checkpoints" / "step-00000006" / f"__{world - 1}_0.distcp"
    flip_byte(shard)
    return shard


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """The 4-rank runs of the tests below, two jobs in all: {key: rank 0's result}, {key: run directory}.
    First job: resume first halves (`first A B`), the async saves (`async`), the damaged run's first
    half (`damaged first`); single-process first halves run here too. Between: the latest checkpoint
    of the damaged run gets its flipped byte. Second job: resumes under B (`second A B`; a
    single-process B is its test's), the damaged run's auto-resume (`damaged auto`, logged). A first half
    under DAMAGED's layout is not trained again: it is the damaged run's, copied before the byte is flipped."""
    base = tmp_path_factory.mktemp("halves")
    dirs = {f"{a} {b}": base / f"{a}-to-{b}" for a, b in RESUMES}
    dirs |= {"async": base / "async", "damaged": base / "damaged"}

    def job(key, layout, args, run_dir, fn=_train):  # run_layout(layout, args, run_dir, fn) as a job
        return key, fn, ([*LAYOUTS[layout][1], *args], str(run_dir))

    # (a first half under DAMAGED is the damaged run's own first half, the same run: copied before the damage)
    first = [job(f"first {a} {b}", a, SAVE, dirs[f"{a} {b}"]) for a, b in RESUMES if a not in ("single", DAMAGED)]
    first += [job("async", "dp2-ctx2", ["--checkpoint.interval=2", "--checkpoint.keep=2", "--checkpoint.async=true"],
                  dirs["async"]),
              job("damaged first", DAMAGED, SAVE, dirs["damaged"])]
    results = {key: per_rank[0] for key, per_rank in run_spawned_many(4, first).items()}
    for a, b in RESUMES:
        if a == "single":
            results[f"first {a} {b}"] = run_layout(a, SAVE, dirs[f"{a} {b}"])
        elif a == DAMAGED:
            shutil.copytree(dirs["damaged"], dirs[f"{a} {b}"])
            results[f"first {a} {b}"] = results["damaged first"]
    results["damaged shard"] = flip_last_shard(dirs["damaged"], LAYOUTS[DAMAGED][0])
    second = [job(f"second {a} {b}", b, _resume_args(dirs[f"{a} {b}"]), dirs[f"{a} {b}"]) for a, b in RESUMES
              if b != "single"]
    second += [job("damaged auto", DAMAGED, AUTO, dirs["damaged"], fn=_train_logged)]
    results |= {key: per_rank[0] for key, per_rank in run_spawned_many(4, second).items()}
    return results, dirs


@pytest.mark.parametrize("a, b", RESUMES)
def test_resume_under_another_layout(a, b, uninterrupted, halves):
    # layout A: train to step 6 saving at step 3 (keep both checkpoints), then resume at 3 under B
    results, dirs = halves
    run_dir = dirs[f"{a} {b}"]
    three = run_dir / "checkpoints" / "step-00000003"
    assert verify(three)["layout"]["world"] == LAYOUTS[a][0]
    if b == "single":
        first, losses = run_layout(b, _resume_args(run_dir), run_dir)
    else:
        first, losses = results[f"second {a} {b}"]
    assert first == 4 and len(losses) == 3 and len(uninterrupted) == 6
    diff = max(abs(x - y) for x, y in zip(losses, uninterrupted[3:]))
    print(f"{a} -> {b}: steps 4-6 max |loss - uninterrupted| = {diff:.2e}")
    assert diff <= 1e-5


def test_async_saves_commit_atomically_and_prune(halves):
    ckpts = halves[1]["async"] / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["latest", "step-00000004", "step-00000006"], names  # step 2's pruned
    assert latest_checkpoint(ckpts).name == "step-00000006"
    m = verify(ckpts / "step-00000006")
    assert m["step"] == 6 and m["layout"]["ctx"] == 2 and all(f["sha256"] for f in m["files"])
    # every rank's shard and RNG state is listed (each hashed by the rank that wrote it), the merged
    # per-rank checksum parts are gone
    expected = {".metadata", "trainer_state.json", *(f"__{r}_0.distcp" for r in range(4)),
                *(f"rng-rank{r}.pt" for r in range(4))}
    assert {f["path"] for f in m["files"]} == expected
    assert {p.name for p in (ckpts / "step-00000006").iterdir()} == expected | {"manifest.json"}


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    _train(["--checkpoint.interval=10", "--train.steps=10"], tmp_path)
    ck = tmp_path / "checkpoints" / "step-00000010"
    # another model shape
    with pytest.raises(CheckpointError, match="another model .*dim 128 in the checkpoint vs 64 configured"):
        _train([f"--checkpoint.resume={ck}", "--model.dim=64", "--checkpoint.dir=" + str(tmp_path / "x")],
               tmp_path / "other")
    # truncated shard
    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        verify(ck)
    # missing shard
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        _train([f"--checkpoint.resume={ck}", "--checkpoint.dir=" + str(tmp_path / "y")], tmp_path / "other2")
    # an interrupted save (no manifest) is not a checkpoint
    (ck / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete longctx checkpoint"):
        verify(ck)


def test_the_last_step_is_saved_even_off_the_interval(tmp_path):
    # 7 steps, interval 3: saves at 3, 6 and the run's end, 7; a longer run then continues from 7
    _train(["--checkpoint.interval=3", "--checkpoint.keep=5", "--train.steps=7"], tmp_path)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003", "step-00000006", "step-00000007"]
    assert latest_checkpoint(ckpts).name == "step-00000007"
    # extending the finished run to 10 steps continues after its last step
    first, losses = _train(["--checkpoint.resume=auto", "--checkpoint.interval=0", "--train.steps=10"], tmp_path)
    assert first == 8 and len(losses) == 3


def test_export_to_hf_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, losses = _train(["--checkpoint.interval=4", "--train.steps=4"], tmp_path)
    r = longctx_here("checkpoint", "export", str(tmp_path / "checkpoints"), str(tmp_path / "hf"), "--to", "hf")
    assert r.returncode == 0, r.stderr
    # (the one run of `checkpoint verify` as its own process)
    r = subprocess.run([sys.executable, "-m", "longctx", "checkpoint", "verify", str(tmp_path / "checkpoints")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "checksums match" in r.stdout, r.stderr
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.models.hf import load_hf
    from longctx.models.llama import build_model

    ours = build_model(load_config("configs/debug.toml").model, seed=None)
    load_model_weights(tmp_path / "checkpoints" / "step-00000004", ours)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 258, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4
    # import back: the imported model gives identical losses, and training starts from it
    back = load_hf(tmp_path / "hf")
    labels = tokens.roll(-1, 1)
    assert back(tokens, labels=labels).item() == ours(tokens, labels=labels).item()
    _, from_hf = _train([f"--model.init_from=hf:{tmp_path / 'hf'}", "--data.tokenizer=byte", "--train.steps=3"],
                        tmp_path / "imported")
    _, from_scratch = _train(["--train.steps=3"], tmp_path / "scratch")
    assert from_hf[0] < from_scratch[0] - 0.5  # it really starts from the trained weights


def _lock_let_go(run_dir: Path, timeout_s: float = 30.0) -> None:
    """Wait until no process holds the run directory's lock: the launcher's wait returns before its ranks, which
    die of their parent's death (not of the group's SIGKILL), are gone; CI saw the resume refused: "train.run_dir
    ... is in use by another `longctx train`"."""
    deadline = time.time() + timeout_s
    while True:
        try:
            fd = lock_directory(run_dir)
        except DirectoryInUse:
            if time.time() > deadline:
                raise AssertionError(f"the killed run's ranks held {run_dir}'s lock {timeout_s:g} s on") from None
            time.sleep(0.05)
            continue
        if fd is not None:
            os.close(fd)
        return


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "longctx", "train", "--config", "configs/debug.toml", "--nproc", "2",
           "--parallel.ctx=2", *BASE, "--train.steps=1000", "--checkpoint.interval=3", "--checkpoint.async=true",
           "--checkpoint.keep=5", f"--train.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 180
        ckpts = run_dir / "checkpoints"
        # wait until step 3 is committed, then kill while a later save is being written
        while time.time() < deadline and not (ckpts / "step-00000003" / "manifest.json").is_file():
            time.sleep(0.05)
        assert (ckpts / "step-00000003" / "manifest.json").is_file(), "no checkpoint was committed"
        while time.time() < deadline and not list(ckpts.glob(".tmp-step-*")):  # (step 3's was renamed)
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _lock_let_go(run_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    interrupted = [p.name for p in ckpts.glob(".tmp-step-*")]
    print(f"killed with latest={latest_checkpoint(ckpts).name}, interrupted saves left behind: {interrupted}")
    latest = latest_checkpoint(ckpts)
    assert latest is not None
    step = verify(latest)["step"]  # intact: every file present with its checksum
    assert step % 3 == 0 and step >= 3
    # resume auto continues from it; the losses match the uninterrupted run
    first, losses = run_layout("single", ["--checkpoint.resume=auto", "--train.steps=6" if step < 6 else
                                          f"--train.steps={step + 2}"], run_dir)
    assert first == step + 1
    if step < 6:
        assert len(losses) == 6 - step
        assert max(abs(x - y) for x, y in zip(losses, uninterrupted[step:])) <= 1e-5


# ---------------------------------------------------------------------------------------------
# damaged checkpoints are never loaded

@pytest.mark.parametrize("layout", ["single", DAMAGED])
def test_auto_resume_skips_a_damaged_checkpoint(layout, uninterrupted, request, tmp_path):
    if layout == "single":
        run_layout(layout, SAVE, tmp_path)
        shard = flip_last_shard(tmp_path, LAYOUTS[layout][0])
        # resume without saving, so that the checkpoints stay as they are for the second part
        first, losses, lines = run_layout(layout, AUTO, tmp_path, fn=_train_logged)
        run_dir = tmp_path
    else:  # the same steps, in the 4-rank jobs of `halves`
        results, dirs = request.getfixturevalue("halves")
        shard, (first, losses, lines), run_dir = results["damaged shard"], results["damaged auto"], dirs["damaged"]
    ckpts = run_dir / "checkpoints"
    said = "\n".join(lines)
    print(said)
    assert f"step-00000006 is damaged ({shard.name} does not match its sha256 checksum)" in said
    assert "resuming from step-00000003, the newest intact checkpoint" in said
    assert "resumed step 3 from" in said
    assert first == 4 and len(losses) == 3
    assert max(abs(x - y) for x, y in zip(losses, uninterrupted[3:])) <= 1e-5
    # none intact: a clear stop on every rank, nothing loaded
    flip_byte(ckpts / "step-00000003" / ".metadata")
    with pytest.raises((CheckpointError, RuntimeError), match="no complete checkpoint in .* is intact") as e:
        run_layout(layout, AUTO, run_dir)
    assert "step-00000006: __" in str(e.value) and "step-00000003: .metadata does not match" in str(e.value)


def test_a_damaged_explicit_checkpoint_is_refused_and_the_cli_says_so(tmp_path):
    _train(["--checkpoint.interval=5", "--train.steps=5"], tmp_path)
    ck = tmp_path / "checkpoints" / "step-00000005"
    flip_byte(ck / "__0_0.distcp")
    # a path named explicitly is never swapped for another checkpoint
    with pytest.raises(CheckpointError, match="step-00000005 is damaged: __0_0.distcp does not match its sha256"):
        _train([f"--checkpoint.resume={ck}", "--checkpoint.dir=" + str(tmp_path / "x")], tmp_path / "other")
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--config", "configs/debug.toml", *BASE,
                        "--checkpoint.resume=auto", f"--train.run_dir={tmp_path}"],
                       capture_output=True, text=True, cwd=ROOT)
    said = " ".join(r.stderr.split())  # one paragraph, wrapped
    print(said)
    assert r.returncode == 1 and "Traceback" not in said
    assert "no complete checkpoint in" in said and "is intact (step-00000005: __0_0.distcp does not match" in said
    # the manifest itself is checked too
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["step"] = 7
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json does not match its sha256"):
        verify(ck)


# ---------------------------------------------------------------------------------------------
# per-rank RNG states, per-rank checksums

def _draws():
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def _seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _manager(root):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return CheckpointManager(Path(root), keep=2, async_save=False, rank=rank, world=world, layout={"world": world},
                             model_cfg={}, log=lambda *a: None)


def _model():
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _load_and_draw(root):
    _seed(999)  # whatever the generators hold now is replaced by the checkpoint's
    manager, (model, opt) = _manager(root), _model()
    path, manifest = manager.resume_point("auto")
    manager.load(path, model, opt, manifest)
    return _draws()


def _save_then_load(root):
    manager, (model, opt) = _manager(root), _model()
    _seed(10 + manager.rank)
    manager.save(1, model, opt, {})
    expected = _draws()
    manager.wait()
    dist.barrier()  # rank 0 has committed
    return expected, _load_and_draw(root)


def test_rng_states_are_saved_per_rank_and_load_weights_only(tmp_path):
    results = run_spawned(2, _save_then_load, str(tmp_path))
    (expected0, got0), (expected1, got1) = results
    assert got0 == expected0 and got1 == expected1 and expected0 != expected1  # each rank its own
    ck = tmp_path / "step-00000001"
    for r in range(2):
        state = torch.load(ck / f"rng-rank{r}.pt", weights_only=True)  # plain tensors, lists, numbers
        assert set(state) >= {"python", "numpy", "torch"}
    # another world size: every rank continues rank 0's CPU streams
    assert _load_and_draw(tmp_path) == expected0


def test_a_checkpoint_without_per_rank_rng_is_refused_saying_why(tmp_path):
    with pytest.raises(CheckpointError, match="written by an older longctx"):
        _load_rng(tmp_path / "rng-rank0.pt")


def test_each_rank_hashes_its_own_files_and_the_manifest_lists_all(tmp_path):
    assert [owner_rank(n) for n in ("__3_0.distcp", "__12_1.distcp", "__2.metadata", "rng-rank5.pt",
                                    ".metadata", "trainer_state.json")] == [3, 12, 2, 5, 0, 0]
    for name, size in [("__0_0.distcp", 300), ("__1_0.distcp", 300), (".metadata", 10), ("rng-rank1.pt", 20)]:
        (tmp_path / name).write_bytes(os.urandom(size))
    parts = hash_files(tmp_path, ["__1_0.distcp", "rng-rank1.pt"])  # rank 1's part; nothing from rank 0
    m = write_manifest(tmp_path, step=1, layout={}, model={}, hashes=parts)  # the rest hashed at commit
    assert [f["path"] for f in m["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank1.pt"]
    verify(tmp_path)
    # verification shares: largest first to the least loaded rank, deterministic
    assert verification_shares(m["files"], 2) == [1, 0, 1, 0]
    assert verification_shares(m["files"], 1) == [0, 0, 0, 0]
