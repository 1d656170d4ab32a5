"""Published anchors (MEMO, FPDT, USP) as planner feasibility, with predicted vs published MFU (JSON),
and the host memory per node each anchor would need under longctx's offload scheme.

    python benchmarks/planner_anchors.py
"""

import json
import sys

from longctx.costs.hardware import get_hardware
from longctx.planner.anchors import ANCHORS, check, passed

if __name__ == "__main__":
    rows = []
    for a in ANCHORS:
        row = check(a)
        if not row["feasible"]:
            for host in (4096, 8192, 16384, 65536):
                r = check(a, get_hardware(a.hardware).replace(host_memory_gib=host))
                if r["feasible"]:
                    row["feasible_with_host_gib_per_node"] = host
                    row["with_more_host"] = {k: r.get(k) for k in ("predicted_mfu", "best", "memory_gib",
                                                                    "host_per_node_gib")}
                    break
        rows.append(row)
    print(json.dumps({"bench": "planner_anchors", "rows": rows}, indent=2))
    sys.exit(0 if all(passed(r) for r in rows) else 1)
