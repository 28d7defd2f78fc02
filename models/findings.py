"""What a detector reports: a `Finding`, opened or resolved, with its evidence.

Detectors never act and never see Kafka; the stream layer turns findings into
`AnomalyEvent` messages and the lifecycle tracker keeps them consistent.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

OPEN, UPDATE, RESOLVED = "open", "update", "resolved"
INFO, WARNING, CRITICAL = "info", "warning", "critical"


@dataclass(frozen=True)
class EntityRef:
    cluster: str = ""
    switch: str = ""
    node: str = ""
    device: str = ""
    port: str = ""
    rank: str = ""
    job: str = ""

    def path(self) -> str:
        """Stable, readable path: cluster/switch-or-node/device/port, or cluster/job/rank."""
        parts = [self.cluster, self.switch or self.node, self.device, self.port]
        if self.job:
            parts = [self.cluster, f"job={self.job}", f"rank={self.rank}" if self.rank else ""]
        return "/".join(p for p in parts if p)


@dataclass(frozen=True)
class Evidence:
    name: str
    value: float
    threshold: float
    unit: str
    detail: str = ""


@dataclass
class Finding:
    kind: str                 # "link_downgrade", "pfc_storm", "straggler", ...
    state: str                # OPEN | UPDATE | RESOLVED
    entity: EntityRef
    severity: str = WARNING
    onset_ns: int = 0         # event time the condition began
    detected_ns: int = 0      # event time of the sample that confirmed (or cleared) it
    evidence: list[Evidence] = field(default_factory=list)
    confidence: float = 1.0
    probable_cause: str = ""
    cause: str = ""           # machine-readable cause code behind probable_cause ("thermal", ...)
    suggested_action: str = ""
    summary: str = ""
    detector: str = ""
    related: list[EntityRef] = field(default_factory=list)
    # What it costs (models/impact.py), as of detected_ns; set by the stream layer, not detectors.
    impact_gpu_hours: float = 0.0
    impact_gpu_hours_per_hour: float = 0.0
    impact_basis: str = ""    # "measured" | "estimated" | "" (not assessed)

    @property
    def dedup_key(self) -> str:
        return f"{self.kind}:{self.entity.path()}"

    @property
    def event_id(self) -> str:
        """The id of the event this finding goes out as: from the dedup key, lifecycle state and
        detection time, so a replay or a redelivery yields the same id (and another stage can
        name an anomaly by the id of its open event)."""
        digest = hashlib.sha256(f"{self.dedup_key}|{self.state}|{self.detected_ns}".encode()).hexdigest()
        return digest[:24]
