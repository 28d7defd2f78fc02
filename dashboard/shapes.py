"""The JSON shapes of the dashboard's API: entity keys, anomalies and decisions as dicts.

`entity_path` is the key every structure of the dashboard files an entity under;
`anomaly_dict` and `decision_dict` turn the protobuf records into what the API and the
live feed send (NaN and infinities as null, long lists capped). Separate from the state
because both the state (its feed) and the views build these, and they are the API's
contract with the browser.
"""
from __future__ import annotations

from fabricwatch.protos.v1 import events_pb2 as ev

SEVERITY_NAME = {ev.SEVERITY_UNSPECIFIED: "unspecified", ev.SEVERITY_INFO: "info",
                 ev.SEVERITY_WARNING: "warning", ev.SEVERITY_CRITICAL: "critical"}
LIFECYCLE_NAME = {ev.LIFECYCLE_UNSPECIFIED: "unspecified", ev.LIFECYCLE_OPEN: "open",
                  ev.LIFECYCLE_UPDATE: "update", ev.LIFECYCLE_RESOLVED: "resolved"}
OUTCOME_NAME = {v.number: v.name.removeprefix("OUTCOME_").lower() for v in ev.Outcome.DESCRIPTOR.values}

MAX_RELATED_SHOWN = 64             # related entities of one anomaly (a storm's victims)
MAX_EVIDENCE_SHOWN = 32


# ------------------------------------------------------------------------ paths
def entity_path(p: ev.EntityPath) -> str:
    """The dashboard's key of an entity: "node/device/port", "switch/port", or "job/<id>/rank/<r>".

    The cluster is left out: one dashboard shows one cluster (`FabricState(cluster=...)`).

    >>> entity_path(ev.EntityPath(cluster="c", node="n1", device="mlx5_0", port="1"))
    'n1/mlx5_0/1'
    >>> entity_path(ev.EntityPath(switch="leaf-0", port="Ethernet8")), entity_path(ev.EntityPath(job="j", rank="3"))
    ('leaf-0/Ethernet8', 'job/j/rank/3')
    """
    base = p.switch or p.node
    if base:
        return "/".join(x for x in (base, p.device, p.port) if x)
    if p.job:
        return f"job/{p.job}/rank/{p.rank}" if p.rank else f"job/{p.job}"
    return ""


def rank_path(job: str, rank: int | str) -> str:
    return f"job/{job}/rank/{rank}"


def finite_or_none(x: float) -> float | None:
    """A number JSON can carry: NaN and infinities become None (null)."""
    return float(x) if x == x and x not in (float("inf"), float("-inf")) else None


def _path_dict(p: ev.EntityPath) -> dict:
    return {"path": entity_path(p), "cluster": p.cluster, "switch": p.switch, "node": p.node,
            "device": p.device, "port": p.port, "rank": p.rank, "job": p.job}


def anomaly_dict(e: ev.AnomalyEvent) -> dict:
    return {
        "id": e.id, "dedup_key": e.dedup_key, "kind": e.kind,
        "severity": SEVERITY_NAME.get(e.severity, "unspecified"),
        "lifecycle": LIFECYCLE_NAME.get(e.lifecycle, "unspecified"),
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

