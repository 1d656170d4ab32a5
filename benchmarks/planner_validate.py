"""Planner validation on this CPU (JSON): predicted vs measured communication bytes (comm.py's exact
counters for attention, FSDP2's own collectives counted from the c10d operators), model-state bytes
and activation bytes for debug and ~100M models under 10 layouts x policies, and predicted vs
measured step-time ranking of same-world layouts (interleaved in one job, median over rounds).

    python benchmarks/planner_validate.py [--rounds 3] [--skip-bytes] [--skip-ranking]
"""

import argparse
import sys

from longctx.planner import validate

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-bytes", action="store_true")
    p.add_argument("--skip-ranking", action="store_true")
    a = p.parse_args()
    sys.exit(validate.main(cases=[] if a.skip_bytes else None, ranking_cases=[] if a.skip_ranking else None,
                           steps=a.rounds))
