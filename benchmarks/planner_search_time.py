"""Planner search time (JSON): candidates evaluated and seconds per request, median of 3 runs.

    python benchmarks/planner_search_time.py
"""

import json
import os
import platform
import statistics
import time

from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.planner.search import Request, plan

REQUESTS = [("llama3-8b", 64, 2**20, "h100"), ("llama3-8b", 1024, 2**20, "h100"),
            ("llama3-70b", 1024, 2**20, "h100"), ("llama3-70b", 1024, 4 * 2**20, "h200")]

if __name__ == "__main__":
    rows = []
    for preset, gpus, seq_len, hardware in REQUESTS:
        m = load_config(None, {"model": {"preset": preset}}).model
        times, res = [], None
        for _ in range(3):
            t0 = time.perf_counter()
            res = plan(Request(m, get_hardware(hardware), gpus, seq_len))
            times.append(time.perf_counter() - t0)
        best = res.best
        rows.append({"model": preset, "gpus": gpus, "seq_len": seq_len, "global_batch": res.request.global_batch,
                     "hardware": hardware, "evaluated": res.evaluated,
                     "feasible": len(res.feasible), "seconds_median": statistics.median(times),
                     "best": best.as_dict()["describe"] if best else None,
                     "best_mfu": best.mfu if best else None, "best_step_s": best.step_s if best else None})
    print(json.dumps({"bench": "planner_search_time", "rows": rows,
                      "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}, indent=2))
