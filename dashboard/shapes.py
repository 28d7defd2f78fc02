"""The JSON shapes of the dashboard's API: entity keys, anomalies and decisions as dicts.

`entity_path` is the key every structure of the dashboard files an entity under;
`anomaly_dict` and `decision_dict` turn the protobuf records into what the API and the
live feed send (NaN and infinities as null, long lists capped). Separate from the state
because both the state (its feed) and the views build these, and they are the API's
contract with the browser.
"""
from __future__ import annotations

from dataclasses import fields

from fabricwatch.models.findings import EntityRef
from fabricwatch.models.vocabulary import UNSPECIFIED
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams import events
from fabricwatch.streams.events import entity_ref

# The API names a record's enum zero too ("unspecified"), where the stream layer refuses it.
SEVERITY_NAME = {ev.SEVERITY_UNSPECIFIED: UNSPECIFIED, **events.SEVERITY_NAME}
LIFECYCLE_NAME = {ev.LIFECYCLE_UNSPECIFIED: UNSPECIFIED, **events.LIFECYCLE_NAME}
OUTCOME_NAME = {ev.OUTCOME_UNSPECIFIED: UNSPECIFIED, **events.OUTCOME_NAME}

MAX_RELATED_SHOWN = 64             # related entities of one anomaly (a storm's victims)
MAX_EVIDENCE_SHOWN = 32


# ------------------------------------------------------------------------ paths
def entity_path(p: ev.EntityPath) -> str:
    """The dashboard's key of an entity: the `EntityRef.local_path` of where it sits ("node/device/port",
    "switch/port"; a rank on its GPU), or of a rank or job that names no hardware ("job=<id>/rank=<r>").

    The cluster is left out: one dashboard shows one cluster (`FabricState(cluster=...)`).

    >>> entity_path(ev.EntityPath(cluster="c", node="n1", device="mlx5_0", port="1"))
    'n1/mlx5_0/1'
    >>> entity_path(ev.EntityPath(switch="leaf-0", port="Ethernet8")), entity_path(ev.EntityPath(job="j", rank="3"))
    ('leaf-0/Ethernet8', 'job=j/rank=3')
    """
    return entity_ref(p).located().local_path()


def rank_path(job: str, rank: int | str) -> str:
    return EntityRef(job=job, rank=str(rank)).local_path()


_REF_FIELDS = tuple(f.name for f in fields(EntityRef))


def ref_of(d: dict) -> EntityRef:
    """The `EntityRef` of an entity dict of the API (`anomaly_dict`'s ``entity``, ``related``, ``target``)."""
    return EntityRef(**{name: d[name] for name in _REF_FIELDS})


def finite_or_none(x: float) -> float | None:
    """A number JSON can carry: NaN and infinities become None (null)."""
    return float(x) if x == x and x not in (float("inf"), float("-inf")) else None


def _path_dict(p: ev.EntityPath) -> dict:
    return {"path": entity_path(p), "cluster": p.cluster, "switch": p.switch, "node": p.node,
            "device": p.device, "port": p.port, "rank": p.rank, "job": p.job}


def anomaly_dict(e: ev.AnomalyEvent) -> dict:
    return {
        "id": e.id, "dedup_key": e.dedup_key, "kind": e.kind,
        "severity": SEVERITY_NAME.get(e.severity, UNSPECIFIED),
        "lifecycle": LIFECYCLE_NAME.get(e.lifecycle, UNSPECIFIED),
        "entity": _path_dict(e.entity), "related": [_path_dict(r) for r in e.related[:MAX_RELATED_SHOWN]],
        "related_total": len(e.related),
        "onset_unix_ms": e.onset_unix_ns // 1_000_000, "detected_unix_ms": e.detected_unix_ns // 1_000_000,
        "evidence": [{"name": x.name, "value": finite_or_none(x.value), "threshold": finite_or_none(x.threshold),
                      "unit": x.unit, "detail": x.detail} for x in e.evidence[:MAX_EVIDENCE_SHOWN]],
        "confidence": finite_or_none(e.confidence), "probable_cause": e.probable_cause,
        "cause_code": getattr(e, "cause_code", ""), "suggested_action": e.suggested_action,
        "summary": e.summary, "detector": e.detector,
        "impact_gpu_hours": finite_or_none(e.impact_gpu_hours),
        "impact_gpu_hours_per_hour": finite_or_none(e.impact_gpu_hours_per_hour),
        "impact_basis": e.impact_basis,
    }


def decision_dict(d: ev.ActionDecision) -> dict:
    outcome = OUTCOME_NAME.get(d.outcome, str(d.outcome))
    return {
        "idempotency_key": d.idempotency_key, "anomaly_id": d.anomaly_id, "anomaly_dedup_key": d.anomaly_dedup_key,
        "anomaly_kind": d.anomaly_kind, "rule": d.rule, "action": d.action, "target": _path_dict(d.target),
        "outcome": outcome, "reason": d.reason, "executor": d.executor,
        "decided_unix_ms": d.decided_unix_ns // 1_000_000, "detail": d.detail,
        # Shadow mode: the policy matched but execution is off; on-call sees "would have".
        "would_have": bool(d.shadow or d.outcome == ev.OUTCOME_SHADOW),
    }

