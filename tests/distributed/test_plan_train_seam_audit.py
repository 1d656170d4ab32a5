"""The seam between `longctx plan` and the run it describes: a plan's written config, trained as written,
trains what the plan says (its layout, memory policy, batch and length reach the trainer) and, for a
dense model, the same losses as one process on the same global batch, whatever layout, micro-batch
size, model-state tier or gradient sync the plan chose; every plan the planner ranks as fitting passes
what `longctx train` checks before it starts (preflight); and a MoE model whose balancing loss or
capacity is computed per micro-batch is told that plans of other micro-batch sizes train other
objectives (they do: 3 steps of debug-moe, 1 vs 4 sequences per micro-batch, differ by 7.7e-6 of the
loss with moe.aux_loss 0.01 and 6.1e-5 with capacity_factor 1, dense plans by 3e-8; 2026-12-01).

Plans are made for fixed CPU-sized hardware (a TOML file, not a calibration: the same plans on every
machine) whose GPU memory is set per request so that the best plan is the one each test wants."""

import json

import pytest

from longctx.cli import main as longctx_main
from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

HARDWARE = """[hardware]
name = "cpu-fixed"
memory_gib = 2.0
peak_tflops = 0.05
intra_gbps = 1.0
inter_gbps = 1.0
host_link_gbps = 5.0
host_memory_gib = 16.0
gemm_efficiency = 1.0
attention_efficiency = 0.5
comm_overlap = 0.0
dtype_bytes = 4
"""
SEQ, BATCH, STEPS = 2048, 8, 2
# the plans that are trained (the `trained` fixture) are made for sequences of TRAIN_SEQ: half of SEQ halves the
# 4-rank job's and the single process's work (was 2048; each of ctx 2's ranks still holds 512 tokens of every
# sequence, as 2 balanced chunks); the tests that only plan, or preflight plans, keep SEQ
TRAIN_SEQ = 1024
RUN = [f"--train.steps={STEPS}", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
       "--metrics.log_interval=1", "--checkpoint.final=false"]
# the trained plans' and the single process's data: the stdlib's first 300 documents (the plan's own data.corpus),
# not the whole library, whose store the run would build first (2 steps read 16 of its samples)
DATA = ["--data.max_docs=300"]
# plan options per request -> the best plan at TRAIN_SEQ: three layouts, micro-batch sizes (dp x 1 = 4, 2, 1
# sequences), grad_accum 2 / 4 / 8, gradient sync per step / per micro-batch, device and host model states. GPU
# memory alone chose them until 2026-12-05 (at 1024: 0.1-0.2 rep4; 0.014-0.016 rep2xctx2-host; 0.025-0.03
# head2xctx2); with the activations counted tighter since (an offloaded block's host tier once, by dtype), the host
# tiers fit where head2xctx2 did, so that plan is asked for as recompute none on the device (0.026-0.032 GiB give it).
PLANS = {
    "rep4": (["--hw", "memory_gib=0.2"], dict(parallel=(4, 1, 1, 1), grad_accum=2, recompute="none",
                                              model_states="device", grad_sync="step")),
    "rep2xctx2-host": (["--hw", "memory_gib=0.013"], dict(parallel=(2, 1, 1, 2), grad_accum=4, recompute="selective",
                                                          model_states="host", grad_sync="micro_batch")),
    "head2xctx2": (["--hw", "memory_gib=0.028", "--recompute", "none", "--model-states", "device"],
                   dict(parallel=(1, 1, 2, 2), grad_accum=8, recompute="none", model_states="device",
                        grad_sync="step")),
}


@pytest.fixture(scope="module")
def hardware(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "cpu_fixed.toml"
    path.write_text(HARDWARE)
    return str(path)


def _plan(hardware, out, *args, model="debug", gpus=4, json_out=False, seq=SEQ):
    argv = ["plan", "--model", model, "--gpus", str(gpus), "--seq-len", str(seq), "--global-batch", str(BATCH),
            "--hardware", hardware, *args]
    argv += ["--json", "--no-write"] if json_out else ["--out", str(out)]
    assert longctx_main(argv) == 0


def _train(plan_path, run_dir):
    """Train the written plan as written (only the steps, evaluation, logging, where to write and how many
    of the corpus's documents changed)."""
    result = train(load_config(plan_path, [*RUN, *DATA, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    return result.losses


# ----------------------------------------------------------------------------------------------
# told, not silent: micro-batch-dependent MoE objectives


def test_moe_plans_say_how_many_sequences_their_balancing_loss_covers(hardware, tmp_path, capsys):
    out = tmp_path / "moe.toml"
    _plan(hardware, out, "--hw", "memory_gib=0.3", "--top", "4", model="debug-moe")
    printed = capsys.readouterr().out
    # the listed plans: rep4 at micro-batch 1 (4 sequences over the job) and 2 (8)
    assert "moe.aux_loss = 0.01 (the balancing loss) is computed over each micro-batch's" in printed.replace("\n", " ")
    assert "take 4, 8 sequences per micro-batch" in printed.replace("\n", " ")
    written = load_config(str(out), [])
    dp = written.parallel.dp_replicate * written.parallel.dp_shard
    sequences = written.train.global_batch // written.train.grad_accum
    assert (dp, sequences) == (4, 4)
    assert f"# micro-batch: {sequences} sequences over the job (dp {dp} x micro-batch 1)" in out.read_text()

    _plan(hardware, None, "--hw", "memory_gib=0.3", "--top", "4", model="debug-moe", json_out=True)
    res = json.loads(capsys.readouterr().out)
    assert res["micro_batch_dependent"] == ["moe.aux_loss = 0.01 (the balancing loss)"]
    for p in res["plans"]:  # dp x micro-batch, from the layout's own degrees
        lay = p["layout"]
        assert p["micro_batch_sequences"] == lay["dp_replicate"] * lay["dp_shard"] * p["micro_batch"]
        assert p["micro_batch_sequences"] * p["grad_accum"] == BATCH


@pytest.mark.parametrize("model, overrides", [("debug", []), ("debug-moe", ["--model.moe.aux_loss=0"])])
def test_no_note_where_the_micro_batch_changes_nothing(hardware, tmp_path, capsys, model, overrides):
    """A dense model, and debug-moe without its balancing loss (the z-loss is a mean over tokens: the
    same over any split of the batch into equal micro-batches)."""
    out = tmp_path / "plan.toml"
    argv = ["plan", "--model", model, "--gpus", "4", "--seq-len", str(SEQ), "--global-batch", str(BATCH),
            "--hardware", hardware, "--hw", "memory_gib=0.3", "--out", str(out), *overrides]
    assert longctx_main(argv) == 0
    assert "micro-batch's tokens" not in capsys.readouterr().out
    assert "# micro-batch:" not in out.read_text()


# ----------------------------------------------------------------------------------------------
# --store: the documents the plan is costed on are the ones the written config trains


def _small_store(tmp_path, seq_len=256):
    """A byte-tokenized store of short random documents (several per sample: doc_work well below 1)."""
    import random

    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store

    rng = random.Random(0)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ij") for _ in range(rng.randint(20, 90)))})
                           + "\n" for _ in range(300)))
    out = tmp_path / "store"
    build_store(BuildOptions(inputs=[str(src)], out=str(out), seq_len=seq_len, strategy="bfd", dedup="none",
                             stats=False, progress=False), log=lambda *a, **k: None)
    return out


def test_a_plan_costed_on_a_store_trains_that_store(hardware, tmp_path):
    """`longctx plan --store DIR` took the attention work from DIR's documents but wrote data.path = "",
    so the run trained data.corpus (the stdlib) instead: another attention work than planned, and
    another data set than the user's, without a word."""
    from longctx.errors import ConfigError
    from longctx.train.preflight import preflight

    store = _small_store(tmp_path)
    out = tmp_path / "plan.toml"
    argv = ["plan", "--model", "debug", "--gpus", "2", "--seq-len", "256", "--global-batch", "4", "--hardware",
            hardware, "--store", str(store), "--out", str(out)]
    assert longctx_main(argv) == 0
    assert "doc_work 0." in out.read_text()  # costed on the store's documents (several per sample)
    written = load_config(str(out), [])
    assert written.data.path == str(store.resolve())
    preflight(written, 2, log=lambda *a: None)  # the store fits the run (length, tokenizer, eval split)
    with pytest.raises(ConfigError, match="would train another store's"):
        _build([*argv[1:-2], "--no-write"], [f"--data.path={tmp_path / 'other'}"])


def _build(argv, overrides):
    import argparse

    from longctx.planner.cli import add_arguments, build_request

    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_request(p.parse_args(argv), overrides)


# ----------------------------------------------------------------------------------------------
# every plan ranked as fitting passes train's checks before launch


@pytest.mark.parametrize("model, gpus_per_node, args, kinds", [
    ("debug", 8, ["--hw", "memory_gib=0.03"], {"host"}),  # host tiers, offload, HSDP
    ("debug", 2, ["--hw", "memory_gib=0.2", "--hw", "inter_gbps=0.05"], {"hpz"}),  # ZeRO++ over 2 "nodes"
    ("debug", 2, ["--hw", "memory_gib=0.2", "--hw", "inter_gbps=0.05", "--allow", "co2"], {"co2"}),
    ("debug-moe", 8, ["--hw", "memory_gib=0.05", "--expert", "4"], {"ep"}),
])
def test_every_listed_plan_passes_the_launch_checks(hardware, model, gpus_per_node, args, kinds):
    """The plans of each request (8 listed) as plan_config writes them, through train's preflight: the
    layout checks, the host-memory budget (this machine's), the data store against the run."""
    from longctx.planner.output import plan_config
    from longctx.planner.search import plan
    from longctx.train.preflight import preflight

    # (DATA: the store preflight builds is of the stdlib's first 300 documents, not of the whole library: the same
    # checks of it against each plan's run, without the 20-50 s build that was most of this test)
    req, base = _build(["--model", model, "--gpus", "4", "--gpus-per-node", str(gpus_per_node), "--seq-len",
                        str(SEQ), "--global-batch", str(BATCH), "--hardware", hardware, *args], DATA)
    listed = list(plan(req).feasible[:8])
    assert listed
    seen = set()
    for est in listed:
        cfg = plan_config(est, req, base)
        preflight(cfg, est.mesh_shape.world, log=lambda *a: None)  # raises what `longctx train` would refuse
        seen |= {k for k in ("hpz", "co2", " ep") if k in est.mesh_shape.describe()}
        seen |= {"host"} if est.model_states != "device" else set()
    assert {k.strip() for k in seen} >= kinds  # the requests reach the plans they are for


# ----------------------------------------------------------------------------------------------
# written plans, trained as written: what the plan says, and one process's losses


@pytest.fixture(scope="module")
def trained(hardware, tmp_path_factory):
    """{plan: (path, run directory, losses of every rank)} for PLANS, in one 4-rank job, and the
    single process's losses on the same global batch (no plan: the debug model's config by hand)."""
    base = tmp_path_factory.mktemp("plans")
    paths = {}
    for key, (options, _) in PLANS.items():
        paths[key] = str(base / f"{key}.toml")
        _plan(hardware, paths[key], *options, "--top=1", seq=TRAIN_SEQ)
    jobs = [(key, _train, (paths[key], str(base / f"run-{key}"))) for key in PLANS]
    losses = run_spawned_many(4, jobs)
    single = train(load_config("configs/debug.toml", [
        *RUN, *DATA, f"--train.seq_len={TRAIN_SEQ}", f"--train.global_batch={BATCH}", "--train.warmup_steps=20",
        "--train.device=cpu", "--train.dtype=fp32", f"--train.run_dir={base / 'single'}"]),
        log=lambda *a, **k: None).losses
    return {key: (paths[key], base / f"run-{key}", losses[key]) for key in PLANS}, single


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PLANS))
def test_a_written_plan_trains_what_it_says(trained, key):
    plans, _ = trained
    path, run_dir, _ = plans[key]
    want = PLANS[key][1]
    planned = load_config(path, [])
    p, m, t = planned.parallel, planned.memory, planned.train
    # the plan chose what this test asked of it
    assert (p.dp_replicate, p.dp_shard, p.head, p.ctx) == want["parallel"]
    assert (t.grad_accum, m.recompute, m.model_states, m.grad_sync) == (
        want["grad_accum"], want["recompute"], want["model_states"], want["grad_sync"])
    # the run's own record of its config holds every planned field
    ran = load_config(str(run_dir / "config.toml"), [])
    for section in ("parallel", "memory"):
        assert getattr(ran, section) == getattr(planned, section), section
    for field in ("seq_len", "global_batch", "grad_accum", "data_parallel", "device", "dtype"):
        assert getattr(ran.train, field) == getattr(planned.train, field), field
    # and what it did: tokens per step, length, ranks, gradient reductions per step (one per FSDP unit, the
    # blocks and the root, per micro-batch under grad_sync micro_batch; none with one rank per FSDP group)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["tokens"] for r in rows] == [BATCH * TRAIN_SEQ * (i + 1) for i in range(STEPS)]
    assert {r["seq_len"] for r in rows} == {TRAIN_SEQ} and {r["world"] for r in rows} == {4}
    units = planned.model.layers + 1
    fsdp_ranks = p.dp_shard * p.head * p.ctx
    calls = 0 if fsdp_ranks == 1 and m.model_states == "device" else (
        units * t.grad_accum if m.grad_sync == "micro_batch" else units)
    assert {r["grad_reduce_calls"] for r in rows} == {calls}
    # the sequence-parallel groups that sent bytes are the plan's
    sent = {dim for r in rows for dim, nbytes in r["comm_bytes_per_step"].items() if nbytes and dim in ("head", "ctx")}
    assert sent == {dim for dim, n in (("head", p.head), ("ctx", p.ctx)) if n > 1}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PLANS))
def test_a_written_dense_plan_trains_one_process_losses(trained, key):
    """Different layouts, micro-batch sizes, tiers and gradient syncs of one dense model: one process's
    math (the project's parity tolerance, 1e-5 of the loss; measured 3e-8)."""
    plans, single = trained
    losses = plans[key][2]
    assert len(single) == STEPS
    for rank_losses in losses:
        assert len(rank_losses) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(rank_losses, single))
        assert worst <= 1e-5, f"{key}: max relative |loss - single| = {worst:.2e}"
