"""`models.findings.Finding` -> protobuf `AnomalyEvent`, with deterministic ids.

Ids derive from the dedup key, lifecycle state and detection time, so replaying the same
telemetry yields the same events and a redelivered finding yields the same id.
"""
from __future__ import annotations

from fabricwatch.models.findings import CRITICAL, INFO, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Finding
from fabricwatch.protos.v1 import events_pb2 as ev

_SEVERITY = {INFO: ev.SEVERITY_INFO, WARNING: ev.SEVERITY_WARNING, CRITICAL: ev.SEVERITY_CRITICAL}
_LIFECYCLE = {OPEN: ev.LIFECYCLE_OPEN, UPDATE: ev.LIFECYCLE_UPDATE, RESOLVED: ev.LIFECYCLE_RESOLVED}
SEVERITY_NAME = {v: k for k, v in _SEVERITY.items()}
LIFECYCLE_NAME = {v: k for k, v in _LIFECYCLE.items()}


def _path(ref: EntityRef) -> ev.EntityPath:
    return ev.EntityPath(cluster=ref.cluster, switch=ref.switch, node=ref.node, device=ref.device,
                         port=ref.port, rank=ref.rank, job=ref.job)


def event_id(finding: Finding) -> str:
    return finding.event_id


def to_event(finding: Finding, emitted_ns: int) -> ev.AnomalyEvent:
    return ev.AnomalyEvent(
        id=event_id(finding),
        dedup_key=finding.dedup_key,
        kind=finding.kind,
        severity=_SEVERITY[finding.severity],
        lifecycle=_LIFECYCLE[finding.state],
        entity=_path(finding.entity),
        onset_unix_ns=finding.onset_ns,
        detected_unix_ns=finding.detected_ns,
        emitted_unix_ns=emitted_ns,
        evidence=[ev.Evidence(name=e.name, value=float(e.value), threshold=float(e.threshold), unit=e.unit,
                              detail=e.detail) for e in finding.evidence],
        confidence=finding.confidence,
        probable_cause=finding.probable_cause,
        cause_code=finding.cause,
        suggested_action=finding.suggested_action,
        summary=finding.summary,
        related=[_path(r) for r in finding.related],
        detector=finding.detector,
        impact_gpu_hours=finding.impact_gpu_hours,
        impact_gpu_hours_per_hour=finding.impact_gpu_hours_per_hour,
        impact_basis=finding.impact_basis,
    )
