"""What a detector reports: a `Finding`, opened or resolved, with its evidence.

Detectors never act and never see Kafka; the stream layer turns findings into
`AnomalyEvent` messages and the lifecycle tracker keeps them consistent.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .vocabulary import CRITICAL, INFO, OPEN, RESOLVED, UPDATE, WARNING

__all__ = ["CRITICAL", "INFO", "OPEN", "RESOLVED", "UPDATE", "WARNING", "EntityRef", "Evidence", "Finding"]

JOB_KEY, RANK_KEY = "job=", "rank="


@dataclass(frozen=True)
class EntityRef:
    """What an anomaly or an action is about: a node, NIC port, GPU, switch (port, queue), a job or a rank.

    Its one spelling is `path` (``cluster/host/device/port`` or ``cluster/job=<id>/rank=<r>``;
    a rank's node and GPU, when known, are not part of it); `local_path` leaves out the
    cluster (a dashboard shows one cluster, the simulator's ground truth has none) and
    `parse` reads either back. A switch and a node are both a "host" in the spelling, so
    `parse` is told which names are switches.

    >>> gpu = EntityRef(cluster="c1", node="node-1", device="gpu2")
    >>> gpu.path(), gpu.local_path()
    ('c1/node-1/gpu2', 'node-1/gpu2')
    >>> rank = EntityRef(cluster="c1", node="node-1", device="gpu2", job="j", rank="3")
    >>> rank.path(), rank.located().local_path()
    ('c1/job=j/rank=3', 'node-1/gpu2')
    >>> EntityRef.parse("leaf-0/Ethernet8", is_switch=lambda name: name.startswith("leaf"))
    EntityRef(cluster='', switch='leaf-0', node='', device='', port='Ethernet8', rank='', job='')
    >>> EntityRef.parse("c1/job=j/rank=3", with_cluster=True) == EntityRef(cluster="c1", job="j", rank="3")
    True
    """

    cluster: str = ""
    switch: str = ""
    node: str = ""
    device: str = ""
    port: str = ""
    rank: str = ""
    job: str = ""

    def path(self) -> str:
        """Stable, readable path: cluster/switch-or-node/device/port, or cluster/job=<id>/rank=<r>.
        It is part of every dedup key (a wire value): its spelling never changes."""
        return "/".join(p for p in (self.cluster, self.local_path()) if p)

    def local_path(self) -> str:
        """`path` without the cluster."""
        if self.job:
            parts = [f"{JOB_KEY}{self.job}", f"{RANK_KEY}{self.rank}" if self.rank else ""]
        else:
            parts = [self.switch or self.node, self.device, self.port]
        return "/".join(p for p in parts if p)

    def located(self) -> EntityRef:
        """Where the entity sits in the hardware: a rank's GPU (or node) when known, else itself."""
        if self.job and (self.node or self.switch):
            return replace(self, job="", rank="")
        return self

    @classmethod
    def parse(cls, path: str, *, with_cluster: bool = False,
              is_switch: Callable[[str], bool] = lambda name: False) -> EntityRef:
        """The `EntityRef` a `local_path` (or, ``with_cluster``, a `path`) spells.

        A host's two-part path is a GPU or NIC (``node/device``) or a switch port
        (``switch/port``); three parts are ``host/device/port``.

        :raises ValueError: an empty path, or a job/rank path spelt otherwise.
        """
        parts = path.split("/")
        cluster = parts.pop(0) if with_cluster and len(parts) > 1 else ""
        if not all(parts):
            raise ValueError(f"not an entity path: {path!r}")
        if parts[0].startswith(JOB_KEY):
            if len(parts) > 2 or (len(parts) == 2 and not parts[1].startswith(RANK_KEY)):
                raise ValueError(f"not a job or rank path: {path!r}")
            rank = parts[1].removeprefix(RANK_KEY) if len(parts) == 2 else ""
            return cls(cluster=cluster, job=parts[0].removeprefix(JOB_KEY), rank=rank)
        if len(parts) > 3:
            raise ValueError(f"not an entity path: {path!r}")
        host, rest = parts[0], parts[1:]
        if is_switch(host):
            device, port = (rest[0], rest[1]) if len(rest) == 2 else ("", rest[0] if rest else "")
            return cls(cluster=cluster, switch=host, device=device, port=port)
        return cls(cluster=cluster, node=host, device=rest[0] if rest else "", port=rest[1] if len(rest) == 2 else "")


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
