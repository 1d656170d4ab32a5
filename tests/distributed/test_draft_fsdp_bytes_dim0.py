"""A GliDe draft's logged FSDP bytes where FSDP cuts its tensors on dim 0 but the run's even placement would not
(review, 2026-12-04). parallel/parallelize.py parallelize_draft shards the draft with FSDP2's default placement
(Shard(0) for every tensor), while the frozen target and the model of a plain run follow costs/model_states.py
shard_dim (parallel/fsdp/shard.py even_placement); train/metrics.py counted the draft as shard_dim cuts it, so
where a draft tensor's dim 0 pads over half a row per rank and another dim splits evenly the logged figure read
low (a Llama-3-8B draft over 2048 ranks: 3.2% of its FSDP bytes; here a [3, 128] FFN weight over 2 ranks, whose
dim 0 pads to 4 rows). Compared with what FSDP2 sends in a real draft-training step on 2 gloo ranks."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.job.traffic import library_traffic
from longctx.train.trainer import Trainer

pytestmark = pytest.mark.slow  # a target trained for one step, then one 2-rank job: ~15 s on a 2-core CPU

# ffn_dim 3: the draft's w1 / w3 are [3, 128]; over 2 ranks dim 0 pads to 4 rows (1.33x, over shard_dim's 1.25x)
COMMON = ["--data.max_docs=40", "--train.seq_len=64", "--train.global_batch=4", "--train.eval_interval=0",
          "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=2",
          "--model.ffn_dim=3"]


def _measure(target: str, base: str) -> tuple[float, float]:
    cfg = load_config(None, [*COMMON, "--parallel.dp_shard=2", f"--draft.target={target}", f"--train.run_dir={base}",
                             "--train.steps=3", "--checkpoint.final=false"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.step(1)  # (FSDP's lazy init, the optimizer's states)
    with library_traffic() as traffic:
        trainer.step(2)
    return sum(traffic.values()), trainer.metrics.fsdp_bytes.get("fsdp", 0.0)


def test_a_draft_sharded_on_dim_0_is_counted_on_dim_0(tmp_path):
    cfg = load_config(None, [*COMMON, "--train.steps=1", "--checkpoint.interval=1",
                             f"--train.run_dir={tmp_path / 't'}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    for sent, logged in run_spawned(2, _measure, str(tmp_path / "t" / "checkpoints"), str(tmp_path / "d")):
        assert sent > 0 and logged == pytest.approx(sent, rel=1e-9), (sent, logged)
