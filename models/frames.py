"""What the models see: one tick of one source, as numpy arrays.

The stream layer decodes a protobuf `Snapshot` into a `SourceView`; the models never see
protobuf, Kafka or Faust, so tests and replay drive them with plain arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
