"""Every mesh dim a training step sends bytes over (job/comm.py's counters) is in the metrics line's
`comm_bytes_per_step` (train/metrics.py, job/runtime.py TRACKED_DIMS). Under hierarchical expert dispatch
(parallel.expert_ranks_per_node) the token all-to-alls run on `expert_node` and `expert_local` groups, which
the line left out: a debug-moe run on 4 ranks with expert 4 in nodes of 2 logged no expert bytes at all
(0.2 MiB per step with the flat dispatch)."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import train

pytestmark = pytest.mark.slow  # one 4-rank job: ~15 s on a 2-core CPU


def _run(run_dir: str) -> dict:
    from longctx.job import comm

    cfg = load_config(None, [
        "--model.preset=debug-moe", "--model.layers=2", "--parallel.expert=4", "--parallel.expert_ranks_per_node=2",
        "--train.seq_len=64", "--train.global_batch=4", "--train.steps=2", "--train.eval_interval=0",
        "--metrics.log_interval=1", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=40",
        f"--train.run_dir={run_dir}", "--checkpoint.final=false", "--train.device=cpu"])
    train(cfg, log=lambda *a, **k: None)
    return {dim: sum(labels.values()) for dim, labels in comm.counters().items()}


def test_every_dim_with_bytes_is_in_the_metrics_line(tmp_path):
    sent = run_spawned(4, _run, str(tmp_path))
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    logged = set(records[-1]["comm_bytes_per_step"])
    assert {"expert_node", "expert_local"} <= set(sent[0])  # (the hierarchy ran)
    for rank in sent:
        missing = {dim for dim, n in rank.items() if n and dim not in logged and dim != "world"}
        assert not missing, f"bytes sent over {missing} are not in the metrics line ({sorted(logged)})"
