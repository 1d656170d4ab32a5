"""bench comm's closed forms of the bytes per step by link level: they live in costs/link_bytes.py (the
planner, a lower floor, reads them too); named here for bench/comm_cluster.py and its tests."""

from __future__ import annotations

from ..costs.link_bytes import PARTS, Unit, step_bytes

__all__ = ["PARTS", "Unit", "step_bytes"]
