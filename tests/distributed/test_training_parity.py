"""Training under parallel layouts against the single-process run: per-step losses (fp32, gloo).

A wrong layout shows at step 1 (the forward) or 2 (the first update), so each layout trains a few
steps; one layout trains long, to catch what only accumulates."""

import pytest

from longctx.config import load_config
from longctx.parallel.spawn import run_spawned
from longctx.train.trainer import train

STEPS = 4         # every layout
LONG_STEPS = 20   # one layout
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
        "--train.warmup_steps=2"]

LAYOUTS = {
    "dp2": (2, []),
    "head2": (2, ["--parallel.head=2"]),
    "ctx2": (2, ["--parallel.ctx=2"]),
    "head2-ctx2": (4, ["--parallel.head=2", "--parallel.ctx=2"]),
    "dp2-ctx2": (4, ["--parallel.ctx=2"]),
    "ctx4-window2": (4, ["--parallel.ctx=4", "--parallel.window=2"]),
    "dprep2-ctx2": (4, ["--parallel.dp_replicate=2", "--parallel.ctx=2"]),
    "head2-ctx2-ctxfirst": (4, ["--parallel.head=2", "--parallel.ctx=2", "--parallel.placement=ctx-first"]),
}


def _train_losses(args, run_dir):
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train_losses([*BASE, f"--train.steps={STEPS}"], tmp_path_factory.mktemp("single"))


def check(layout, reference, tmp_path, extra=(), steps=STEPS):
    world, args = LAYOUTS[layout]
    losses = run_spawned(world, _train_losses, [*BASE, f"--train.steps={steps}", *extra, *args], str(tmp_path))
    for rank_losses in losses:
        assert len(rank_losses) == steps
        diff = max(abs(a - b) for a, b in zip(rank_losses, reference))
        assert diff <= 1e-4, f"{layout}: max |loss - single| = {diff:.2e}"
    return max(abs(a - b) for a, b in zip(losses[0], reference))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_single_process(layout, reference, tmp_path):
    diff = check(layout, reference, tmp_path)
    print(f"{layout}: max |loss - single| over {STEPS} steps = {diff:.2e}")


def test_a_long_run_matches_single_process(tmp_path):
    """head 2 x ctx 2 over 20 steps: what a few steps cannot show (drift that accumulates)."""
    reference = _train_losses([*BASE, f"--train.steps={LONG_STEPS}"], tmp_path / "single")
    diff = check("head2-ctx2", reference, tmp_path / "parallel", steps=LONG_STEPS)
    print(f"head2-ctx2: max |loss - single| over {LONG_STEPS} steps = {diff:.2e}")


def test_gradient_accumulation_with_sync_once_per_step_matches_single_process(reference, tmp_path):
    """dp 2 x ctx 2 with 2 micro-batches per step (FSDP gradient sync off for the first): the same
    losses as one process without accumulation."""
    diff = check("dp2-ctx2", reference, tmp_path, extra=["--train.grad_accum=2"])
    print(f"dp2-ctx2 grad_accum 2: max |loss - single| over {STEPS} steps = {diff:.2e}")


def test_compiled_blocks_under_fsdp_train_identically(reference, tmp_path):
    """head 2 x ctx 2 with train.compile (CPU inductor) under FSDP2, selective recomputation and
    token-wise offload: the eager single process's losses."""
    diff = check("head2-ctx2", reference, tmp_path,
                 extra=["--train.compile=true", "--memory.recompute=selective", "--memory.offload_fraction=0.5"])
    print(f"head2-ctx2 compiled: max |loss - single| over {STEPS} steps = {diff:.2e}")


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A corpus of short documents (20-300 bytes): every 512-token window packs several, and their
    boundaries fall inside the 128-token pieces each rank of a head 2 x ctx 2 layout holds."""
    import random

    d = tmp_path_factory.mktemp("short_docs")
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(400):
        n = rng.randint(3, 50)
        (d / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(n)) + "\n")
    return str(d)


@pytest.mark.parametrize("layout,split", [("head2-ctx2", "docs"), ("ctx4-window2", "docs"), ("dp2-ctx2", "docs"),
                                            ("head2-ctx2", "zigzag")])
def test_packed_documents_train_identically(layout, split, short_docs, tmp_path):
    extra = [f"--data.corpus={short_docs}", "--data.max_docs=0", "--train.steps=8", f"--parallel.split={split}"]
    single = _train_losses([*BASE, *extra], tmp_path / "single")
    world, args = LAYOUTS[layout]
    losses = run_spawned(world, _train_losses, [*BASE, *extra, *args], str(tmp_path / "parallel"))
    # the samples really are packed with many documents
    from longctx.data.builder.corpus import read_documents

    assert len(read_documents(short_docs)) == 400
    diff = max(abs(a - b) for a, b in zip(losses[0], single[:8]))
    assert diff <= 1e-4, f"{layout}: max |loss - single| = {diff:.2e}"
