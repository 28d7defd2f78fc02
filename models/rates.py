"""Raw counter totals to per-second rates, vectorised over a whole block.

Rates are taken over the real elapsed event time between two samples of the same source,
never a nominal interval. Each counter's width and overflow behaviour comes from
`fabricwatch.counters`:

* a decrease of a W-bit wrapping counter that fits a plausible wrap is a wrap;
* any other decrease is a reset (reboot, driver reload): no rate for that interval;
* a saturating IB error counter pinned at all-ones gives no rate (its true value is unknown);
* a sample not newer than the previous one (duplicate, out of order) is refused.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame
>>> def frame(words, t_s):
...     return EntityFrame("nic_port", ("mlx5_0/1",), ("port_xmit_data",),
...                        np.array([[words]], dtype=np.uint64), (), np.empty((1, 0)), [{}])
>>> tracker = RateTracker()
>>> tracker.update("node-1", frame(0, 0), 0)
False
>>> f = frame(12_500_000_000, 1)           # 12.5e9 words in 1 s = 50 GB/s = 400 Gb/s
>>> tracker.update("node-1", f, 1_000_000_000)
True
>>> float(f.rates[0, 0] * 8 / 1e9)
400.0
>>> f = frame(5, 2)                          # went backwards: a reboot, no rate
>>> tracker.update("node-1", f, 2_000_000_000), float(f.rates[0, 0]), tracker.stats["counter_resets"]
(True, nan, 1)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from fabricwatch.counters import Overflow, spec_for

from .frames import EntityFrame

# A wrap is only believed if the wrapped delta is under this fraction of the counter's
# range; a larger "wrap" is far likelier to be a reset to a small value.
MAX_WRAP_FRACTION = 0.5


@dataclass
class _ColumnSpecs:
    modulus: np.ndarray      # float64 2**width (np.inf for 64-bit: never believed to wrap)
    saturated_at: np.ndarray  # uint64 all-ones of width for saturating counters, else 0
    saturating: np.ndarray   # bool
    scale: np.ndarray        # float64 raw unit -> rate unit


def _column_specs(names: tuple[str, ...]) -> _ColumnSpecs:
    specs = [spec_for(n) for n in names]
    # 64-bit totals do not wrap in the life of a cluster (2**64 words at 400 Gb/s is
    # ~47 years); a decrease is a reset.
    modulus = np.array([float(2**s.width_bits) if s.width_bits < 64 else np.inf for s in specs])
    saturating = np.array([s.overflow is Overflow.SATURATE for s in specs], dtype=bool)
    saturated_at = np.array(
        [(2**s.width_bits - 1) if s.overflow is Overflow.SATURATE else 0 for s in specs], dtype=np.uint64
    )
    scale = np.array([s.scale for s in specs])
    return _ColumnSpecs(modulus, saturated_at, saturating, scale)


class RateTracker:
    """Keeps the previous totals of every (source, block layout) and fills `frame.rates`."""

    def __init__(self) -> None:
        self._last: dict[tuple, tuple[int, np.ndarray]] = {}
        self._specs: dict[tuple[str, ...], _ColumnSpecs] = {}
        self.stats: Counter[str] = Counter()

    def _specs_for(self, names: tuple[str, ...]) -> _ColumnSpecs:
        specs = self._specs.get(names)
        if specs is None:
            specs = self._specs[names] = _column_specs(names)
        return specs

    def update(self, source: str, frame: EntityFrame, time_ns: int) -> bool:
        """Fill `frame.rates` / `frame.dt_s`; False if no rate could be derived.

        The first sample of a layout only primes the state. A sample not newer than the
        previous one is refused and counted (`stale_samples`) without touching the state.
        """
        key = (source, frame.kind, frame.ids, frame.counter_names)
        n, m = frame.counters.shape
        frame.rates = np.full((n, m), np.nan)
        prev = self._last.get(key)
        if prev is not None and time_ns <= prev[0]:
            self.stats["stale_samples"] += 1
            return False
        self._last[key] = (time_ns, frame.counters)
        if prev is None:
            return False
        prev_ns, prev_counters = prev
        dt_s = (time_ns - prev_ns) / 1e9
        frame.dt_s = dt_s
        specs = self._specs_for(frame.counter_names)

        cur = frame.counters
        went_down = cur < prev_counters
        # uint64 subtraction is modular; float64 keeps the magnitudes we care about.
        delta = (cur - prev_counters).astype(np.float64)
        if went_down.any():
            wrapped = (prev_counters.astype(np.float64) * -1.0 + cur.astype(np.float64)) + specs.modulus
            is_wrap = went_down & (wrapped < specs.modulus * MAX_WRAP_FRACTION) & ~specs.saturating
            is_reset = went_down & ~is_wrap
            delta = np.where(is_wrap, wrapped, delta)
            delta[is_reset] = np.nan
            self.stats["counter_wraps"] += int(is_wrap.sum())
            self.stats["counter_resets"] += int(is_reset.sum())
        if specs.saturating.any():
            pinned = specs.saturating & (cur == specs.saturated_at)
            if pinned.any():
                delta[pinned] = np.nan
                self.stats["saturated_counters"] += int(pinned.sum())
        frame.rates = delta * specs.scale / dt_s
        return True

    def forget(self, source: str) -> None:
        """Drop the state of a source (decommissioned node)."""
        for key in [k for k in self._last if k[0] == source]:
            del self._last[key]
