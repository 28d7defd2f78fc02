"""Raw counter totals to per-second rates, vectorised over a whole block.

Rates are taken over the real elapsed event time between two samples of the same source,
never a nominal interval. Each counter's width and overflow behaviour comes from
`fabricwatch.counters`:

* a decrease of a W-bit wrapping counter that fits a plausible wrap is a wrap;
* any other decrease is a reset (reboot, driver reload): no rate for that interval;
* a saturating counter (IB PMA PortCounters: ``port_xmit_wait``, the error counters) at
  all-ones gives no rate (NaN: unknown, never zero), both when it is pinned there and
  when it reaches all-ones during the interval (the increase past it is lost); counted
  in ``stats`` as ``saturated_counters`` (every such sample) and ``counter_saturations``
  (the samples where it got there);
* a sample not newer than the previous one (duplicate, out of order) is refused.

State is kept per (source, block layout), and a layout holds the sender's entity ids: at
most `MAX_LAYOUTS_PER_SOURCE` layouts of one source are kept (the oldest learnt goes first,
counted in ``stats["layouts_evicted"]``), so a sender naming fresh ids in every snapshot
cannot grow the tracker, or the checkpoint that holds it, without bound.

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

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from fabricwatch.counters import Overflow, spec_for

from .frames import EntityFrame, FrameStack, LayoutGroup

# A wrap is only believed if the wrapped delta is under this fraction of the counter's
# range; a larger "wrap" is far likelier to be a reset to a small value.
MAX_WRAP_FRACTION = 0.5
# Block layouts (entity ids x column names) kept per source. An honest node or switch sends
# a handful (one per entity kind, the PFC-only ticks' own, a switch answering some paths);
# a snapshot has at most 32 blocks, so twice that never evicts an honest one.
MAX_LAYOUTS_PER_SOURCE = 64
# Distinct column-name tuples whose specs are cached (names come from the sender too).
MAX_SPECS_CACHED = 1024


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

    def __init__(self, max_layouts_per_source: int = MAX_LAYOUTS_PER_SOURCE) -> None:
        self.max_layouts_per_source = max_layouts_per_source
        self._last: dict[tuple, tuple[int, np.ndarray]] = {}
        self._layouts: dict[str, deque[tuple]] = {}        # source -> its keys of `_last`, oldest first
        self._specs: dict[tuple[str, ...], _ColumnSpecs] = {}
        self.stats: Counter[str] = Counter()

    def __setstate__(self, state: dict) -> None:
        # a checkpoint from before layouts were bounded
        self.__dict__.update(state)
        if "_layouts" not in state:
            self.max_layouts_per_source = MAX_LAYOUTS_PER_SOURCE
            self._layouts = {}
            for key in self._last:
                self._layouts.setdefault(key[0], deque()).append(key)

    def _specs_for(self, names: tuple[str, ...]) -> _ColumnSpecs:
        specs = self._specs.get(names)
        if specs is None:
            if len(self._specs) >= MAX_SPECS_CACHED:
                self._specs.clear()              # a cache: rebuilt on demand
            specs = self._specs[names] = _column_specs(names)
        return specs

    def _remember(self, key: tuple, sample: tuple[int, np.ndarray]) -> None:
        """Keep ``sample`` as the last of ``key``; a new layout past its source's bound evicts the oldest."""
        if key not in self._last:
            layouts = self._layouts.setdefault(key[0], deque())
            layouts.append(key)
            if len(layouts) > self.max_layouts_per_source:
                del self._last[layouts.popleft()]
                self.stats["layouts_evicted"] += 1
        self._last[key] = sample

    def update(self, source: str, frame: EntityFrame, time_ns: int) -> bool:
        """Fill `frame.rates` / `frame.dt_s`; False if no rate could be derived.

        The first sample of a layout only primes the state. A sample not newer than the
        previous one is refused and counted (`stale_samples`) without touching the state.
        """
        n, m = frame.counters.shape
        stack = FrameStack(frame.kind, frame.ids, frame.counter_names, frame.gauge_names, np.zeros(1, np.intp),
                           frame.counters.reshape(1, n, m), np.empty((1, n, 0)), times_ns=np.array([time_ns]))
        fresh = self.update_stack(source, stack)
        frame.rates = stack.rates[0]
        if fresh and stack.dt_s[0] == stack.dt_s[0]:
            frame.dt_s = float(stack.dt_s[0])
            return True
        return False

    def update_stack(self, source: str, stack: FrameStack) -> bool:
        """Fill `stack.rates` [t, n, m] and `stack.dt_s` [t] for every tick at once.

        Each tick's rate is taken against the tick before it (the state's last sample for
        the first), exactly as `update` would one tick at a time. Ticks not newer than the
        state's last sample are refused (NaN rates, counted). False if nothing was new.
        """
        key = (source, stack.kind, stack.ids, stack.counter_names)
        cur = stack.counters
        t, n, m = cur.shape
        times = stack.times_ns
        stack.rates = np.full((t, n, m), np.nan)
        stack.dt_s = np.full(t, np.nan)
        prev = self._last.get(key)
        first = 0
        if prev is not None:
            first = int(np.searchsorted(times, prev[0], side="right"))   # times increase: a prefix is stale
            if first:
                self.stats["stale_samples"] += first
                if first == t:
                    return False
        # a copy: `cur` may view the record's bytes, which must not stay alive with the state
        self._remember(key, (int(times[-1]), cur[-1].copy()))
        if prev is None:
            if t == 1:
                return True
            before, before_ns, lo = cur[:-1], times[:-1], 1
        else:
            before = np.concatenate([prev[1][None], cur[first:-1]]) if t - first > 1 else prev[1][None]
            before_ns = np.concatenate([[prev[0]], times[first:-1]])
            lo = first
        now = cur[lo:]
        dt_s = (times[lo:] - before_ns) / 1e9
        stack.dt_s[lo:] = dt_s
        specs = self._specs_for(stack.counter_names)
        stack.rates[lo:] = self._deltas(now, before, specs) * specs.scale / dt_s[:, None, None]
        return True

    def update_group(self, group: LayoutGroup) -> None:
        """`update_stack` for every stack of a layout group, with one set of array operations.

        Each stack's first tick is taken against the state's last sample of its source (or
        the previous stack of the same source in the group); stacks that would refuse a tick
        (not newer than the state) go through `update_stack` alone.
        """
        if len(group.stacks) == 1:
            self.update_stack(group.sources[0], group.stacks[0])
            group.rates, group.dt_s = group.stacks[0].rates, group.stacks[0].dt_s
            return
        kind, ids, names, _ = group.key
        cur, times = group.counters, group.times_ns
        rows, n, m = cur.shape
        before = np.empty_like(cur)
        before[1:] = cur[:-1]
        before_ns = np.empty_like(times)
        before_ns[1:] = times[:-1]
        primed = np.ones(rows, dtype=bool)          # rows that have a sample before them
        alone = []
        last_row: dict[str, int] = {}
        for i, (source, stack) in enumerate(zip(group.sources, group.stacks)):
            start = int(group.starts[i])
            end = start + len(stack.ticks)
            if source in last_row:                   # the same source earlier in this group
                j = last_row[source]
                before[start], before_ns[start] = cur[j], times[j]
            else:
                prev = self._last.get((source, kind, ids, names))
                if prev is None:
                    primed[start] = False
                    before[start], before_ns[start] = cur[start], times[start]
                elif prev[0] >= times[start]:
                    alone.append(i)                  # would refuse a tick: the careful path
                    continue
                else:
                    before[start], before_ns[start] = prev[1], prev[0]
            last_row[source] = end - 1
        dt_s = (times - before_ns) / 1e9
        dt_s[~primed] = np.nan
        specs = self._specs_for(names)
        delta = self._deltas(cur, before, specs, primed)
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = delta * specs.scale / dt_s[:, None, None]
        rates[~primed] = np.nan
        group.rates, group.dt_s = rates, dt_s
        for i, (source, stack) in enumerate(zip(group.sources, group.stacks)):
            if i in alone:
                self.update_stack(source, stack)
                continue
            start = int(group.starts[i])
            end = start + len(stack.ticks)
            stack.rates, stack.dt_s = rates[start:end], dt_s[start:end]
        for source, j in last_row.items():
            key = (source, kind, ids, names)
            prev = self._last.get(key)
            if prev is None or prev[0] < times[j]:
                self._remember(key, (int(times[j]), cur[j].copy()))

    def _deltas(self, now: np.ndarray, before: np.ndarray, specs, primed: np.ndarray | None = None) -> np.ndarray:
        """Counter increases [rows, n, m] as float64: wraps undone, resets and saturated
        counters NaN (counted); ``primed``: rows that have a real sample before them."""
        went_down = now < before
        # uint64 subtraction is modular; float64 keeps the magnitudes we care about.
        delta = (now - before).astype(np.float64)
        if went_down.any():
            wrapped = (before.astype(np.float64) * -1.0 + now.astype(np.float64)) + specs.modulus
            is_wrap = went_down & (wrapped < specs.modulus * MAX_WRAP_FRACTION) & ~specs.saturating
            is_reset = went_down & ~is_wrap
            delta = np.where(is_wrap, wrapped, delta)
            delta[is_reset] = np.nan
            self.stats["counter_wraps"] += int(is_wrap.sum())
            self.stats["counter_resets"] += int(is_reset.sum())
        if specs.saturating.any():
            pinned = specs.saturating & (now == specs.saturated_at)
            if primed is not None:
                pinned &= primed[:, None, None]
            if pinned.any():
                delta[pinned] = np.nan
                self.stats["saturated_counters"] += int(pinned.sum())
                self.stats["counter_saturations"] += int((pinned & (before != specs.saturated_at)).sum())
        return delta

    def forget(self, source: str) -> None:
        """Drop the state of a source (decommissioned node)."""
        for key in self._layouts.pop(source, ()):
            self._last.pop(key, None)
