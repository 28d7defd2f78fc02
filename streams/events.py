"""`models.findings.Finding` -> protobuf `AnomalyEvent`, with deterministic ids.

Ids derive from the dedup key, lifecycle state and detection time, so replaying the same
telemetry yields the same events and a redelivered finding yields the same id.
"""
from __future__ import annotations

from fabricwatch.models.event_filter import EventFacts
from fabricwatch.models.findings import EntityRef, Finding
from fabricwatch.models.vocabulary import CRITICAL, INFO, OPEN, RESOLVED, UNSPECIFIED, UPDATE, WARNING
from fabricwatch.protos.v1 import events_pb2 as ev

# The vocabulary's severities, lifecycles and outcomes <-> their protobuf enums, in one place.
SEVERITY_PROTO = {INFO: ev.SEVERITY_INFO, WARNING: ev.SEVERITY_WARNING, CRITICAL: ev.SEVERITY_CRITICAL}
LIFECYCLE_PROTO = {OPEN: ev.LIFECYCLE_OPEN, UPDATE: ev.LIFECYCLE_UPDATE, RESOLVED: ev.LIFECYCLE_RESOLVED}
SEVERITY_NAME: dict[int, str] = {v: k for k, v in SEVERITY_PROTO.items()}
LIFECYCLE_NAME = {v: k for k, v in LIFECYCLE_PROTO.items()}
# "shadow", "refused_kill_switch": the enum names without their prefix, lower case (`vocabulary.OUTCOMES`).
OUTCOME_NAME = {v.number: v.name.removeprefix("OUTCOME_").lower() for v in ev.Outcome.DESCRIPTOR.values if v.number}


def severity_name(severity: int) -> str:
    """A protobuf severity's vocabulary name; "unspecified" for 0 and unknown numbers."""
    return SEVERITY_NAME.get(severity, UNSPECIFIED)


def entity_proto(ref: EntityRef) -> ev.EntityPath:
    """`EntityRef` -> protobuf `EntityPath` (field for field; `entity_ref` is its inverse)."""
    return ev.EntityPath(cluster=ref.cluster, switch=ref.switch, node=ref.node, device=ref.device,
                         port=ref.port, rank=ref.rank, job=ref.job)


def entity_ref(path: ev.EntityPath) -> EntityRef:
    return EntityRef(cluster=path.cluster, switch=path.switch, node=path.node, device=path.device,
                     port=path.port, rank=path.rank, job=path.job)


def anomaly_facts(event: ev.AnomalyEvent, unknown_severity: str = UNSPECIFIED) -> EventFacts:
    """What `models.event_filter.EventFilter` reads of an anomaly (its entity first)."""
    return EventFacts(kind=event.kind, severity=SEVERITY_NAME.get(event.severity, unknown_severity),
                      cause=event.cause_code, entities=(entity_ref(event.entity), *map(entity_ref, event.related)),
                      impact_gpu_hours=event.impact_gpu_hours,
                      impact_gpu_hours_per_hour=event.impact_gpu_hours_per_hour)


def decision_facts(decision: ev.ActionDecision, severity: str = "") -> EventFacts:
    """A decision as its anomaly's kind on its target; its severity is its anomaly's, when known."""
    return EventFacts(kind=decision.anomaly_kind, severity=severity, entities=(entity_ref(decision.target),))


def event_id(finding: Finding) -> str:
    return finding.event_id


def to_event(finding: Finding, emitted_ns: int) -> ev.AnomalyEvent:
    return ev.AnomalyEvent(
        id=event_id(finding),
        dedup_key=finding.dedup_key,
        kind=finding.kind,
        severity=SEVERITY_PROTO[finding.severity],
        lifecycle=LIFECYCLE_PROTO[finding.state],
        entity=entity_proto(finding.entity),
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
        related=[entity_proto(r) for r in finding.related],
        detector=finding.detector,
        impact_gpu_hours=finding.impact_gpu_hours,
        impact_gpu_hours_per_hour=finding.impact_gpu_hours_per_hour,
        impact_basis=finding.impact_basis,
    )
