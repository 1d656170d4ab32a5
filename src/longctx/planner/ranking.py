"""The ranked plans, timed as they are read: a search keeps every candidate that fits (memory is
cheap to predict) and times only those that can come before the plans asked for.

Each candidate enters a heap under a lower bound of its sort key (planner/step_bound.py: parts of its
step that the rest only adds to, its compute, least exposed FSDP, co2's outer all-reduce and expert
all-to-alls). Reading position i pops the
heap until the smallest entry is a timed one: a candidate whose bound is smaller is timed and pushed
back under its real key. Entries of equal keys leave in the order they were found, so the order is
exactly that of timing every candidate and sorting them stably (tests/unit/test_planner_ranking.py);
the table's ten rows time hundreds of candidates, not every one.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .cost import Estimate, Footprint


class Ranking(Sequence):
    """A sequence of Estimates in `key` order, made from `found` (footprints that fit, in the order the
    search found them) by `complete` as positions are read. bound(fp) <= key(complete(fp)) for every fp."""

    def __init__(self, found: list[Footprint], complete: Callable[[Footprint], Estimate],
                 key: Callable[[Estimate], tuple], bound: Callable[[Footprint], tuple]):
        self._complete, self._key = complete, key
        self._heap: list[tuple[tuple, int, Any]] = [(bound(fp), i, fp) for i, fp in enumerate(found)]
        heapq.heapify(self._heap)
        self._found = found
        self._done: list[Estimate] = []
        self._timed_at: dict[int, Estimate] = {}  # found index -> its estimate, once timed
        self.seconds = 0.0  # spent timing candidates

    @property
    def timed(self) -> int:
        """Candidates timed so far (every one when the whole sequence has been read)."""
        return len(self._timed_at)

    def _time(self, i: int) -> Estimate:
        est = self._timed_at.get(i)
        if est is None:
            t0 = time.perf_counter()
            est = self._timed_at[i] = self._complete(self._found[i])
            self.seconds += time.perf_counter() - t0
        return est

    def _fill(self, n: int) -> None:
        """Rank the first n (or all there are)."""
        while len(self._done) < n and self._heap:
            _, i, item = self._heap[0]
            if isinstance(item, Estimate):  # its real key is the smallest left: nothing can come before it
                heapq.heappop(self._heap)
                self._done.append(item)
            else:
                est = self._time(i)
                heapq.heapreplace(self._heap, (self._key(est), i, est))

    def __len__(self) -> int:
        return len(self._found)

    def __getitem__(self, index):
        if isinstance(index, slice):
            self._fill(index.indices(len(self))[1] if index.step is None or index.step > 0 else len(self))
            return self._done[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"plan {index} of {len(self)}")
        self._fill(index + 1)
        return self._done[index]

    def __iter__(self) -> Iterator[Estimate]:
        for i in range(len(self)):
            yield self[i]

    def first(self, keep: Callable[[Any], bool]) -> Estimate | None:
        """The first estimate in order for which keep(candidate) (keep reads mesh_shape, policy,
        micro_batch: a Footprint's and its Estimate's are the same), timing only candidates it keeps."""
        done = next((e for e in self._done if keep(e)), None)
        if done is not None:  # everything not yet in order comes after every ranked one
            return done
        heap = [entry for entry in self._heap if keep(self._found[entry[1]])]
        heapq.heapify(heap)
        while heap:
            _, i, item = heap[0]
            if isinstance(item, Estimate):
                return item
            est = self._time(i)
            heapq.heapreplace(heap, (self._key(est), i, est))
        return None


def first(rows: Sequence[Estimate], keep: Callable[[Any], bool]) -> Estimate | None:
    """The first of `rows` (a Ranking or a list of estimates) for which keep(row)."""
    if isinstance(rows, Ranking):
        return rows.first(keep)
    return next((e for e in rows if keep(e)), None)
