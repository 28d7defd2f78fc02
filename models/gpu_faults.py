"""GPU faults seen in the telemetry stream: XID events and uncorrectable ECC errors.

What an XID means comes from NVIDIA's Xid catalog (`fabricwatch.xid`):

* **Hardware and firmware XIDs** (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, ...; an unknown
  code too, conservatively) are GPU faults. The first on a GPU opens `gpu_xid` (one anomaly
  per GPU, the codes in its evidence), each repeat updates it with the running count (a
  repeated XID is a new event, not a stuck gauge), and it resolves after `quiet_s` without
  a repeat. Severity and action are the catalog's.
* **Application XIDs** (13, 31, 43, 68, ...) open nothing: a user bug is job-level
  information. They are counted (`stats["xid_application"]`) and kept for
  `APP_EVIDENCE_S` per GPU, so that a later finding on that GPU cites them
  (`recent_application_xids`).
* **XID 45** (preemptive cleanup) within `CASCADE_WINDOW_S` of a GPU fault on the same node,
  before or after it, is that fault's consequence: it is attached to the root's anomaly
  (an UPDATE, or the OPEN itself when the 45 came first) with the consequent GPUs as
  evidence and related entities, never a new OPEN (`stats["xid_consequence"]`). A 45 with
  no fault near it is application-level (the driver stopping a job that was killed).

An increase of `ecc_uncorrected_volatile_total` opens `gpu_ecc_uncorrectable` the same way;
a reset of that counter (reboot) gives no rate and no event.

>>> from fabricwatch.models.frames import DeviceEvent, SourceView
>>> det = GpuFaultDetector()
>>> def tick(t_s, *events):
...     return det.update(SourceView("c1", "node-1", "node", int(t_s * 1e9), 1,
...                                  events=[DeviceEvent(g, "xid", code, int(t * 1e9)) for g, code, t in events]))
>>> [(f.kind, f.state, f.severity, f.entity.path()) for f in tick(1, ("gpu2", 79, 0.9))]
[('gpu_xid', 'open', 'critical', 'c1/node-1/gpu2')]
>>> [(f.state, f.entity.device, f.evidence[1].detail) for f in tick(2, ("gpu0", 45, 1.2), ("gpu5", 45, 1.4))]
[('update', 'gpu2', 'gpu0 XID 45, gpu5 XID 45')]
>>> tick(3, ("gpu6", 13, 2.5)), det.stats["xid_application"], det.stats["xid_consequence"]
([], 1, 2)
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.xid import PREEMPTIVE_CLEANUP, XidInfo, lookup

from .detector import Detector, PerTick
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import GPU, DeviceEvent, LayoutGroup, SourceBatch, SourceView
from .vocabulary import GPU_ECC_UNCORRECTABLE, GPU_XID

DETECTOR = "gpu_faults/v2"
QUIET_S = 600.0
# An XID 45 this close (event time, either side) to a GPU fault on the same node is that
# fault's cleanup. NVIDIA's driver logs 45 for every channel it removes while recovering
# from the root error (RcRootCause.preemptiveRemovalPreviousXid in open-gpu-kernel-modules;
# the catalog: "not solo: follow the other Xid"): within milliseconds to a few seconds. 10 s
# adds the NVML event thread's wait (1 s) and one snapshot of delivery, and stays short
# enough that a later, unrelated job kill on the node is not swallowed.
CASCADE_WINDOW_S = 10.0
# A cleanup with no fault yet waits this long (event time of the node's ticks) for a root
# logged up to the window after it and delivered one snapshot later; then it is solo.
PENDING_S = 2 * CASCADE_WINDOW_S
# Application XIDs on a GPU stay citable this long, as recent as node health counts an
# XID as a straggler's cause (models.node_health.EVENT_LOOKBACK_S).
APP_EVIDENCE_S = 300.0
APP_EVIDENCE_MAX = 16            # per GPU: a buggy job logs bursts; the newest are enough
MAX_TRACKED_GPUS = 200_000       # GPUs with recent application XIDs (100k-GPU cluster x2)


@dataclass
class _Open:
    finding: Finding
    count: float
    last_ns: int
    codes: dict[str, int] = field(default_factory=dict)
    consequent: dict[str, int] = field(default_factory=dict)     # device -> XID 45s attached


@dataclass
class _Root:
    key: str           # the open anomaly it belongs to
    device: str
    time_ns: int


@dataclass
class GpuFaultDetector(PerTick, Detector):
    quiet_s: float = QUIET_S
    cascade_window_s: float = CASCADE_WINDOW_S
    _open: dict[str, _Open] = field(default_factory=dict, repr=False)
    _roots: dict[str, list[_Root]] = field(default_factory=dict, repr=False)          # node -> recent faults
    _pending: dict[str, list[DeviceEvent]] = field(default_factory=dict, repr=False)  # node -> unattributed 45s
    _app: dict[str, deque] = field(default_factory=dict, repr=False)                  # GPU path -> (ns, code)
    stats: Counter = field(default_factory=Counter, repr=False)

    def __post_init__(self) -> None:
        if self.quiet_s <= 0 or self.cascade_window_s <= 0:
            raise ValueError("quiet_s and cascade_window_s must be > 0")

    READS_EVENTS = True

    def reads(self, kind, counter_names, gauge_names, label_names) -> bool:
        return kind == GPU and "ecc_uncorrected_volatile_total" in counter_names

    def screen(self, group: LayoutGroup) -> None:
        """Per GPU stack of a layout group: any new uncorrectable ECC error?"""
        kind, _, counter_names, _ = group.key
        if kind != GPU or "ecc_uncorrected_volatile_total" not in counter_names or group.rates is None:
            return
        j = counter_names.index("ecc_uncorrected_volatile_total")
        new = group.segment_any((group.rates[:, :, j] > 0).any(axis=1))
        for i, stack in enumerate(group.stacks):
            stack.screens["ecc"] = bool(new[i])

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        """Tick by tick only when a record has an event or a new ECC error; else only the sweep."""
        if not batch.events:
            quiet = True
            for stack in batch.stacks:
                j = stack.column("ecc_uncorrected_volatile_total") if stack.kind == GPU else None
                if j is None or stack.rates is None:
                    continue
                screened = stack.screens.get("ecc")
                if screened or (screened is None and (stack.rates[:, :, j] > 0).any()):
                    quiet = False
                    break
            if quiet:
                if not (self._open or self._pending):
                    return []
                return self._sweep(SourceView(batch.cluster, batch.source, batch.source_kind,
                                              int(batch.times_ns[-1]), 0))
        return super().update_batch(batch)

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        xids = [e for e in view.events if e.kind == "xid"]
        # GPU faults first, then the rest, each in event-time order: a cleanup listed before
        # its root in one tick is attributed exactly as one listed after it.
        infos = sorted(((lookup(e.code), e) for e in xids),
                       key=lambda p: (not p[0].is_gpu_fault, p[1].code == PREEMPTIVE_CLEANUP, p[1].time_ns))
        cleanups: dict[str, list[DeviceEvent]] = {}    # root anomaly -> this tick's XID 45s
        for info, event in infos:
            if info.is_gpu_fault:
                out.append(self._fault_xid(view, event, info))
            elif event.code != PREEMPTIVE_CLEANUP:
                self._application(view, event)
            elif (root := self._root_of(view.source, event)) is not None:
                cleanups.setdefault(root.key, []).append(event)
            else:
                self._pending.setdefault(view.source, []).append(event)
        for key, events in cleanups.items():
            out.append(self._attach(self._open[key], events, view.time_ns))
        for frame in view.frames:
            if frame.kind != GPU:
                continue
            new_errors = frame.delta("ecc_uncorrected_volatile_total")
            for i in np.flatnonzero(new_errors > 0):  # NaN (reset, first sample) is not > 0
                entity = EntityRef(cluster=view.cluster, node=view.source, device=frame.ids[i])
                out.append(self._occurrence(
                    GPU_ECC_UNCORRECTABLE, entity, "", float(new_errors[i]), view.time_ns, CRITICAL,
                    f"{view.source} {frame.ids[i]} uncorrectable ECC errors",
                    "drain the node after the job; reset the GPU to remap rows"))
        out.extend(self._sweep(view))
        return out

    # -- the three kinds of XID --------------------------------------------------------------
    def _fault_xid(self, view: SourceView, event: DeviceEvent, info: XidInfo) -> Finding:
        self.stats["xid_gpu_fault"] += 1
        entity = EntityRef(cluster=view.cluster, node=view.source, device=event.entity_id)
        severity = CRITICAL if info.severity == CRITICAL else WARNING
        summary = f"{view.source} {event.entity_id} XID {event.code} ({info.text}" + (
            f"; {event.detail})" if event.detail else ")")
        finding = self._occurrence(GPU_XID, entity, f"xid={event.code}", 1.0, view.time_ns, severity,
                                   summary, f"{info.action} (NVIDIA: {info.immediate_action})")
        key = finding.dedup_key
        self._roots.setdefault(view.source, []).append(_Root(key, event.entity_id, event.time_ns))
        waiting = self._pending.get(view.source, [])
        mine = [e for e in waiting if abs(e.time_ns - event.time_ns) <= self.cascade_window_s * 1e9]
        if mine:   # cleanups that came before their root
            self._pending[view.source] = [e for e in waiting if e not in mine]
            return self._attach(self._open[key], mine, view.time_ns, finding.state)
        return finding

    def _application(self, view: SourceView, event: DeviceEvent) -> None:
        self.stats["xid_application"] += 1
        path = EntityRef(cluster=view.cluster, node=view.source, device=event.entity_id).path()
        recent = self._app.get(path)
        if recent is None:
            if len(self._app) >= MAX_TRACKED_GPUS:
                self._forget_app(view.time_ns)
            recent = self._app[path] = deque(maxlen=APP_EVIDENCE_MAX)
        recent.append((event.time_ns, event.code))

    # -- helpers ------------------------------------------------------------------------------
    def _root_of(self, node: str, event: DeviceEvent) -> _Root | None:
        """The open GPU fault on ``node`` nearest in time to this cleanup, within the window."""
        best = None
        for r in self._roots.get(node, ()):
            gap = abs(event.time_ns - r.time_ns)
            if gap <= self.cascade_window_s * 1e9 and r.key in self._open and (best is None or gap < best[0]):
                best = (gap, r)
        return best[1] if best else None

    def _attach(self, item: _Open, cleanups: list[DeviceEvent], t_ns: int, state: str = UPDATE) -> Finding:
        """The root's anomaly with these XID 45s as its consequences (an UPDATE, or its OPEN)."""
        self.stats["xid_consequence"] += len(cleanups)
        for e in cleanups:
            item.consequent[e.entity_id] = item.consequent.get(e.entity_id, 0) + 1
        f = self._report(item, state, t_ns, item.finding.probable_cause, item.finding.suggested_action)
        f.summary += f"; XID 45 (preemptive cleanup) on {len(item.consequent)} GPU(s) of the node: its consequence"
        return f

    def recent_application_xids(self, entity: EntityRef, now_ns: int) -> list[tuple[int, int]]:
        """(event time, code) of the application XIDs on this GPU within `APP_EVIDENCE_S`."""
        recent = self._app.get(entity.path())
        if not recent:
            return []
        return [(t, c) for t, c in recent if now_ns - t <= APP_EVIDENCE_S * 1e9]

    def _occurrence(self, kind, entity, code, n, t_ns, severity, summary, action) -> Finding:
        key = f"{kind}:{entity.path()}"  # one anomaly per GPU and kind; codes in the evidence
        item = self._open.get(key)
        state = UPDATE if item else OPEN
        if item is None:
            item = self._open[key] = _Open(Finding(kind, OPEN, entity, severity, t_ns, t_ns, detector=DETECTOR), 0, t_ns)
        item.count += n
        item.last_ns = t_ns
        if code:
            item.codes[code] = item.codes.get(code, 0) + 1
        if severity == CRITICAL:
            item.finding.severity = CRITICAL
        item.finding.probable_cause, item.finding.suggested_action = summary, action
        return self._report(item, state, t_ns, summary, action)

    def _report(self, item: _Open, state: str, t_ns: int, summary: str, action: str) -> Finding:
        f = item.finding
        evidence = [Evidence("occurrences", item.count, 0, "events", ", ".join(f"{c} x{k}" for c, k in item.codes.items()))]
        related = []
        if item.consequent:
            evidence.append(Evidence("consequent_gpus", float(len(item.consequent)), 0, "gpus",
                                     ", ".join(f"{d} XID 45" + (f" x{k}" if k > 1 else "")
                                               for d, k in sorted(item.consequent.items()))))
            related = [EntityRef(cluster=f.entity.cluster, node=f.entity.node, device=d) for d in sorted(item.consequent)]
        app = self.recent_application_xids(f.entity, t_ns)
        if app:
            codes = Counter(c for _, c in app)
            evidence.append(Evidence("recent_application_xids", float(len(app)), 0, "events",
                                     ", ".join(f"XID {c} x{k}" for c, k in sorted(codes.items()))
                                     + f" within {APP_EVIDENCE_S:g} s (job-level)"))
        return Finding(f.kind, state, f.entity, f.severity, f.onset_ns, t_ns, evidence,
                       probable_cause=summary, suggested_action=action,
                       summary=f"{summary}: {item.count:g} occurrence(s) since onset", detector=DETECTOR,
                       related=related)

    def _sweep(self, view: SourceView) -> list[Finding]:
        """This node's quiet anomalies resolve; its old roots and solo cleanups are let go."""
        node, now = view.source, view.time_ns
        if node in self._roots:
            keep = [r for r in self._roots[node] if now - r.time_ns <= PENDING_S * 1e9 and r.key in self._open]
            if keep:
                self._roots[node] = keep
            else:
                del self._roots[node]
        if node in self._pending:
            solo = [e for e in self._pending[node] if now - e.time_ns > PENDING_S * 1e9]
            for e in solo:   # no fault near it: the driver stopped a job; application-level
                self._application(view, e)
            left = [e for e in self._pending[node] if e not in solo]
            if left:
                self._pending[node] = left
            else:
                del self._pending[node]
        return self._resolve_quiet(view)

    def _forget_app(self, now_ns: int) -> None:
        for path in [p for p, d in self._app.items() if not d or now_ns - d[-1][0] > APP_EVIDENCE_S * 1e9]:
            del self._app[path]
        while len(self._app) >= MAX_TRACKED_GPUS:
            del self._app[next(iter(self._app))]

    def _resolve_quiet(self, view: SourceView) -> list[Finding]:
        out = []
        for key, item in list(self._open.items()):
            f = item.finding
            if f.entity.node == view.source and view.time_ns - item.last_ns > self.quiet_s * 1e9:
                del self._open[key]
                out.append(Finding(f.kind, RESOLVED, f.entity, f.severity, f.onset_ns, view.time_ns,
                                   summary=f"resolved: no {f.kind} for {self.quiet_s:g} s", detector=DETECTOR))
        return out
