"""The detection pipeline over decoded telemetry, in three stages.

1. per source (a node or switch, `observe`): rates, then the per-entity rules (downgrade,
   flap, GPU faults), the per-node learned baseline (unknown anomalies), the PFC watchdog (whose onsets and restorations feed stage 2) and
   the node-health book (read by stage 3 for probable causes);
2. per cluster (`locate`): the storm locator walks the topology from the watchdog's
   records to name each storm's source and its victims;
3. per job (`add_rank_steps`): the straggler detector compares the ranks of each job.

The worker runs each stage in the agent of the topic keyed for it (telemetry by source,
pause states by cluster, rank steps by job); `process` chains all three in one call for
replay and tests. Either way it is this object, so what is tested is what runs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fabricwatch.models.findings import Finding
from fabricwatch.models.gpu_faults import GpuFaultDetector
from fabricwatch.models.link_downgrade import LinkDowngradeDetector
from fabricwatch.models.link_flap import LinkFlapDetector
from fabricwatch.models.node_health import NodeHealthBook
from fabricwatch.models.pfc_storm import DEFAULT_DETECTION_TIME_MS, PauseStateChange, PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import StormLocator
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.models.topology import DEFAULT_NIC_RATE, Topology
from fabricwatch.models.unknown import UnknownAnomalyDetector
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .decode import to_view


@dataclass(frozen=True)
class DetectionConfig:
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = 20.0
    pfc_detection_time_ms: int = DEFAULT_DETECTION_TIME_MS
    pfc_restoration_time_ms: int | None = None   # default: 2 x detection, as SONiC's pfcwd


@dataclass
class SourceOutput:
    """What one snapshot produced in stage 1."""
    findings: list[Finding]
    pause_changes: list[PauseStateChange]


class DetectionPipeline:
    """Feed it snapshots of many sources in per-source event-time order; get findings."""

    def __init__(self, config: DetectionConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or DetectionConfig()
        self.topology = topology
        self.rates = RateTracker()
        self.detectors = [
            LinkDowngradeDetector(topology, self.config.default_nic_rate, self.config.gpu_busy_utilization_pct),
            LinkFlapDetector(topology),
            GpuFaultDetector(),
            UnknownAnomalyDetector(),
        ]
        self.watchdog = PfcWatchdog(self.config.pfc_detection_time_ms, self.config.pfc_restoration_time_ms)
        self.health = NodeHealthBook(topology=topology)
        self.storms = StormLocator(topology or Topology("", [], 8, {}, [], []))
        self.stragglers = StragglerDetector(health=self.health)
        self._last_time_ns: dict[str, int] = {}
        self._jobs_by_node: dict[str, set[str]] = {}
        self.stats: Counter[str] = Counter()

    # -- stage 1: per source --------------------------------------------------------------
    def observe(self, snap: pb.Snapshot) -> SourceOutput:
        last = self._last_time_ns.get(snap.source)
        if last is not None and snap.time_unix_ns <= last:
            # A duplicate (at-least-once redelivery, collector resend) or a late sample:
            # rates cannot run backwards, so it is counted and skipped.
            self.stats["duplicate_or_late_snapshots"] += 1
            return SourceOutput([], [])
        self._last_time_ns[snap.source] = snap.time_unix_ns
        self.stats["snapshots"] += 1
        view = to_view(snap)
        for frame in view.frames:
            self.rates.update(view.source, frame, view.time_ns)
        findings: list[Finding] = []
        for detector in self.detectors:
            findings.extend(detector.update(view))
        self.health.update(view)
        return SourceOutput(findings, self.watchdog.update(view))

    # -- stage 2: per cluster -------------------------------------------------------------
    def locate(self, change: PauseStateChange) -> list[Finding]:
        return self.storms.update(change)

    def tick_cluster(self, now_ns: int) -> list[Finding]:
        """Let the locator's grace periods expire at event time `now_ns` (a timer calls it)."""
        return self.storms.poll(now_ns)

    # -- stage 3: per job -----------------------------------------------------------------
    def add_rank_steps(self, snap: pb.Snapshot) -> list[Finding]:
        findings: list[Finding] = []
        for rs in snap.rank_steps:
            jobs = self._jobs_by_node.setdefault(rs.node, set())
            if rs.job_id not in jobs:
                jobs.add(rs.job_id)
                self.storms.set_jobs(self._jobs_by_node)
        for step in to_view(snap).rank_steps if snap.rank_steps else ():
            findings.extend(self.stragglers.add_step(step, cluster=snap.cluster))
        return findings

    # -- all stages in one process --------------------------------------------------------
    def process(self, snap: pb.Snapshot) -> list[Finding]:
        out = self.observe(snap)
        findings = list(out.findings)
        for change in out.pause_changes:
            findings.extend(self.locate(change))
        findings.extend(self.tick_cluster(snap.time_unix_ns))
        if snap.rank_steps:
            findings.extend(self.add_rank_steps(snap))
        self.stats["findings"] += len(findings)
        return findings
