"""Unknown anomalies: per-node online baselines, for faults nobody wrote a rule for.

Each node's key rates are averaged over `window_s` of event time (vectorised over the
node's entities), and the window means go, as one river-protocol sample per node, to a
`NoveltyAlarm` (`models/baseline.py`, NAB 71.9) with its quiet operations setting. A
score >= `threshold` opens a low-severity (`info`) `unknown_anomaly` naming the novel
feature; it resolves after `quiet_windows` windows below the threshold. Windows with a
counter reset or no samples are skipped (no evidence), so a reboot is not "novel".

Node-level features keep the cost per node, not per port: six features learned once per
window (~50 µs each) is ~30 µs per second of telemetry per node.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def node(t_s, tx_bytes_s):
...     f = EntityFrame("nic_port", ("mlx5_0/1",), ("port_xmit_data",), np.zeros((1, 1), np.uint64), (),
...                     np.empty((1, 0)), [{}])
...     f.rates, f.dt_s = np.array([[tx_bytes_s]]), 1.0
...     return SourceView("c1", "node-1", "node", int(t_s * 1e9), 0, [f])
>>> det = UnknownAnomalyDetector(window_s=10, warm_up=30)
>>> rng = np.random.default_rng(0)
>>> found = [f for t in range(1200) for f in det.update(node(t, 4e10 + 1e9 * rng.standard_normal()))]
>>> found
[]
>>> found = [f for t in range(1200, 1260) for f in det.update(node(t, 2e8))]   # traffic collapses
>>> [(f.kind, f.state, f.severity, f.evidence[0].name) for f in found][:1]
[('unknown_anomaly', 'open', 'info', 'nic_tx_gbps')]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .baseline import NoveltyAlarm
from .findings import INFO, OPEN, RESOLVED, EntityRef, Evidence, Finding
from .frames import GPU, NIC_PORT, SourceView

DETECTOR = "unknown/v1"
WINDOW_S = 10.0            # one learning sample per node per window
THRESHOLD = 0.8            # well above NoveltyAlarm's alarm level (0.5): only the clearly novel
QUIET_WINDOWS = 6          # windows below the threshold that resolve an open anomaly
# NoveltyAlarm's quiet operations setting (fewer, later alarms than its NAB defaults).
WARM_UP = 1000
RANGE_TOLERANCE = 0.1
REFRACTORY = 300

# feature name -> (entity kind, rate or gauge column, how entities combine, scale to the unit)
FEATURES: dict[str, tuple[str, str, str, float]] = {
    "nic_tx_gbps": (NIC_PORT, "port_xmit_data", "sum", 8e-9),           # rate in bytes/s
    "nic_rx_gbps": (NIC_PORT, "port_rcv_data", "sum", 8e-9),
    "cnp_sent_per_s": (NIC_PORT, "np_cnp_sent", "sum", 1.0),
    "rx_pause_duty_max": (NIC_PORT, "rx_prio3_pause_duration", "max", 1.0),
    "gpu_power_w": (GPU, "power_mw", "sum", 1e-3),                      # gauge in mW
    "gpu_temperature_max_c": (GPU, "temperature_c", "max", 1.0),
}


@dataclass
class _Node:
    model: NoveltyAlarm
    window_start_ns: int
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    open: Finding | None = None
    quiet: int = 0


@dataclass
class UnknownAnomalyDetector:
    window_s: float = WINDOW_S
    threshold: float = THRESHOLD
    quiet_windows: int = QUIET_WINDOWS
    warm_up: int = WARM_UP
    _nodes: dict[str, _Node] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.quiet_windows < 1 or self.warm_up < 1:
            raise ValueError("quiet_windows and warm_up must be >= 1")

    def update(self, view: SourceView) -> list[Finding]:
        if view.source_kind != "node":
            return []
        node = self._nodes.get(view.source)
        if node is None:
            node = self._nodes[view.source] = _Node(
                NoveltyAlarm(warm_up=self.warm_up, range_tolerance=RANGE_TOLERANCE, refractory=REFRACTORY),
                view.time_ns)
        out: list[Finding] = []
        if view.time_ns - node.window_start_ns >= self.window_s * 1e9:
            out = self._close_window(view, node)
        self._accumulate(view, node)
        return out

    def _accumulate(self, view: SourceView, node: _Node) -> None:
        for name, (kind, column, how, scale) in FEATURES.items():
            for frame in view.frames_of(kind):
                values = frame.rate(column) if frame.column(column) is not None else frame.gauge(column)
                if values.size == 0 or np.isnan(values).all():
                    continue
                value = (np.nansum(values) if how == "sum" else np.nanmax(values)) * scale
                node.sums[name] = node.sums.get(name, 0.0) + float(value)
                node.counts[name] = node.counts.get(name, 0) + 1

    def _close_window(self, view: SourceView, node: _Node) -> list[Finding]:
        x = {name: node.sums[name] / node.counts[name] for name in node.sums if node.counts.get(name)}
        node.window_start_ns, node.sums, node.counts = view.time_ns, {}, {}
        if not x:
            return []
        score = node.model.score_one(x)
        node.model.learn_one(x)
        if score >= self.threshold:
            node.quiet = 0
            if node.open is None:
                feature = max(x, key=lambda k: node.model.score_one({k: x[k]}))
                node.open = Finding(
                    "unknown_anomaly", OPEN, EntityRef(cluster=view.cluster, node=view.source), INFO,
                    onset_ns=view.time_ns, detected_ns=view.time_ns,
                    evidence=[Evidence(feature, x[feature], self.threshold, "window mean",
                                       f"novelty score {score:.2f} over a {self.window_s:g} s window")],
                    confidence=float(score),
                    summary=f"{view.source}: {feature} = {x[feature]:.3g} is unlike anything seen on this node",
                    probable_cause="no rule matched; a learned per-node baseline flagged it",
                    suggested_action="look at the node's dashboards; nothing automatic", detector=DETECTOR)
                return [node.open]
            return []
        if node.open is not None:
            node.quiet += 1
            if node.quiet >= self.quiet_windows:
                opened, node.open = node.open, None
                return [Finding("unknown_anomaly", RESOLVED, opened.entity, INFO, opened.onset_ns, view.time_ns,
                                opened.evidence, summary=f"resolved: {opened.summary}", detector=DETECTOR)]
        return []
