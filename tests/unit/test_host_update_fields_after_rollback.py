"""host_optimizer's figures on the metrics line after train.on_nonfinite = rollback: the reload waits for the
update in flight (the bad step's), so the first step after it follows no update, as the first step after a
resume: neither host_step_s nor host_exposed_s on its line. It reported the bad step's update time."""

from longctx.config import load_config
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer


def test_no_host_update_figures_on_the_first_line_after_a_rollback(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@3")
    cfg = load_config(overrides=[
        f"--train.run_dir={tmp_path}", "--train.steps=4", "--train.seq_len=64", "--train.global_batch=2",
        "--train.eval_interval=0", "--data.max_docs=40", "--metrics.log_interval=1", "--metrics.progress=false",
        "--metrics.plots=false", "--model.layers=2", "--train.device=cpu", "--memory.model_states=host_optimizer",
        "--train.on_nonfinite=rollback", "--checkpoint.interval=2", "--checkpoint.final=false"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    lines = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert lines[4].get("rollbacks") == 1  # step 3 was rolled back to step 2; step 4 is the first after it
    assert "host_step_s" in lines[2]  # (an update, step 1's, came before step 2)
    assert "host_step_s" not in lines[4] and "host_exposed_s" not in lines[4], lines[4]
