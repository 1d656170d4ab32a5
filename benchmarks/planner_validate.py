"""Planner validation on this CPU (JSON): predicted vs measured communication bytes (comm.py's exact
counters for attention, FSDP2's own collectives counted from the c10d operators), model-state bytes
and activation bytes for debug and ~100M models under 10 layouts x policies, and predicted vs
measured step-time ranking of same-world layouts (interleaved in one job, median over rounds).

    python benchmarks/planner_validate.py [--rounds 3] [--skip-bytes] [--skip-ranking] [--case TEXT ...]

--case runs only the bytes cases whose name contains TEXT (e.g. `--case hier2 --skip-ranking`: the hierarchical
expert dispatch case alone, tests/e2e/test_hier_validate110_cli.py).
"""

import argparse
import sys

from longctx.planner import validate

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-bytes", action="store_true")
    p.add_argument("--skip-ranking", action="store_true")
    p.add_argument("--case", action="append", default=[], metavar="TEXT",
                   help="only the bytes cases whose name contains TEXT (repeatable)")
    a = p.parse_args()
    cases = [c for c in validate.BYTES_CASES if any(t in c.name for t in a.case)] if a.case else None
    if a.case and not cases:
        p.error(f"--case {' '.join(a.case)} names no bytes case; they are: "
                f"{', '.join(c.name for c in validate.BYTES_CASES)}")
    sys.exit(validate.main(cases=[] if a.skip_bytes else cases, ranking_cases=[] if a.skip_ranking else None,
                           steps=a.rounds))
