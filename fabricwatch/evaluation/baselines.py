"""Baselines scored side by side with fabricwatch on the same replayed telemetry.

Both read the same decoded snapshots as the pipeline (`streams.decode.to_view`, rates from
`models.rates.RateTracker`) and emit `models.findings.Finding`s, turned into the same
protobuf `AnomalyEvent`s, so `matching` scores all three the same way.

**(a) Static rules** (`StaticRules`), as they are typically written for
Prometheus/Alertmanager, evaluated at every sample (finer than Prometheus' usual 15-60 s
evaluation interval, which only helps them):

=====================  ===============================================================  ============
rule                   expression                                                       kind
=====================  ===============================================================  ============
PFC pause frames       ``rate(tx|rx_prio3_pause[1m]) > 10000`` on a NIC port, or        pfc_storm
                       ``rate(pfc3-rx|tx-pkts[1m]) > 10000`` on a switch port,
                       ``for: 1m``
NIC speed              ``netdev_speed_mbps < nominal`` (and > 0: the link is up)        link_downgrade
step time              a rank's ``step_seconds > 1.2 x`` the job's median step time     straggler
                       (over its last 100 steps, at least 10)
link down              ``increase(link_downed[5m]) > 0``                                link_flap
link dead              ``netdev_speed_mbps == -1`` (no carrier) on a NIC port, or        link_down
                       ``oper_up == 0 and admin_up == 1`` on a switch port, ``for: 1m``
PCIe width             ``pcie_width_current < pcie_width_max`` (NIC and GPU)            pcie_downgrade
XID                    ``DCGM_FI_DEV_XID_ERRORS != 0``: any XID; the gauge keeps the     gpu_xid
                       last XID, so the alert never clears
ECC DBE                ``increase(ecc_uncorrected_volatile_total[5m]) > 0``             gpu_ecc_uncorrectable
=====================  ===============================================================  ============

The pause-frame threshold (10 000 frames/s) sits above the busiest healthy port's
one-minute average in the simulator (~8 000/s: incast XOFF/XON) and well below a storm's
~24 000/s (XOFF refreshed at half quanta on 400G), i.e. a rule an operator has tuned to the
fleet. In a synchronous job every rank reports the same step time, so comparing a rank
with the median of its peers *at the same step* never fires; the rule therefore compares
with the job's recent median, as a dashboard alert on ``step_seconds`` would.

**(b) river HalfSpaceTrees** (`HstBaseline`): ``preprocessing.MinMaxScaler() |
anomaly.HalfSpaceTrees()`` with river's defaults (10 trees, height 8, window 250; only the
seed is fixed, for reproducibility) on a few key rates:

* NIC port: transmitted and received pause duty, transmitted and received throughput
  (fraction of nominal rate);
* switch port: received pause duty, in and out throughput (fraction of port speed);
* rank: busy seconds, collective-wait seconds, step seconds of each step.

One model per entity *kind* (NIC ports, switch ports), shared by all entities of that kind
of a cluster, and one per training job for its ranks: a model per entity would need
``window_size`` = 250 samples of warm-up per port (25 s at 0.1 s, 4 min at 1 s), longer than
most scenarios. A model scores only once it has learned one window. An entity is flagged
when its score is >= 0.9 (`HST_THRESHOLD`) and the flag clears after 10 samples below. The
flag is reported as the fault class of the feature that deviates most from that model's
running mean (in running standard deviations): pause duty -> ``pfc_storm``, throughput ->
``link_downgrade``, rank timings -> ``straggler``. HST sees no discrete signals (link
state, PCIe width, XIDs), so it has no cases in those classes.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.models.findings import OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from fabricwatch.models.frames import GPU, NIC_PORT, SWITCH_PORT, EntityFrame, SourceView
from fabricwatch.models.topology import DEFAULT_NIC_RATE, Topology
from fabricwatch.models.vocabulary import (GPU_ECC_UNCORRECTABLE, GPU_XID, LINK_DOWN, LINK_DOWNGRADE, LINK_FLAP,
                                           PCIE_DOWNGRADE, PFC_STORM, STRAGGLER)

__all__ = ["StaticRules", "StaticRulesConfig", "HstBaseline", "HST_THRESHOLD", "SCORE_BINS"]

STATIC = "static-rules"
HST = "river-hst"
HST_THRESHOLD = 0.9
SCORE_BINS = 1000


class _Alerts:
    """Alertmanager-like state: one open alert per key; OPEN on the first firing, RESOLVED when it stops."""

    def __init__(self, detector: str) -> None:
        self.detector = detector
        self.open: dict[tuple, Finding] = {}

    def fire(self, key: tuple, kind: str, entity: EntityRef, t_ns: int, summary: str,
             evidence: list[Evidence] | None = None, onset_ns: int | None = None) -> list[Finding]:
        if key in self.open:
            return []
        f = Finding(kind, OPEN, entity, WARNING, onset_ns if onset_ns is not None else t_ns, t_ns,
                    evidence or [], summary=summary, detector=self.detector)
        self.open[key] = f
        return [f]

    def clear(self, key: tuple, t_ns: int) -> list[Finding]:
        f = self.open.pop(key, None)
        if f is None:
            return []
        return [Finding(f.kind, RESOLVED, f.entity, f.severity, f.onset_ns, t_ns, f.evidence,
                        summary=f"resolved: {f.summary}", detector=self.detector)]


def _nic_entity(view: SourceView, entity_id: str) -> EntityRef:
    device, _, port = entity_id.partition("/")
    return EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)


def _port_entity(view: SourceView, entity_id: str) -> EntityRef:
    return EntityRef(cluster=view.cluster, switch=view.source, port=entity_id)


def _gpu_entity(view: SourceView, entity_id: str) -> EntityRef:
    return EntityRef(cluster=view.cluster, node=view.source, device=entity_id)


# --------------------------------------------------------------------------- (a) static rules


@dataclass(frozen=True)
class StaticRulesConfig:
    pause_frames_per_s: float = 10_000.0
    pause_window_s: float = 60.0        # rate(...[1m])
    pause_for_s: float = 60.0           # for: 1m
    step_factor: float = 1.2
    step_median_steps: int = 100
    min_history_steps: int = 10
    increase_window_s: float = 300.0    # increase(...[5m]) > 0
    dead_for_s: float = 60.0            # link dead ... for: 1m
    default_nic_rate: str = DEFAULT_NIC_RATE


_NIC_PAUSE = ("tx_prio3_pause", "rx_prio3_pause")
_SW_PAUSE = ("pfc3-rx-pkts", "pfc3-tx-pkts")


@dataclass
class _Job:
    times: deque = field(default_factory=deque)   # step seconds of the last N distinct steps
    seen: set = field(default_factory=set)
    median: float | None = None                   # of `times`, recomputed when it changes


class StaticRules:
    """Prometheus/Alertmanager-style threshold rules (see the module docstring)."""

    def __init__(self, topology: Topology | None = None, config: StaticRulesConfig | None = None) -> None:
        from fabricwatch.models.linkrate import parse_ib_rate

        self.topology = topology
        self.config = config or StaticRulesConfig()
        self._default_mbps = parse_ib_rate(self.config.default_nic_rate).gbps * 1000.0
        self.alerts = _Alerts(STATIC)
        self._pause_hist: dict[tuple, deque] = {}
        self._pending: dict[tuple, int] = {}
        self._last_increase: dict[tuple, int] = {}
        self._jobs: dict[str, _Job] = {}
        self._nominal_cache: dict[tuple[str, str], float] = {}

    # -- per tick ---------------------------------------------------------------------------
    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        t = view.time_ns
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                out += self._pause(view, frame, _NIC_PAUSE, _nic_entity)
                out += self._speed(view, frame)
                out += self._increase(view, frame, "link_downed", LINK_FLAP, _nic_entity, "link went down")
                out += self._pcie(view, frame, _nic_entity)
                speed = frame.gauge("netdev_speed_mbps")
                out += self._dead(view, frame, speed == -1, speed == speed, _nic_entity)
            elif frame.kind == SWITCH_PORT:
                out += self._pause(view, frame, _SW_PAUSE, _port_entity)
                oper, admin = frame.gauge("oper_up"), frame.gauge("admin_up")
                out += self._dead(view, frame, (oper == 0) & (admin == 1), oper == oper, _port_entity)
            elif frame.kind == GPU:
                out += self._pcie(view, frame, _gpu_entity)
                out += self._increase(view, frame, "ecc_uncorrected_volatile_total", GPU_ECC_UNCORRECTABLE,
                                      _gpu_entity, "uncorrectable ECC errors")
        for event in view.events:
            if event.kind == "xid":
                out += self.alerts.fire(("xid", view.source, event.entity_id), GPU_XID,
                                        _gpu_entity(view, event.entity_id), t,
                                        f"{view.source} {event.entity_id} XID {event.code}")
        for step in view.rank_steps:
            out += self._step(view, step)
        return out

    # -- rules ------------------------------------------------------------------------------
    def _pause(self, view, frame: EntityFrame, names, entity) -> list[Finding]:
        cols = [j for j in (frame.column(n) for n in names) if j is not None]
        if not cols:
            return []
        cfg, t = self.config, view.time_ns
        key = (view.source, frame.kind, frame.ids)
        vals = frame.counters[:, cols].astype(np.float64)
        hist = self._pause_hist.setdefault(key, deque())
        hist.append((t, vals))
        while hist[0][0] < t - cfg.pause_window_s * 1e9:
            hist.popleft()
        if len(hist) < 2 or hist[0][1].shape != vals.shape:
            return []
        t0, v0 = hist[0]
        rate = (vals - v0) / ((t - t0) / 1e9)
        rate[rate < 0] = np.nan                       # a counter reset: no rate
        over = np.nanmax(np.where(np.isnan(rate), -1.0, rate), axis=1) > cfg.pause_frames_per_s
        out: list[Finding] = []
        for i in np.flatnonzero(over):
            eid = frame.ids[i]
            k = ("pause", view.source, eid)
            since = self._pending.setdefault(k, t)
            if t - since >= cfg.pause_for_s * 1e9 and k not in self.alerts.open:
                r = float(np.nanmax(rate[i]))
                out += self.alerts.fire(k, PFC_STORM, entity(view, eid), t,
                                        f"{view.source} {eid} PFC pause frames {r:.0f}/s for 1m",
                                        [Evidence("pause_frames_per_s", r, cfg.pause_frames_per_s, "frames/s")],
                                        onset_ns=since)
        if self._pending:
            for i in np.flatnonzero(~over):
                k = ("pause", view.source, frame.ids[i])
                if self._pending.pop(k, None) is not None:
                    out += self.alerts.clear(k, t)
        return out

    def _nominal_mbps(self, node: str, entity_id: str) -> float:
        k = (node, entity_id)
        v = self._nominal_cache.get(k)
        if v is None:
            nic = self.topology.nic(node, entity_id) if self.topology is not None else None
            v = nic.nominal_gbps * 1000.0 if nic is not None and nic.nominal_gbps else self._default_mbps
            self._nominal_cache[k] = v
        return v

    def _speed(self, view, frame: EntityFrame) -> list[Finding]:
        speed = frame.gauge("netdev_speed_mbps")
        nominal = np.array([self._nominal_mbps(view.source, eid) for eid in frame.ids])
        low = (speed > 0) & (speed < nominal)
        ok = ~low & (speed == speed)                   # a reading that is not low (NaN: no reading)
        return self._states(view, frame, "speed", low, ok, lambda i, eid: (
            LINK_DOWNGRADE, _nic_entity(view, eid), f"{view.source} {eid} speed {speed[i]:g} Mb/s < {nominal[i]:g}",
            [Evidence("netdev_speed_mbps", float(speed[i]), float(nominal[i]), "Mb/s")]))

    def _states(self, view, frame: EntityFrame, rule: str, firing: np.ndarray, clear: np.ndarray,
                make) -> list[Finding]:
        """Open an alert where `firing`, resolve an open one where `clear` (vectorised: loops over changes only)."""
        out: list[Finding] = []
        for i in np.flatnonzero(firing):
            eid = frame.ids[i]
            k = (rule, view.source, eid)
            if k not in self.alerts.open:
                kind, entity, summary, evidence = make(i, eid)
                out += self.alerts.fire(k, kind, entity, view.time_ns, summary, evidence)
        if self.alerts.open:
            for i in np.flatnonzero(clear):
                out += self.alerts.clear((rule, view.source, frame.ids[i]), view.time_ns)
        return out

    def _increase(self, view, frame: EntityFrame, counter: str, kind: str, entity, what: str) -> list[Finding]:
        if frame.column(counter) is None:
            return []
        delta = frame.delta(counter)
        t = view.time_ns
        out: list[Finding] = []
        for i in np.flatnonzero(delta > 0):           # NaN (first sample, reset) is not > 0
            k = (kind, view.source, frame.ids[i])
            self._last_increase[k] = t
            out += self.alerts.fire(k, kind, entity(view, frame.ids[i]), t, f"{view.source} {frame.ids[i]} {what}",
                                    [Evidence(counter, float(delta[i]), 0.0, "events")])
        window = self.config.increase_window_s * 1e9
        for k in [k for k in self._last_increase if k[0] == kind and k[1] == view.source]:
            if t - self._last_increase[k] > window:
                del self._last_increase[k]
                out += self.alerts.clear(k, t)
        return out

    def _dead(self, view, frame: EntityFrame, dead: np.ndarray, read: np.ndarray, entity) -> list[Finding]:
        """``link_down`` where ``dead`` held on every reading for ``dead_for_s``; cleared by a live reading."""
        t, out = view.time_ns, []
        for i in np.flatnonzero(dead):
            k = ("dead", view.source, frame.ids[i])
            since = self._pending.setdefault(k, t)
            if t - since >= self.config.dead_for_s * 1e9 and k not in self.alerts.open:
                out += self.alerts.fire(k, LINK_DOWN, entity(view, frame.ids[i]), t,
                                        f"{view.source} {frame.ids[i]} link down for 1m", onset_ns=since)
        if self._pending:
            for i in np.flatnonzero(read & ~dead):
                k = ("dead", view.source, frame.ids[i])
                if self._pending.pop(k, None) is not None:
                    out += self.alerts.clear(k, t)
        return out

    def _pcie(self, view, frame: EntityFrame, entity) -> list[Finding]:
        width, width_max = frame.gauge("pcie_width_current"), frame.gauge("pcie_width_max")
        narrow = width < width_max                     # NaN compares False
        return self._states(view, frame, "pcie", narrow, ~narrow & (width == width), lambda i, eid: (
            PCIE_DOWNGRADE, entity(view, eid), f"{view.source} {eid} PCIe x{width[i]:g} < x{width_max[i]:g}",
            [Evidence("pcie_width", float(width[i]), float(width_max[i]), "lanes")]))

    def _step(self, view, step) -> list[Finding]:
        cfg = self.config
        job = self._jobs.setdefault(step.job_id, _Job())
        out: list[Finding] = []
        end_ns = step.start_ns + int(step.step_seconds * 1e9)
        k = ("step", step.job_id, step.rank)
        if len(job.times) >= cfg.min_history_steps:
            if job.median is None:
                job.median = float(np.median(job.times))
            median = job.median
            if step.step_seconds > cfg.step_factor * median:
                entity = EntityRef(cluster=view.cluster, node=step.node, device=f"gpu{step.local_gpu}",
                                   rank=str(step.rank), job=step.job_id)
                out += self.alerts.fire(k, STRAGGLER, entity, end_ns,
                                        f"{step.job_id} rank {step.rank} step {step.step_seconds:.2f} s > "
                                        f"{cfg.step_factor:g} x job median {median:.2f} s",
                                        [Evidence("step_seconds", step.step_seconds, cfg.step_factor * median, "s")])
            else:
                out += self.alerts.clear(k, end_ns)
        if step.step not in job.seen:
            job.seen.add(step.step)
            job.times.append(step.step_seconds)
            job.median = None
            if len(job.times) > cfg.step_median_steps:
                job.times.popleft()
            if len(job.seen) > 4 * cfg.step_median_steps:
                job.seen = set(sorted(job.seen)[-cfg.step_median_steps:])
        return out


# --------------------------------------------------------------------------- (b) river HST

_HST_FEATURES = {
    NIC_PORT: ("tx_pause_duty", "rx_pause_duty", "tx_util", "rx_util"),
    SWITCH_PORT: ("rx_pause_duty", "in_util", "out_util"),
    "rank": ("busy_s", "wait_s", "step_s"),
}
_HST_CLASS = {
    "tx_pause_duty": PFC_STORM, "rx_pause_duty": PFC_STORM,
    "tx_util": LINK_DOWNGRADE, "rx_util": LINK_DOWNGRADE, "in_util": LINK_DOWNGRADE,
    "out_util": LINK_DOWNGRADE,
    "busy_s": STRAGGLER, "wait_s": STRAGGLER, "step_s": STRAGGLER,
}


class _Model:
    """MinMaxScaler | HalfSpaceTrees, plus running mean/std of the raw features (to name the culprit)."""

    def __init__(self, features: tuple[str, ...], seed: int) -> None:
        from river import anomaly, preprocessing

        self.features = features
        hst = anomaly.HalfSpaceTrees(seed=seed)      # river's defaults; the seed only fixes the trees
        self.window = hst.window_size
        self.pipe = preprocessing.MinMaxScaler() | hst
        self.n = 0
        self.mean = [0.0] * len(features)
        self.m2 = [0.0] * len(features)

    def score_learn(self, x: list[float]) -> tuple[float | None, str]:
        d = dict(zip(self.features, x))
        score = self.pipe.score_one(d) if self.n >= self.window else None
        n1 = max(self.n - 1, 1)
        best, culprit = -1.0, self.features[0]
        for j, v in enumerate(x):
            z = abs(v - self.mean[j]) / (math.sqrt(self.m2[j] / n1) + 1e-9)
            if z > best:
                best, culprit = z, self.features[j]
        self.pipe.learn_one(d)
        self.n += 1
        for j, v in enumerate(x):
            delta = v - self.mean[j]
            self.mean[j] += delta / self.n
            self.m2[j] += delta * (v - self.mean[j])
        return score, culprit


class HstBaseline:
    """river ``MinMaxScaler | HalfSpaceTrees`` with defaults (see the module docstring)."""

    def __init__(self, topology: Topology | None = None, threshold: float = HST_THRESHOLD, resolve_after: int = 10,
                 seed: int = 0, default_nic_rate: str = DEFAULT_NIC_RATE) -> None:
        from fabricwatch.models.linkrate import parse_ib_rate

        self.topology = topology
        self.threshold = threshold
        self.resolve_after = resolve_after
        self.seed = seed
        self._default_gbps = parse_ib_rate(default_nic_rate).gbps
        self._models: dict[tuple, _Model] = {}
        self._quiet: dict[tuple, int] = {}
        self.alerts = _Alerts(HST)
        self._nic_gbps: dict[tuple[str, str], float] = {}
        self.score_hist = np.zeros(SCORE_BINS, dtype=np.int64)   # every score, for the report's calibration note

    def _model(self, key: tuple, features: tuple[str, ...]) -> _Model:
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = _Model(features, self.seed + len(self._models))
        return m

    def _score(self, model_key, features, ent_key, x: list[float], entity, t_ns: int, label: str) -> list[Finding]:
        if not all(math.isfinite(v) for v in x):
            return []
        model = self._model(model_key, features)
        score, culprit = model.score_learn(x)
        if score is None:
            return []
        self.score_hist[min(int(score * SCORE_BINS), SCORE_BINS - 1)] += 1
        if score >= self.threshold:
            self._quiet[ent_key] = 0
            if ent_key in self.alerts.open:
                return []
            if callable(entity):
                entity = entity()
            return self.alerts.fire(ent_key, _HST_CLASS[culprit], entity, t_ns,
                                    f"HST score {score:.2f} on {label} (most deviant: {culprit})",
                                    [Evidence("hst_score", score, self.threshold, "score", culprit)])
        if ent_key in self.alerts.open:
            q = self._quiet.get(ent_key, 0) + 1
            self._quiet[ent_key] = q
            if q >= self.resolve_after:
                return self.alerts.clear(ent_key, t_ns)
        return []

    def _nic_nominal(self, node: str, eid: str) -> float:
        k = (node, eid)
        v = self._nic_gbps.get(k)
        if v is None:
            nic = self.topology.nic(node, eid) if self.topology is not None else None
            v = self._nic_gbps[k] = nic.nominal_gbps if nic is not None and nic.nominal_gbps else self._default_gbps
        return v

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        t = view.time_ns
        src = view.source
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                line = np.array([self._nic_nominal(src, eid) for eid in frame.ids]) * 1e9 / 8
                x = np.column_stack([frame.rate("tx_prio3_pause_duration"), frame.rate("rx_prio3_pause_duration"),
                                     frame.rate("port_xmit_data") / line, frame.rate("port_rcv_data") / line])
                model = (view.cluster, NIC_PORT)
                for eid, row in zip(frame.ids, x.tolist()):
                    out += self._score(model, _HST_FEATURES[NIC_PORT], ("nic", src, eid), row,
                                       lambda eid=eid: _nic_entity(view, eid), t, f"{src} {eid}")
            elif frame.kind == SWITCH_PORT:
                speed = frame.gauge("port_speed_gbps")
                line = np.where(speed > 0, speed, 400.0) * 1e9 / 8
                x = np.column_stack([frame.rate("pfc3-rx-pause-duration-us"), frame.rate("in-octets") / line,
                                     frame.rate("out-octets") / line])
                model = (view.cluster, SWITCH_PORT)
                for eid, row in zip(frame.ids, x.tolist()):
                    out += self._score(model, _HST_FEATURES[SWITCH_PORT], ("port", src, eid), row,
                                       lambda eid=eid: _port_entity(view, eid), t, f"{src} {eid}")
        for s in view.rank_steps:
            x = [s.busy_seconds, s.collective_wait_seconds, s.step_seconds]
            entity = EntityRef(cluster=view.cluster, node=s.node, device=f"gpu{s.local_gpu}", rank=str(s.rank),
                               job=s.job_id)
            out += self._score((view.cluster, "rank", s.job_id), _HST_FEATURES["rank"], ("rank", s.job_id, s.rank),
                               x, entity, s.start_ns + int(s.step_seconds * 1e9), f"{s.job_id} rank {s.rank}")
        return out
