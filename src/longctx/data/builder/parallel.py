"""`parallel_map`: a function over a list in `workers` processes, in order, or in-process for 1.

Forked workers (where the platform has fork) start in milliseconds and inherit the inputs without
pickling them; the functions used here are pure numpy / Python (no BLAS, no torch), so forking a
process that has torch loaded is safe. A `ProcessPoolExecutor`, not a `multiprocessing.Pool`: a
worker killed from outside (the out-of-memory killer) is an error (BrokenProcessPool), where a
Pool waited forever for its results.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor


def parallel_map(fn, items: list, workers: int = 1, chunksize: int | None = None) -> list:
    if workers <= 1 or len(items) < 2 * workers:
        return [fn(x) for x in items]
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    chunksize = chunksize or max(1, len(items) // (workers * 8))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context(method)) as pool:
        return list(pool.map(fn, items, chunksize=chunksize))
