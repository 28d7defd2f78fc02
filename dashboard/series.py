"""`SeriesTable`: the ring buffers of recent derived values that an entity page charts.

One preallocated block per entity kind (float16 values, int32 decisecond times), rows of
forgotten entities reused, a bound on the rows. Separate from the state because it is the
only structure that grows with the cluster, and its memory arithmetic
(`SeriesTable.bytes_per_entity`) is what `DashboardLimits` documents.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .shapes import finite_or_none

_TIME_UNIT_NS = 100_000_000                      # series times are kept in deciseconds


class SeriesTable:
    """Ring buffers of recent values for all entities of one kind, in one preallocated block.

    Values are float16 (3 significant digits: enough for a chart, half the memory of
    float32), times int32 deciseconds since the table's first sample (±6.8 years).

    >>> t = SeriesTable(("a", "b"), capacity_points=3, max_entities=2)
    >>> for i in range(5):
    ...     t.append(["x"], 1_000_000_000 * i, np.array([[i, 10 * i]], dtype=float))
    >>> s = t.series("x")
    >>> s["t_ms"], s["a"], s["b"]
    ([2000, 3000, 4000], [2.0, 3.0, 4.0], [20.0, 30.0, 40.0])
    >>> t.append(["y", "z"], 0, np.zeros((2, 2))); t.dropped_entities   # z is past the bound
    1
    >>> t.bytes_per_entity()          # 3 points x (4-byte time + 2 x 2-byte values) + 8
    32
    """

    def __init__(self, metrics: tuple[str, ...], capacity_points: int, max_entities: int) -> None:
        self.metrics = metrics
        self.capacity_points = capacity_points
        self.max_entities = max_entities
        self.dropped_entities = 0
        self._rows: dict[str, int] = {}
        self._free: list[int] = []                 # rows of forgotten entities, reused first
        self._epoch_ns: int | None = None
        self._alloc(0)

    def _alloc(self, n: int) -> None:
        c, m = self.capacity_points, len(self.metrics)
        times = np.zeros((n, c), dtype=np.int32)
        values = np.full((n, c, m), np.nan, dtype=np.float16)
        written = np.zeros(n, dtype=np.int64)
        if n and len(self._rows):
            k = self._times.shape[0]
            times[:k], values[:k], written[:k] = self._times, self._values, self._written
        self._times, self._values, self._written = times, values, written

    def bytes_per_entity(self) -> int:
        """Array bytes per entity (the index adds ~150 bytes: dict slot and key string)."""
        return self.capacity_points * (4 + 2 * len(self.metrics)) + 8

    def nbytes(self) -> int:
        return self._times.nbytes + self._values.nbytes + self._written.nbytes

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def _row(self, key: str) -> int:
        row = self._rows.get(key)
        if row is not None:
            return row
        if len(self._rows) >= self.max_entities:
            self.dropped_entities += 1
            return -1
        if self._free:
            row = self._free.pop()
            self._written[row] = 0
            self._values[row] = np.nan
        else:
            row = len(self._rows)
            if row >= self._times.shape[0]:
                self._alloc(min(self.max_entities, max(16, 2 * row)))
        self._rows[key] = row
        return row

    def forget_prefix(self, prefix: str) -> int:
        """Drop every entity whose key starts with `prefix` (a forgotten source); their rows are reused."""
        gone = [k for k in self._rows if k.startswith(prefix)]
        for key in gone:
            self._free.append(self._rows.pop(key))
        return len(gone)

    def append(self, keys: Iterable[str], time_ns: int, values: np.ndarray) -> None:
        """One sample for each key (values: [len(keys), n_metrics]) at event time `time_ns`."""
        rows = np.array([self._row(k) for k in keys], dtype=np.int64)
        keep = rows >= 0
        if not keep.any():
            return
        rows, values = rows[keep], np.asarray(values, dtype=np.float64)[keep]
        if self._epoch_ns is None:
            self._epoch_ns = time_ns
        slots = self._written[rows] % self.capacity_points
        self._times[rows, slots] = (time_ns - self._epoch_ns) // _TIME_UNIT_NS
        with np.errstate(over="ignore"):   # beyond float16's range reads as inf: shown as a gap
            self._values[rows, slots, :] = values
        self._written[rows] += 1

    def _ordered(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        row = self._rows.get(key)
        if row is None:
            return None
        n = int(min(self._written[row], self.capacity_points))
        start = int(self._written[row] - n) % self.capacity_points
        order = (start + np.arange(n)) % self.capacity_points
        return self._times[row, order], self._values[row, order, :]

    def series(self, key: str) -> dict[str, list] | None:
        """Oldest first: ``t_ms`` (unix ms) and one list per metric (None where unknown)."""
        got = self._ordered(key)
        if got is None:
            return None
        times, values = got
        out: dict[str, list] = {"t_ms": [int((self._epoch_ns + int(t) * _TIME_UNIT_NS) // 1_000_000)
                                         for t in times]}
        for j, name in enumerate(self.metrics):
            out[name] = [finite_or_none(float(v)) for v in values[:, j]]
        return out

    def latest(self, key: str) -> dict[str, float | None]:
        got = self._ordered(key)
        if got is None or not len(got[0]):
            return {}
        return {name: finite_or_none(float(got[1][-1, j])) for j, name in enumerate(self.metrics)}

