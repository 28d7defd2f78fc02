"""Unknown anomalies: per-node online baselines, for faults nobody wrote a rule for.

Each node's key rates are averaged over `window_s` of event time (vectorised over the
node's entities), and the window means go, as one river-protocol sample per node, to a
`NoveltyAlarm` (`models/baseline.py`) built by `novelty_model`: its defaults, exactly the
setting `bench/nab_eval.py` scores on NAB (`docs/nab.md`). The detector is the same
everywhere; what the worker adds is an alert decision on its score, for operations (a
healthy fleet's page budget, not a NAB concern): a score >= `threshold` (well above the
detector's alarm level, 0.5) opens a low-severity (`info`) `unknown_anomaly` naming the
novel feature, but only once the node's baseline holds `report_after` windows; it
resolves after `quiet_windows` windows below the threshold. The detector learns and
scores every window all along: the gate only decides what is reported. Windows with a
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
>>> det = UnknownAnomalyDetector(window_s=10, report_after=200)
>>> rng = np.random.default_rng(0)
>>> found = [f for t in range(3000) for f in det.update(node(t, 4e10 + 1e9 * rng.standard_normal()))]
>>> found
[]
>>> found = [f for t in range(3000, 3060) for f in det.update(node(t, 2e8))]   # traffic collapses
>>> [(f.kind, f.state, f.severity, f.evidence[0].name) for f in found][:1]
[('unknown_anomaly', 'open', 'info', 'nic_tx_gbps')]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector
from .baseline import NoveltyAlarm
from .findings import INFO, OPEN, RESOLVED, EntityRef, Evidence, Finding
from .frames import GPU, NIC_PORT, LayoutGroup, SourceBatch, SourceView
from .vocabulary import UNKNOWN_ANOMALY

DETECTOR = "unknown/v1"
WINDOW_S = 10.0            # one learning sample per node per window
# The alert decision (what is reported), downstream of the NAB-scored detector; see
# docs/detectors.md. A healthy fleet must stay under 1 unknown_anomaly per 1000 node-hours,
# i.e. under one report in ~2 million feature-windows: far rarer than the chance records a
# NAB-tuned detector alarms on (score 0.5, about one in a few thousand samples per feature).
THRESHOLD = 0.9            # novelty 5x the detector's alarm level (score 1 - 0.5/5): a record
                           # beaten fivefold, or a value 7.5 % of the range width outside it
REPORT_AFTER = 1000        # windows of baseline (~2.8 h at 10 s) before a node's novelty is
                           # reported: chance records are ~1/n likely after n samples
QUIET_WINDOWS = 6          # windows below the threshold that resolve an open anomaly


def novelty_model() -> NoveltyAlarm:
    """The worker's per-node detector: `NoveltyAlarm`'s defaults, the setting scored on NAB.

    `bench/nab_eval.py` scores this factory, so the worker cannot drift from docs/nab.md.
    """
    return NoveltyAlarm()

# feature name -> (entity kind, rate or gauge column, how entities combine, scale to the unit)
FEATURES: dict[str, tuple[str, str, str, float]] = {
    "nic_tx_gbps": (NIC_PORT, "port_xmit_data", "sum", 8e-9),           # rate in bytes/s
    "nic_rx_gbps": (NIC_PORT, "port_rcv_data", "sum", 8e-9),
    "cnp_sent_per_s": (NIC_PORT, "np_cnp_sent", "sum", 1.0),
    "rx_pause_duty_max": (NIC_PORT, "rx_prio3_pause_duration", "max", 1.0),
    "gpu_power_w": (GPU, "power_mw", "sum", 1e-3),                      # gauge in mW
    "gpu_temperature_max_c": (GPU, "temperature_c", "max", 1.0),
}


_FEATURE_NAMES = tuple(FEATURES)


@dataclass
class _Node:
    model: NoveltyAlarm
    window_start_ns: int
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    open: Finding | None = None
    quiet: int = 0
    windows: int = 0   # windows learned by `model`


@dataclass
class UnknownAnomalyDetector(Detector):
    window_s: float = WINDOW_S
    threshold: float = THRESHOLD
    quiet_windows: int = QUIET_WINDOWS
    report_after: int = REPORT_AFTER
    _nodes: dict[str, _Node] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.quiet_windows < 1 or self.report_after < 0:
            raise ValueError("quiet_windows must be >= 1 and report_after >= 0")

    def _node(self, source: str, first_ns: int) -> _Node:
        node = self._nodes.get(source)
        if node is None:
            node = self._nodes[source] = _Node(novelty_model(), first_ns)
        return node

    def update(self, view: SourceView) -> list[Finding]:
        if view.source_kind != "node":
            return []
        node = self._node(view.source, view.time_ns)
        out: list[Finding] = []
        if view.time_ns - node.window_start_ns >= self.window_s * 1e9:
            out = self._close_window(view, node)
        self._accumulate(view, node)
        return out

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        """The ticks of one record at once: the same windows and sums as `update` tick by tick."""
        if batch.source_kind != "node" or not len(batch.times_ns):
            return []
        times = batch.times_ns
        node = self._node(batch.source, int(times[0]))
        contributions = self._contributions(batch)
        out: list[Finding] = []
        i, n = 0, len(times)
        while i < n:
            j = max(i, int(np.searchsorted(times, node.window_start_ns + self.window_s * 1e9, side="left")))
            self._add(node, contributions, i, min(j, n))
            if j >= n:
                break
            out += self._close_window(SourceView(batch.cluster, batch.source, "node", int(times[j]), 0), node)
            i = j
        return out

    def screen(self, group: LayoutGroup) -> None:
        """Each tick's feature values for every stack of a layout group, in one go."""
        plan = self._plan_of(group.key[0], group.key[2], group.key[3])
        if plan is None or not len(group.key[1]):
            return
        found = self._features(plan, group.rates, group.gauges)
        if found is None:
            for stack in group.stacks:
                stack.screens["unknown"] = None
            return
        per_tick, present = found
        for i, stack in enumerate(group.stacks):
            start = int(group.starts[i])
            end = start + len(stack.ticks)
            stack.screens["unknown"] = (per_tick[start:end], present[start:end])

    @staticmethod
    def _features(plan, rates, gauges):
        """(values, present) per tick and feature of a plan's features, or None if none present."""
        names, rate_cols, gauge_cols, is_max, scale, _ = plan
        parts = []
        if rate_cols.size:
            if rates is None:
                return None
            parts.append(rates[:, :, rate_cols])
        if gauge_cols.size:
            parts.append(gauges[:, :, gauge_cols])
        values = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)   # [t, n, features]
        present = ~np.isnan(values).all(axis=1)                                     # [t, features]
        if not present.any():
            return None
        sums = np.where(np.isnan(values), 0.0, values).sum(axis=1)
        if is_max.any():
            sums = np.where(is_max, np.fmax.reduce(values, axis=1), sums)
        return np.where(present, sums * scale, 0.0), present

    def _contributions(self, batch: SourceBatch) -> tuple[np.ndarray, np.ndarray] | None:
        """Each tick's value of every feature ([ticks, features], 0 where absent) and how many
        blocks carried it; None when no block of the record feeds any feature."""
        total = counts = None
        for stack in batch.stacks:
            if not len(stack.ids):
                continue
            plan = self._plan_of(stack.kind, stack.counter_names, stack.gauge_names)
            if plan is None:
                continue
            found = stack.screens["unknown"] if "unknown" in stack.screens else \
                self._features(plan, stack.rates, stack.gauges)
            if found is None:
                continue
            if total is None:
                total = np.zeros((len(batch.times_ns), len(_FEATURE_NAMES)))
                counts = np.zeros((len(batch.times_ns), len(_FEATURE_NAMES)), dtype=np.int64)
            per_tick, present = found
            rows, columns = stack.ticks[:, None], plan[5]
            total[rows, columns] += per_tick
            counts[rows, columns] += present
        return None if total is None else (total, counts)

    def _plan_of(self, layout_kind: str, counter_names: tuple[str, ...], gauge_names: tuple[str, ...]):
        """Which features a block layout feeds, from which columns (cached per layout)."""
        plans = self.__dict__.setdefault("_plans", {})
        key = (layout_kind, counter_names, gauge_names)
        if key in plans:
            return plans[key]
        rates, gauges = [], []
        for name, (kind, column, how, scale) in FEATURES.items():
            if kind != layout_kind:
                continue
            if column in counter_names:
                rates.append((name, counter_names.index(column), how == "max", scale))
            elif column in gauge_names:
                gauges.append((name, gauge_names.index(column), how == "max", scale))
        both = rates + gauges
        plan = None if not both else (
            [b[0] for b in both], np.array([b[1] for b in rates], dtype=np.intp),
            np.array([b[1] for b in gauges], dtype=np.intp), np.array([b[2] for b in both]),
            np.array([b[3] for b in both]), np.array([_FEATURE_NAMES.index(b[0]) for b in both], dtype=np.intp))
        if len(plans) >= 4096:
            plans.clear()
        plans[key] = plan
        return plan

    @staticmethod
    def _add(node: _Node, contributions, i: int, j: int) -> None:
        if j <= i or contributions is None:
            return
        total, counts = contributions
        sums, ns = total[i:j].sum(axis=0), counts[i:j].sum(axis=0)
        for f in np.flatnonzero(ns).tolist():
            name = _FEATURE_NAMES[f]
            node.sums[name] = node.sums.get(name, 0.0) + float(sums[f])
            node.counts[name] = node.counts.get(name, 0) + int(ns[f])

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
        # per feature first: the same evaluations score_one(x) makes, cached for learn_one
        per_feature = {name: node.model.score_one({name: value}) for name, value in x.items()}
        score = max(per_feature.values())
        node.model.learn_one(x)
        node.windows += 1
        if node.windows <= self.report_after:   # alert decision: baseline too young to report on
            score = 0.0
        if score >= self.threshold:
            node.quiet = 0
            if node.open is None:
                feature = max(per_feature, key=per_feature.get)
                node.open = Finding(
                    UNKNOWN_ANOMALY, OPEN, EntityRef(cluster=view.cluster, node=view.source), INFO,
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
                return [Finding(UNKNOWN_ANOMALY, RESOLVED, opened.entity, INFO, opened.onset_ns, view.time_ns,
                                opened.evidence, summary=f"resolved: {opened.summary}", detector=DETECTOR)]
        return []
