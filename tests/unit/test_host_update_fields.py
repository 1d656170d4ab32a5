"""host_optimizer's figures on the metrics line (train/host_update.py): `host_exposed_s` is what step
N's forward waited for update N - 1. It was read when the line was written, after step N's own
optimizer step had started update N and reset the count: 0 on every line, however long the wait."""

import time

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer

UNIT_S = 0.05  # each forward unit's update made this slow: step N's forward waits for update N - 1


def test_the_forwards_wait_for_the_host_update_is_on_the_line(tmp_path):
    cfg = load_config(overrides=[
        f"--train.run_dir={tmp_path}", "--train.steps=3", "--train.seq_len=64", "--train.global_batch=2",
        "--train.grad_accum=2", "--train.eval_interval=0", "--data.max_docs=40", "--metrics.log_interval=1",
        "--metrics.progress=false", "--metrics.plots=false", "--model.layers=2", "--train.device=cpu",
        "--memory.model_states=host_optimizer", "--checkpoint.final=false"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    update_unit = trainer.optimizer._update_unit

    def slow(k, found_inf):
        time.sleep(UNIT_S)
        return update_unit(k, found_inf)

    trainer.optimizer._update_unit = slow
    trainer.run()
    lines = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert "host_exposed_s" not in lines[0] and "host_step_s" not in lines[0]  # no update before step 1
    units = len(trainer.optimizer._units)  # the root, then each block
    for r in lines[1:]:
        # the first forward unit alone waits its own update's UNIT_S; the whole update takes units x UNIT_S
        assert r["host_step_s"] >= units * UNIT_S * 0.9, r
        # (the forward's wait also takes in its thread's wake-up after the last unit's ready, which host_step_s,
        # written before it, does not: tens of ms on a loaded machine; an exposure summed over two updates
        # would read twice host_step_s)
        assert UNIT_S * 0.8 <= r["host_exposed_s"] <= r["host_step_s"] + 0.05, r
