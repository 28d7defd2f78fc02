"""What the models see: ticks of one source, as numpy arrays.

The stream layer decodes a Kafka record (several consecutive ticks of one source, as a
collector's batch carried them) into a `SourceBatch`: one `FrameStack` per block layout,
arrays ``[tick, entity, column]``, so that the detectors that run on every 100 ms PFC tick
do a handful of numpy operations per record, not per tick. A `SourceView` is one tick
(every stack's frame at that tick); detectors without a batch path iterate them. The
models never see protobuf, Kafka or Faust, so tests and replay drive them with arrays.

>>> stack = FrameStack("nic_port", ("mlx5_0/1",), ("rx_prio3_pause",), (), np.array([0, 1, 2]),
...                    np.array([[[0]], [[5]], [[9]]], dtype=np.uint64), np.empty((3, 1, 0)),
...                    {"netdev": [["eth0"]] * 3})
>>> batch = SourceBatch("c1", "node-1", "node", np.array([10, 20, 30]), [stack])
>>> [(v.time_ns, v.frames[0].counters.tolist(), v.frames[0].label("netdev")) for v in batch.views()]
[(10, [[0]], ['eth0']), (20, [[5]], ['eth0']), (30, [[9]], ['eth0'])]
>>> batch.after(15).times_ns.tolist(), batch.after(15).stacks[0].counters[:, 0, 0].tolist()
([20, 30], [5, 9])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from fabricwatch.counters import spec_for

GPU, NIC_PORT, SWITCH_PORT = "gpu", "nic_port", "switch_port"


@dataclass
class EntityFrame:
    """Entities of one kind from one source, sharing columns (one `CounterBlock`)."""

    kind: str                          # GPU | NIC_PORT | SWITCH_PORT
    ids: tuple[str, ...]
    counter_names: tuple[str, ...]
    counters: np.ndarray               # uint64 [n_entities, n_counters], raw totals
    gauge_names: tuple[str, ...]
    gauges: np.ndarray                 # float64 [n_entities, n_gauges], NaN = not read
    # Strings per label name, one per entity ("" = absent). Rows (a list of per-entity
    # dicts) are accepted too and turned into columns.
    labels: dict[str, list[str]] | list[dict[str, str]]
    # Filled by rates.RateTracker: per-second rates in each counter's rate unit; NaN where
    # no honest rate exists (first sample, counter reset, saturated error counter).
    rates: np.ndarray | None = None
    dt_s: float = float("nan")

    def __post_init__(self) -> None:
        if isinstance(self.labels, list):
            names = {k for row in self.labels for k in row}
            self.labels = {k: [row.get(k, "") for row in self.labels] for k in sorted(names)}

    def column(self, name: str) -> int | None:
        try:
            return self.counter_names.index(name)
        except ValueError:
            return None

    def rate(self, name: str) -> np.ndarray:
        """Rates of one counter for every entity (NaN if the counter is absent)."""
        j = self.column(name)
        if j is None or self.rates is None:
            return np.full(len(self.ids), np.nan)
        return self.rates[:, j]

    def delta(self, name: str) -> np.ndarray:
        """Increase of one counter over the last interval, in its raw unit."""
        return self.rate(name) * self.dt_s / _scale(name)

    def gauge(self, name: str) -> np.ndarray:
        try:
            return self.gauges[:, self.gauge_names.index(name)]
        except ValueError:
            return np.full(len(self.ids), np.nan)

    def label(self, name: str) -> list[str]:
        values = self.labels.get(name)
        return values if values is not None else [""] * len(self.ids)


def _scale(name: str) -> float:
    return spec_for(name).scale


@dataclass(frozen=True)
class DeviceEvent:
    entity_id: str
    kind: str
    code: int
    time_ns: int
    detail: str = ""


@dataclass(frozen=True)
class RankStep:
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    step: int
    start_ns: int
    step_seconds: float
    busy_seconds: float
    collective_wait_seconds: float


def step_end_ns(step: RankStep) -> int:
    """When a rank's step ended (its start plus its duration), in ns."""
    return step.start_ns + int(step.step_seconds * 1e9)


_STEP_AND_JOB = attrgetter("step", "job_id")


def one_job_step(steps: list[RankStep]) -> bool:
    """Whether these reports (at least one) are all of one job's one step: a C-level pass, as a
    100,000-rank job sends 12,500 records a step."""
    return len(set(map(_STEP_AND_JOB, steps))) == 1


@dataclass(frozen=True)
class RankProgress:
    """One rank's collective-progress heartbeat (`RankProgress` of telemetry.proto)."""
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    time_ns: int              # when the rank sampled its counters
    entered: int              # collectives entered since the process started
    completed: int            # ... and completed (<= entered)
    last_entered_ns: int      # 0 = never
    last_completed_ns: int    # 0 = never
    step: int = 0


@dataclass
class SourceView:
    """One tick of one node or switch."""

    cluster: str
    source: str
    source_kind: str                   # "node" | "switch"
    time_ns: int
    seq: int
    frames: list[EntityFrame] = field(default_factory=list)
    events: list[DeviceEvent] = field(default_factory=list)
    rank_steps: list[RankStep] = field(default_factory=list)

    def frames_of(self, kind: str) -> list[EntityFrame]:
        return [f for f in self.frames if f.kind == kind]


@dataclass
class FrameStack:
    """One block layout of one source over several of its ticks: arrays ``[tick, entity, column]``.

    ``ticks`` are indices into the owning `SourceBatch`'s ``times_ns`` (a layout need not
    be in every tick: PFC-only ticks carry one layout, the 1 s ticks others). Labels are
    per tick: ``labels[name][k]`` is the column at the stack's k-th tick.
    """

    kind: str
    ids: tuple[str, ...]
    counter_names: tuple[str, ...]
    gauge_names: tuple[str, ...]
    ticks: np.ndarray                  # intp [t]
    counters: np.ndarray               # uint64 [t, n, m], raw totals
    gauges: np.ndarray                 # float64 [t, n, g], NaN = not read
    labels: dict[str, list[list[str]]] = field(default_factory=dict)
    # Filled by rates.RateTracker.update_stack: rates [t, n, m] (NaN where no honest rate)
    # and the elapsed time since the previous sample of the layout [t] (NaN for the first).
    rates: np.ndarray | None = None
    dt_s: np.ndarray | None = None
    times_ns: np.ndarray | None = None  # int64 [t]: set by SourceBatch
    # What detectors' `screen` found over a `LayoutGroup` of many records, per detector:
    # their per-record path reads it instead of computing it again (`models.detector`).
    screens: dict = field(default_factory=dict, repr=False)

    def frame(self, k: int) -> EntityFrame:
        """The stack's k-th tick as an `EntityFrame` (views, no copies of the arrays)."""
        f = EntityFrame(self.kind, self.ids, self.counter_names, self.counters[k], self.gauge_names,
                        self.gauges[k], {name: values[k] for name, values in self.labels.items()})
        if self.rates is not None:
            f.rates = self.rates[k]
            f.dt_s = float(self.dt_s[k])
        return f

    def column(self, name: str) -> int | None:
        try:
            return self.counter_names.index(name)
        except ValueError:
            return None

    def gauge_column(self, name: str) -> int | None:
        try:
            return self.gauge_names.index(name)
        except ValueError:
            return None

    def select(self, keep: np.ndarray) -> FrameStack:
        """The same stack restricted to the ticks where ``keep`` (bool [t]) holds."""
        idx = np.flatnonzero(keep)
        return FrameStack(self.kind, self.ids, self.counter_names, self.gauge_names, self.ticks[idx],
                          self.counters[idx], self.gauges[idx],
                          {n: [v[i] for i in idx.tolist()] for n, v in self.labels.items()},
                          None if self.rates is None else self.rates[idx],
                          None if self.dt_s is None else self.dt_s[idx],
                          None if self.times_ns is None else self.times_ns[idx])


@dataclass
class SourceBatch:
    """Consecutive ticks of one node or switch (one Kafka record), in event-time order."""

    cluster: str
    source: str
    source_kind: str                   # "node" | "switch"
    times_ns: np.ndarray               # int64 [T], strictly increasing
    stacks: list[FrameStack] = field(default_factory=list)
    events: dict[int, list[DeviceEvent]] = field(default_factory=dict)   # tick index -> its events
    received_ns: int = 0               # when the gateway accepted it (0: unknown, e.g. replay)

    def __post_init__(self) -> None:
        for stack in self.stacks:
            stack.times_ns = self.times_ns[stack.ticks]

    def views(self, stacks: list[FrameStack] | None = None, events: bool = True):
        """One `SourceView` per tick that ``stacks`` (default: all) or an event is in, in time order."""
        stacks = self.stacks if stacks is None else stacks
        at: dict[int, list[EntityFrame]] = {}
        for stack in stacks:
            for k, tick in enumerate(stack.ticks.tolist()):
                at.setdefault(tick, []).append(stack.frame(k))
        if events:
            for tick in self.events:
                at.setdefault(tick, [])
        for tick in sorted(at):
            yield SourceView(self.cluster, self.source, self.source_kind, int(self.times_ns[tick]), 0, at[tick],
                             list(self.events.get(tick, ())) if events else [])

    def after(self, time_ns: int) -> SourceBatch:
        """The ticks newer than ``time_ns`` (a redelivery or a late record keeps what is new)."""
        keep = self.times_ns > time_ns
        if keep.all():
            return self
        new_index = np.cumsum(keep) - 1
        stacks = []
        for stack in self.stacks:
            mask = keep[stack.ticks]
            if mask.any():
                s = stack.select(mask)
                s.ticks = new_index[s.ticks]
                stacks.append(s)
        events = {int(new_index[t]): e for t, e in self.events.items() if keep[t]}
        return SourceBatch(self.cluster, self.source, self.source_kind, self.times_ns[keep], stacks, events,
                           self.received_ns)

    @classmethod
    def of_views(cls, views: list[SourceView]) -> SourceBatch:
        """Stack single ticks (tests, and the models' own examples) into a batch."""
        first = views[0]
        times = np.array([v.time_ns for v in views], dtype=np.int64)
        groups: dict[tuple, list[tuple[int, EntityFrame]]] = {}
        for tick, view in enumerate(views):
            for f in view.frames:
                key = (f.kind, f.ids, f.counter_names, f.gauge_names, tuple(sorted(f.labels)))
                groups.setdefault(key, []).append((tick, f))
        stacks = []
        for (kind, ids, counter_names, gauge_names, label_names), frames in groups.items():
            n = len(ids)
            stacks.append(FrameStack(
                kind, ids, counter_names, gauge_names, np.array([t for t, _ in frames], dtype=np.intp),
                np.stack([f.counters for _, f in frames]).astype(np.uint64).reshape(len(frames), n,
                                                                                    len(counter_names)),
                np.stack([f.gauges for _, f in frames]).astype(np.float64).reshape(len(frames), n, len(gauge_names)),
                {name: [list(f.label(name)) for _, f in frames] for name in label_names}))
        events = {t: list(v.events) for t, v in enumerate(views) if v.events}
        return cls(first.cluster, first.source, first.source_kind, times, stacks, events)


@dataclass
class LayoutGroup:
    """The stacks of one block layout from several records (sources), end to end.

    The arrays are the stacks' ticks concatenated, ``starts[i]`` the first row of the i-th
    stack; ``rates`` is filled by `rates.RateTracker.update_group`, and each stack's
    ``rates`` / ``dt_s`` are then views into it. Detectors screen a whole group with a few
    array operations (`segment_any`) and judge tick by tick only the stacks that need it.
    """

    key: tuple                         # (kind, ids, counter names, gauge names)
    sources: list[str]
    stacks: list[FrameStack]
    counters: np.ndarray               # uint64 [rows, n, m]
    gauges: np.ndarray                 # float64 [rows, n, g]
    times_ns: np.ndarray               # int64 [rows]
    starts: np.ndarray                 # intp [stacks]
    rates: np.ndarray | None = None
    dt_s: np.ndarray | None = None

    @classmethod
    def of(cls, key: tuple, items: list[tuple[str, FrameStack]]) -> LayoutGroup:
        stacks = [s for _, s in items]
        lengths = np.array([len(s.ticks) for s in stacks], dtype=np.intp)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.intp)
        if len(stacks) == 1:
            st = stacks[0]
            return cls(key, [items[0][0]], stacks, st.counters, st.gauges, st.times_ns, starts)
        return cls(key, [src for src, _ in items], stacks, np.concatenate([s.counters for s in stacks]),
                   np.concatenate([s.gauges for s in stacks]), np.concatenate([s.times_ns for s in stacks]), starts)

    def segment_any(self, rows: np.ndarray) -> np.ndarray:
        """Per stack, whether any of its rows is set (``rows``: bool [rows])."""
        return np.logical_or.reduceat(rows, self.starts) if len(self.stacks) > 1 else rows.any(keepdims=True)


def layout_groups(batches: list[SourceBatch]) -> list[LayoutGroup]:
    """Every stack of these records, grouped by layout (records keep their order within a group)."""
    by_key: dict[tuple, list[tuple[str, FrameStack]]] = {}
    for batch in batches:
        for stack in batch.stacks:
            key = (stack.kind, stack.ids, stack.counter_names, stack.gauge_names)
            by_key.setdefault(key, []).append((batch.source, stack))
    return [LayoutGroup.of(key, items) for key, items in by_key.items()]
