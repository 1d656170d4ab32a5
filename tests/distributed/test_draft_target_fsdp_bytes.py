"""A draft run's logged FSDP bytes per step (train/metrics.py, parallel/context/volumes.py fsdp_bytes_per_step)
against what FSDP2 sends in a real draft-training step on 2 gloo ranks (job/traffic.py library_traffic). The
frozen target (train/glide.py) is sharded over the same ranks and gathers all its parameters once per
micro-batch; the logged figure counted the draft's parameters alone (half the bytes of a 3-layer debug target's
draft run: 1.38 MB logged, 2.72 MB sent)."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.job.traffic import library_traffic
from longctx.train.trainer import Trainer

pytestmark = pytest.mark.slow  # a target trained for one step, then one 2-rank job: ~20 s on a 2-core CPU

COMMON = ["--data.max_docs=40", "--train.seq_len=64", "--train.global_batch=4", "--train.eval_interval=0",
          "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=3"]
LAYOUTS = {
    "dp_shard 2, grad_accum 2": ["--parallel.dp_shard=2", "--train.grad_accum=2"],
    "head 2": ["--parallel.head=2"],
    "ctx 2, grad_accum 2": ["--parallel.ctx=2", "--train.grad_accum=2"],
}


def _measure(target: str, base: str) -> dict:
    out = {}
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        cfg = load_config(None, [*COMMON, *layout, f"--draft.target={target}", f"--train.run_dir={base}/{i}",
                                 "--train.steps=3", "--checkpoint.final=false"])
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        trainer.step(1)  # (FSDP's lazy init, the optimizer's states)
        with library_traffic() as traffic:
            trainer.step(2)
        out[name] = (sum(traffic.values()), trainer.metrics.fsdp_bytes.get("fsdp", 0.0))
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft-bytes")
    cfg = load_config(None, [*COMMON, "--train.steps=1", "--checkpoint.interval=1", f"--train.run_dir={tmp / 't'}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run_spawned(2, _measure, str(tmp / "t" / "checkpoints"), str(tmp / "d"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_draft_runs_logged_fsdp_bytes_count_its_frozen_targets_gathers(measured, layout):
    for rank in measured:
        sent, logged = rank[layout]
        assert sent > 0 and logged == pytest.approx(sent, rel=1e-9), (layout, sent, logged)
