"""GPU faults seen in the telemetry stream: XID events and uncorrectable ECC errors.

Passed through as anomalies with their codes. Every XID occurrence counts: the first one
on a GPU opens `gpu_xid` (per GPU and code), each repeat updates it with the running
count (a repeated XID is a new event, not a stuck gauge), and it resolves after
`quiet_s` without a repeat. An increase of `ecc_uncorrected_volatile_total` does the same
for `gpu_ecc_uncorrectable`; a reset of that counter (reboot) gives no rate and no event.

>>> from fabricwatch.models.frames import DeviceEvent, SourceView
>>> det = GpuFaultDetector()
>>> view = SourceView("c1", "node-1", "node", 10**9, 1, events=[DeviceEvent("gpu2", "xid", 79, 10**9)])
>>> [(f.kind, f.state, f.severity, f.entity.path()) for f in det.update(view)]
[('gpu_xid', 'open', 'critical', 'c1/node-1/gpu2')]
>>> view = SourceView("c1", "node-1", "node", 2 * 10**9, 2, events=[DeviceEvent("gpu2", "xid", 79, 2 * 10**9)])
>>> [(f.state, f.evidence[0].value) for f in det.update(view)]
[('update', 2.0)]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import PerTick
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import GPU, LayoutGroup, SourceBatch, SourceView

DETECTOR = "gpu_faults/v1"
QUIET_S = 600.0
# XIDs that need the GPU drained or reset (NVIDIA Xid catalog): fallen off the bus,
# double-bit / uncontained ECC, GSP timeout, NVLink error, contained ECC.
CRITICAL_XIDS = frozenset({48, 74, 79, 94, 95, 119})
XID_ACTION = {
    79: "drain the node; the GPU fell off the bus (reset or reseat)",
    48: "drain the node; reset the GPU to remap the failing row",
    94: "restart the affected job; reset the GPU when idle",
    95: "drain the node and reset the GPU",
    119: "reset the GPU; update the driver/firmware if it repeats",
    74: "check NVLink/NVSwitch; drain the node if it repeats",
}


@dataclass
class _Open:
    finding: Finding
    count: float
    last_ns: int
    codes: dict[str, int] = field(default_factory=dict)


@dataclass
class GpuFaultDetector(PerTick):
    quiet_s: float = QUIET_S
    _open: dict[str, _Open] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.quiet_s <= 0:
            raise ValueError("quiet_s must be > 0")

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
        """Tick by tick only when a record has an event or a new ECC error; else only quiet resolutions."""
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
                if not self._open:
                    return []
                return self._resolve_quiet(SourceView(batch.cluster, batch.source, batch.source_kind,
                                                      int(batch.times_ns[-1]), 0))
        return super().update_batch(batch)

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        for event in view.events:
            if event.kind == "xid":
                entity = EntityRef(cluster=view.cluster, node=view.source, device=event.entity_id)
                out.append(self._occurrence(
                    "gpu_xid", entity, f"xid={event.code}", 1.0, view.time_ns,
                    CRITICAL if event.code in CRITICAL_XIDS else WARNING,
                    f"{view.source} {event.entity_id} XID {event.code}" + (f" ({event.detail})" if event.detail else ""),
                    XID_ACTION.get(event.code, "check the Xid catalog; drain the node if it repeats")))
        for frame in view.frames:
            if frame.kind != GPU:
                continue
            new_errors = frame.delta("ecc_uncorrected_volatile_total")
            for i in np.flatnonzero(new_errors > 0):  # NaN (reset, first sample) is not > 0
                entity = EntityRef(cluster=view.cluster, node=view.source, device=frame.ids[i])
                out.append(self._occurrence(
                    "gpu_ecc_uncorrectable", entity, "", float(new_errors[i]), view.time_ns, CRITICAL,
                    f"{view.source} {frame.ids[i]} uncorrectable ECC errors",
                    "drain the node after the job; reset the GPU to remap rows"))
        out.extend(self._resolve_quiet(view))
        return out

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
        detail = ", ".join(f"{c} x{k}" for c, k in item.codes.items())
        return Finding(kind, state, entity, item.finding.severity, item.finding.onset_ns, t_ns,
                       [Evidence("occurrences", item.count, 0, "events", detail)],
                       probable_cause=summary, suggested_action=action,
                       summary=f"{summary}: {item.count:g} occurrence(s) since onset", detector=DETECTOR)

    def _resolve_quiet(self, view: SourceView) -> list[Finding]:
        out = []
        for key, item in list(self._open.items()):
            f = item.finding
            if f.entity.node == view.source and view.time_ns - item.last_ns > self.quiet_s * 1e9:
                del self._open[key]
                out.append(Finding(f.kind, RESOLVED, f.entity, f.severity, f.onset_ns, view.time_ns,
                                   summary=f"resolved: no {f.kind} for {self.quiet_s:g} s", detector=DETECTOR))
        return out
