"""Event time in the simulated world: seconds after the simulator's ``start_unix_ns``.

Every fault's ``onset_s`` and ``offset_s`` are such seconds (``offset_s = INF``: the fault
outlives the run); `ClusterSimulator` turns them into absolute event time when it labels
them (`labels.GroundTruth`).

>>> check_times(12.0, INF)
>>> check_times(12.0, 8.0)
Traceback (most recent call last):
ValueError: offset_s must be > onset_s (12.0), got 8.0
"""
from __future__ import annotations

import math

INF = math.inf

# 2026-01-01T00:00:00Z: a fixed default so that runs are reproducible.
DEFAULT_START_UNIX_NS = 1_767_225_600_000_000_000


def check_times(onset_s: float, offset_s: float) -> None:
    if not onset_s >= 0.0:
        raise ValueError(f"onset_s must be >= 0, got {onset_s!r}")
    if not offset_s > onset_s:
        raise ValueError(f"offset_s must be > onset_s ({onset_s}), got {offset_s!r}")
