"""Which anomalies (and decisions about them) a reader wants: one filter core for every layer.

The response policy's rule match (`actions.policy.Match`), the event feed's subscription
(`streams.feed.Subscription`) and the dashboard's feed filter (`dashboard.views.FeedFilter`)
all ask the same questions of an event, answered here once: its kind, its severity, its
cause code, its cluster, the job or switch it touches, what it costs. Each layer turns its
record (protobuf, dashboard dict) into `EventFacts` and keeps only what is its own: the
policy's scope, the feed token's source globs, the dashboard's switch peers.

>>> facts = EventFacts(kind="pfc_storm", severity="critical", entities=(EntityRef(cluster="c", switch="leaf-0"),))
>>> EventFilter(kinds=frozenset({"pfc_storm"}), min_severity="warning").admits(facts)
True
>>> EventFilter(min_severity="critical", switch="leaf-1").admits(facts)
False
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .findings import EntityRef
from .vocabulary import severity_at_least


@dataclass(frozen=True)
class EventFacts:
    """What a filter reads of one anomaly or decision. ``entities[0]`` is the entity (a
    decision's target), the rest are related entities. ``severity`` "" is not known (a
    decision whose anomaly is gone): no severity bound excludes it."""

    kind: str
    severity: str = ""
    cause: str = ""
    entities: tuple[EntityRef, ...] = ()
    impact_gpu_hours: float | None = None            # None: not assessed here (a decision)
    impact_gpu_hours_per_hour: float | None = None


@dataclass(frozen=True)
class EventFilter:
    """Empty fields admit everything. What the caller knows of the cluster widens `admits`:
    ``job_nodes``, the nodes running ``job`` (an entity on one touches the job);
    ``peer_switches``, the switches facing the entities (a NIC's leaf)."""

    kinds: frozenset[str] = frozenset()
    min_severity: str = ""
    causes: frozenset[str] = frozenset()
    clusters: frozenset[str] = frozenset()       # of the entity itself
    job: str = ""                                # of the entity or a related one
    switch: str = ""                             # of the entity or a related one
    min_impact_gpu_hours: float = 0.0
    min_impact_gpu_hours_per_hour: float = 0.0

    def admits(self, facts: EventFacts, *, job_nodes: Collection[str] = (),
               peer_switches: Collection[str] = ()) -> bool:
        if self.kinds and facts.kind not in self.kinds:
            return False
        if self.min_severity and facts.severity and not severity_at_least(facts.severity, self.min_severity):
            return False
        if self.causes and facts.cause not in self.causes:
            return False
        if facts.impact_gpu_hours is not None and facts.impact_gpu_hours < self.min_impact_gpu_hours:
            return False
        if facts.impact_gpu_hours_per_hour is not None \
                and facts.impact_gpu_hours_per_hour < self.min_impact_gpu_hours_per_hour:
            return False
        if self.clusters and (not facts.entities or facts.entities[0].cluster not in self.clusters):
            return False
        if self.job and not any(e.job == self.job or (e.node and e.node in job_nodes) for e in facts.entities):
            return False
        return not self.switch or self.switch in peer_switches or any(e.switch == self.switch for e in facts.entities)
