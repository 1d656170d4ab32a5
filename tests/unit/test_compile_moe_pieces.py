"""train.compile with a MoE model under a memory policy that runs each block in pieces (memory.block_chunk):
the MoE layer's router record (models/moe.py _record) was traced into the compiled `post`, which guarded on
the number of records and on the piece's bounds, so every piece compiled again until the recompile limit
ran some pieces eagerly; a checkpointed piece's forward and its recomputation then saved different tensors
and the first backward raised torch.utils.checkpoint.CheckpointError. Compiled, it trains as eager does."""

import pytest

from longctx.config import load_config
from longctx.train.trainer import Trainer

BASE = ["--model.preset=debug-moe", "--memory.recompute=selective", "--memory.block_chunk=20",
        "--train.seq_len=64", "--train.global_batch=4", "--data.max_docs=80", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=0",
        "--checkpoint.final=false", "--train.steps=2", "--train.warmup_steps=1", "--train.lr=3e-3",
        "--metrics.log_interval=1"]


def _losses(tmp_path, compiled: bool) -> list[float]:
    run = tmp_path / ("compiled" if compiled else "eager")
    cfg = load_config(None, [*BASE, f"--train.compile={str(compiled).lower()}", f"--train.run_dir={run}"])
    return Trainer(cfg, log=lambda *a, **k: None).run().losses


def test_a_moe_model_in_pieces_trains_compiled_as_eager(tmp_path):
    eager = _losses(tmp_path, False)
    assert _losses(tmp_path, True) == pytest.approx(eager, rel=1e-5)
