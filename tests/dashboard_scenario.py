"""A simulated fault scenario for the dashboard tests, as the Kafka records the real path writes.

The simulator (`fabricwatch.simulator`, the README demo's faults, with the PFC storm kept
on so it is still open when the browser looks) produces snapshots; the gateway's own
`split_records` turns them into telemetry and rank-steps records; the real detectors
(`DetectionPipeline`, as in replay) turn them into anomaly events. No policy engine
writes decisions yet, so two decisions are built here the way the actions layer
describes them: a shadow "would have drained" for the storm source and an alert sent
for the downgraded link.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from fabricwatch.models.topology import Topology
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.demo import demo_scenario
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.simulator.host_faults import Straggler
from fabricwatch.simulator.timeline import INF
from fabricwatch.streams import topics
from fabricwatch.streams.gateway import split_records
from fabricwatch.streams.pipeline import DetectionConfig, DetectionPipeline
from fabricwatch.streams.replay import replay


@dataclass
class Scenario:
    topology: Topology
    records: list[tuple[str, bytes, bytes]] = field(default_factory=list)   # (topic, key, value)
    events: list[ev.AnomalyEvent] = field(default_factory=list)
    decisions: list[ev.ActionDecision] = field(default_factory=list)

    def first(self, kind: str) -> ev.AnomalyEvent:
        return next(e for e in self.events if e.kind == kind and e.lifecycle == ev.LIFECYCLE_OPEN)


def fault_scenario(cluster: str, nodes: int = 16, seconds: int = 36, seed: int = 7,
                   end_unix_ns: int | None = None) -> Scenario:
    """`seconds` of a `nodes`-node cluster ending at `end_unix_ns` (default: now)."""
    topo, faults = demo_scenario(n_nodes=nodes, seed=seed)
    topo.cluster = cluster
    # The storm stays on (still open when the browser looks); the straggler starts early,
    # before the storm stalls the jobs behind its leaf (a small cluster has only one unit).
    faults = [dataclasses.replace(f, offset_s=INF) if isinstance(f, PfcStorm)
              else dataclasses.replace(f, onset_s=2.0) if isinstance(f, Straggler) else f for f in faults]
    end = end_unix_ns or time.time_ns()
    sim = ClusterSimulator(topo, seed=seed, start_unix_ns=end - seconds * 1_000_000_000, faults=faults,
                           interval_s=1.0)
    snapshots = [s for _ in range(seconds) for s in sim.tick()]
    scenario = Scenario(topo)
    result = replay([type(s).FromString(s.SerializeToString()) for s in snapshots],
                    DetectionPipeline(DetectionConfig(), topo))
    for snap in snapshots:
        scenario.records += split_records([snap], snap.time_unix_ns)
    scenario.events = result.events
    scenario.records += [(topics.ANOMALIES, e.dedup_key.encode(), e.SerializeToString()) for e in result.events]
    storm, down = scenario.first("pfc_storm"), scenario.first("link_downgrade")
    scenario.decisions = [
        ev.ActionDecision(idempotency_key=f"{storm.dedup_key}|drain", anomaly_id=storm.id,
                          anomaly_dedup_key=storm.dedup_key, anomaly_kind=storm.kind, rule="drain-storm-source",
                          action="drain_node", target=ev.EntityPath(cluster=cluster, node=storm.entity.node),
                          outcome=ev.OUTCOME_SHADOW, reason="policy mode shadow", executor="slurm",
                          decided_unix_ns=storm.detected_unix_ns + 50_000_000,
                          detail=f"scontrol update nodename={storm.entity.node} state=drain", shadow=True),
        ev.ActionDecision(idempotency_key=f"{down.dedup_key}|alert", anomaly_id=down.id,
                          anomaly_dedup_key=down.dedup_key, anomaly_kind=down.kind, rule="page-on-downgrade",
                          action="alert", target=down.entity, outcome=ev.OUTCOME_ALERTED, executor="alertmanager",
                          decided_unix_ns=down.detected_unix_ns + 50_000_000, detail="alert sent"),
    ]
    for d in scenario.decisions:   # every decision is audited; those that do (or would do) something are actions
        scenario.records.append((topics.AUDIT, d.anomaly_dedup_key.encode(), d.SerializeToString()))
        scenario.records.append((topics.ACTIONS, d.anomaly_dedup_key.encode(), d.SerializeToString()))
    return scenario
