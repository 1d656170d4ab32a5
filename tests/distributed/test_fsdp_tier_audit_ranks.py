"""Audit of parallel/fsdp and the model-state tiers over 2 ranks (an FSDP group of 2, gloo).

- parallel.zero_pp = qgz alone with parallel.zero_pp_block 0 failed as a bare ZeroDivisionError in the
  metrics' byte counts after the model was sharded, and with a block longer than every unit's shard
  trained on, padding each reduce-scatter row to a whole block (qwz refuses that block): both are now
  one ConfigError at set-up, naming the range to use.
- A checkpoint saved under one memory.model_states tier resumes under another over 2 ranks (where
  host_optimizer's state is DTensors over host shards) exactly as the uninterrupted run goes on
  (test_model_states.py checks world 1), with clipping that bites.
- A non-finite step (LONGCTX_FAULT) is skipped alike under every tier with tied embeddings, two
  micro-batches and clipping: the steps after it train as the device tier's."""

import pytest

from longctx.job.spawn import run_spawned_many

STEPS = 6
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=60",
        "--train.seq_len=64", "--train.warmup_steps=1", "--model.layers=2", "--model.dim=32", "--model.ffn_dim=64",
        "--train.grad_clip=0.05"]
SAVE = ["--train.global_batch=2", f"--train.steps={STEPS}", "--checkpoint.interval", str(STEPS // 2)]
SKIP = ["--train.global_batch=4", "--train.grad_accum=2", "--train.steps=4", "--model.tie_embeddings=true"]


def _losses(args, run_dir, fault=""):
    import os

    from longctx.config import load_config
    from longctx.train.trainer import train

    os.environ["LONGCTX_FAULT"] = fault  # (read as each run wraps its step)
    try:
        cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
        return train(cfg, log=lambda *a, **k: None).losses
    except Exception as e:  # noqa: BLE001 - the test reads which error, and what it said
        return f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("LONGCTX_FAULT", None)


def _resume(tier, saved, run_dir):
    middle = f"{saved}/checkpoints/step-{STEPS // 2:08d}"
    return _losses([*SAVE, f"--memory.model_states={tier}", f"--checkpoint.resume={middle}"], run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp-audit")
    qgz = ["--train.global_batch=2", "--train.steps=1", "--parallel.zero_pp=qgz", "--parallel.ranks_per_node=1"]
    jobs = [("qgz block 0", _losses, ([*qgz, "--parallel.zero_pp_block=0"], f"{base}/q0")),
            ("qgz block long", _losses, ([*qgz, "--parallel.zero_pp_block=1000000"], f"{base}/qlong"))]
    jobs += [(f"save {t}", _losses, ([*SAVE, f"--memory.model_states={t}"], f"{base}/save-{t}"))
             for t in ("device", "host_optimizer")]
    jobs += [("host_optimizer -> device", _resume, ("device", f"{base}/save-host_optimizer", f"{base}/r1")),
             ("device -> host_optimizer", _resume, ("host_optimizer", f"{base}/save-device", f"{base}/r2")),
             ("device -> host", _resume, ("host", f"{base}/save-device", f"{base}/r3"))]
    jobs += [(f"skip {t}", _losses, ([*SKIP, f"--memory.model_states={t}"], f"{base}/skip-{t}", "nonfinite@2"))
             for t in ("device", "host_optimizer", "host")]
    return run_spawned_many(2, jobs)


@pytest.mark.parametrize("job,says", [("qgz block 0", "use at least 1|use 1 .. "), ("qgz block long", "use 1 .. ")])
def test_qgz_refuses_a_block_it_cannot_use_at_set_up(runs, job, says):
    import re

    for rank in runs[job]:
        assert isinstance(rank, str) and rank.startswith("ConfigError: parallel.zero_pp_block"), rank
        assert re.search(says, rank), rank


@pytest.mark.parametrize("resume", ["host_optimizer -> device", "device -> host_optimizer", "device -> host"])
def test_a_checkpoint_resumes_under_another_tier_over_two_ranks(runs, resume):
    (uninterrupted, _), (saved_by, _) = runs["save device"], runs[f"save {resume.split()[0]}"]
    assert uninterrupted == pytest.approx(saved_by, abs=1e-6)
    for rank in runs[resume]:
        assert len(rank) == STEPS // 2 and rank == pytest.approx(uninterrupted[STEPS // 2:], abs=1e-6)


@pytest.mark.parametrize("tier", ["host_optimizer", "host"])
def test_a_skipped_step_is_skipped_alike_under_every_tier(runs, tier):
    import math

    for device, host in zip(runs["skip device"], runs[f"skip {tier}"]):
        assert math.isnan(device[1]) and math.isnan(host[1])  # step 2: the fault's, not applied
        finite = [i for i in range(4) if i != 1]
        assert [host[i] for i in finite] == pytest.approx([device[i] for i in finite], abs=1e-6)
