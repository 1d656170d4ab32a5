"""train.on_nonfinite = rollback in a fresh 2-rank run (ctx 2): the checkpoint it committed is every rank's to go
back to. Only rank 0 commits, and only rank 0 recorded it as the run's own newest (CheckpointManager.parent), so
rank 1 found no checkpoint before the bad step and stopped the job with 'no checkpoint was saved before it', whatever
the run had saved. Both a bad step in the middle of the run and its last one (which ends the run with the checkpoint's
weights, and says so)."""

import json
import os

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=4",
        "--train.on_nonfinite=rollback", "--metrics.log_interval=2", "--parallel.ctx=2",
        "--parallel.timeout_s=30"]


def _run(steps: int, run_dir: str):
    os.environ["LONGCTX_FAULT"] = "nonfinite@6"
    logs: list[str] = []
    try:
        cfg = load_config(None, [*BASE, f"--train.steps={steps}", f"--train.run_dir={run_dir}"])
        result = Trainer(cfg, log=lambda *a, **k: logs.append(" ".join(map(str, a)))).run()
    except Exception as e:  # (the rank's error, to the test)
        return f"error: {e}"
    finally:
        os.environ.pop("LONGCTX_FAULT", None)
    return len(result.losses), logs


def test_a_fresh_multi_rank_run_rolls_back_to_the_checkpoint_it_saved(tmp_path):
    runs = run_spawned_many(2, [(steps, _run, (steps, str(tmp_path / f"s{steps}"))) for steps in (8, 6)])
    for steps, ranks in runs.items():
        assert all(not isinstance(r, str) for r in ranks), (steps, ranks)
        records = [json.loads(line) for line in (tmp_path / f"s{steps}" / "checkpoints" / "rollbacks.jsonl").open()]
        assert [(r["bad_step"], r["rolled_back_to"]) for r in records] == [(6, 4)]
        done = next(line for line in ranks[0][1] if line.startswith("done:"))
        if steps == 6:  # the last step: the run ends with step 4's weights
            assert "(step 4's: steps 5-6 rolled back)" in done, done
        else:
            metrics = [json.loads(line) for line in (tmp_path / "s8" / "metrics.jsonl").open()]
            assert [r["step"] for r in metrics] == [1, 2, 4, 8], metrics
