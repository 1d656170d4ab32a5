"""metrics.jsonl's `tokens` (positions trained so far) across a resume that changes the positions per step."""

from __future__ import annotations

import json

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.train.trainer import Trainer

QUIET = lambda *a, **k: None  # noqa: E731
BASE = ["--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--train.warmup_steps=1",
        "--train.seq_len=32", "--metrics.log_interval=1", "--checkpoint.interval=2"]


def _tokens(run) -> dict[int, int]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["tokens"] for r in rows if r.get("kind") == "train"}


def test_tokens_go_on_counting_what_was_trained_after_a_resume_with_another_batch(tmp_path):
    """4 steps of 2 x 32 positions, resumed for 2 more of 4 x 32: 512 at step 6. The count was step x the new batch
    x seq_len (768), as if the steps before the resume had trained the new batch; a second resume keeps the sum."""
    run = tmp_path / "run"
    Trainer(load_config(None, [*BASE, "--train.global_batch=2", "--train.steps=4", f"--train.run_dir={run}"]),
            log=QUIET).run()
    resume = ["--checkpoint.resume=auto", f"--train.run_dir={run}"]
    Trainer(load_run_config(None, [*resume, "--train.steps=6", "--train.global_batch=4"], False)[0], log=QUIET).run()
    assert _tokens(run)[4] == 4 * 2 * 32 and _tokens(run)[6] == 4 * 2 * 32 + 2 * 4 * 32
    Trainer(load_run_config(None, [*resume, "--train.steps=8", "--train.global_batch=2"], False)[0], log=QUIET).run()
    assert _tokens(run)[8] == 4 * 2 * 32 + 2 * 4 * 32 + 2 * 2 * 32
