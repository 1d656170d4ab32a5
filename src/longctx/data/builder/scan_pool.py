"""The scan's worker processes (scan.run_scans): shards scanned in parallel, each result handed back as
it is done, and any failure stopping them all.

A `multiprocessing.Pool` waits forever for the result of a worker that died without one (the
out-of-memory killer, a SIGKILL): it starts a new worker and never hands the lost shard to it, so
a build whose worker was killed hung at "scan ... 88%" with no word. A `ProcessPoolExecutor` sees
the dead worker (BrokenProcessPool), said here as a DataError that names the files being scanned.
A shard that failed (its exception, re-raised once here) or a dead worker stops the other workers
at once rather than after their shards: their work is lost anyway, and a rerun resumes from the
shards already published.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from ...errors import DataError


def worker_context():
    """How workers start: spawn, so each imports only the scan's modules (~35 MB), whatever the parent
    has loaded (a test forks instead, so that its patches reach them)."""
    return mp.get_context("spawn")


def scan_in_workers(fn, jobs: list[tuple], workers: int, files_of, rounds: bool = False, initializer=None):
    """`fn(job)` for each of `jobs` in `workers` processes; yields the results as they finish (`rounds`: in
    job order, a round of `workers` jobs at a time, the caller stopping between rounds). `files_of(job)`:
    the input files a job reads, named when its worker dies. `initializer`: (function, argument) each worker
    runs first (what it shares with this process: given as it starts, as shared memory must be)."""
    init, arg = initializer or (None, None)
    pool = ProcessPoolExecutor(workers, mp_context=worker_context(), initializer=init,
                               initargs=() if init is None else (arg,))
    try:
        if rounds:
            for a in range(0, len(jobs), workers):
                batch = jobs[a:a + workers]
                futures = [pool.submit(fn, job) for job in batch]
                for future in futures:
                    yield _result(future, lambda batch=batch: batch, files_of)
            return
        futures = {pool.submit(fn, job): k for k, job in enumerate(jobs)}
        unfinished = set(futures.values())
        # (as_completed, not a wait() per result, which goes over every pending future: a corpus of 60,000 shards)
        for future in as_completed(futures):
            # (jobs start in order: a dead worker was running one of the earliest unfinished)
            yield _result(future, lambda: [jobs[k] for k in sorted(unfinished)[:workers]], files_of)
            unfinished.discard(futures[future])
    finally:  # (also a failure, a Ctrl-C or the caller stopping early: the other workers end now)
        _stop(pool)


def _result(future, running, files_of):
    """The future's result; a dead worker said as a DataError naming the files of the jobs `running()` returns."""
    try:
        return future.result()
    except BrokenProcessPool:
        files = [f for job in running() for f in files_of(job)]
        shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        raise DataError(f"a scan worker process died without a result (killed from outside: most often by the "
                        f"out-of-memory killer) while the scan read one of {shown}. The shards scanned before it are "
                        f"kept: run the same command again to resume, with fewer --workers or a lower --max-memory "
                        f"if memory ran out (a very long document or line needs memory of its own).") from None


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the pool, its running workers killed rather than waited for (shutdown alone waits for them)."""
    processes = list((pool._processes or {}).values())  # (3.14 has terminate_workers; 3.10 has only this)
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()
