"""The log line's count of skipped steps counts spikes (train.spike_factor) as well as non-finite steps, so it
must not call them all non-finite: a run with one spike and no NaN read `skipped 1 non-finite` (docs/running.md,
"Non-finite steps and loss spikes")."""
from longctx.train.metrics import format_line


def test_skipped_label_names_both_kinds():
    record = {"kind": "train", "step": 4, "loss": 4504.8, "grad_norm": 2438.0, "lr": 7e-4, "tokens_per_s": 7501.0,
              "tflops": 0.043, "mfu": 0.11, "memory_gib": 0.44, "memory_kind": "peak RSS", "skipped_steps": 1}
    line = format_line(record)
    assert "skipped 1 (non-finite or spike)" in line
    assert "non-finite |" not in line and not line.rstrip().endswith("non-finite")
