"""The validation's hierarchical expert dispatch case run as a user runs it: `python benchmarks/planner_validate.py
--case hier2 --skip-ranking` (the bytes case of `longctx plan --validate` whose expert group of 4 is 2 nodes of 2,
alone). Its 4 gloo ranks run the hierarchy (before: no fixed case did, and a hierarchical case's config lost R,
its ranks ran the flat exchange and were compared with the hierarchical prediction), every check holds and the
exit status is 0: each rank's bytes on the two levels equal the planner's forms at the rows it measured, and the
saved activations of the rank whose experts received the most rows are within 0.1% of the count at its measured
skew, P and S (measured 2026-12-06: 16 bytes of 12.4 MB; the figure at the expected P and S beside it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_hierarchical_case_runs_the_hierarchy_and_checks_it_at_the_rows_it_measured():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_validate.py"), "--case", "hier2",
                        "--skip-ranking"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(r.stdout)["bytes"]
    assert row["layout"]["expert"] == 4 and row["layout"]["expert_ranks_per_node"] == 2
    checks = ("comm_equal_all_ranks", "fsdp_equal_all_ranks", "model_states_equal", "activations_within_5pct",
              "host_within_5pct", "expert_levels_equal_all_ranks")
    assert all(row[c] is True for c in checks), {c: row[c] for c in checks}
    # the ranks ran the hierarchy: rows crossed nodes and moved inside them, on every rank of the group
    assert len(row["expert_levels_measured"]) == 4
    for got in row["expert_levels_measured"]:
        assert got["expert_node"]["expert_node"] > 0 and got["expert_local"]["expert"] > 0
    figs = row["expert_hier_rows"]
    assert all(f["layers"] == 3 and f["tokens"] == 3 * 256 and f["sent_remote"] > 0 for f in figs)
    assert row["expert_hottest_rank"] == max(range(4), key=lambda q: figs[q]["receive_skew"])
    assert row["activations_max_rel_error"] < 1e-3  # at its measured rows: the count of that routing
