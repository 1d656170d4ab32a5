"""Planner search time (JSON): candidates evaluated, candidates timed, and seconds per request (wall
and this process's CPU), median of 3 runs, each the search and its table's 10 rows and "why" lines
(what `longctx plan` reads).

    python benchmarks/planner_search_time.py
"""

import json
import os
import platform
import statistics
import time

from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.planner.link_report import why
from longctx.planner.search import Request, plan

REQUESTS = [("llama3-8b", 64, 2**20, "h100"), ("llama3-8b", 1024, 2**20, "h100"),
            ("llama3-70b", 1024, 2**20, "h100"), ("llama3-70b", 1024, 4 * 2**20, "h200")]

if __name__ == "__main__":
    rows = []
    for preset, gpus, seq_len, hardware in REQUESTS:
        m = load_config(None, {"model": {"preset": preset}}).model
        times, cpu, res = [], [], None
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            res = plan(Request(m, get_hardware(hardware), gpus, seq_len))
            res.feasible[:10], why(res)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        best = res.best
        rows.append({"model": preset, "gpus": gpus, "seq_len": seq_len, "global_batch": res.request.global_batch,
                     "hardware": hardware, "evaluated": res.evaluated,
                     "feasible": len(res.feasible), "timed": getattr(res, "timed", res.evaluated),
                     "seconds_median": statistics.median(times), "cpu_seconds_median": statistics.median(cpu),
                     "best": best.as_dict()["describe"] if best else None,
                     "best_mfu": best.mfu if best else None, "best_step_s": best.step_s if best else None})
    print(json.dumps({"bench": "planner_search_time", "rows": rows,
                      "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}, indent=2))
