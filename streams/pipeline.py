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

Each stage call is timed into ``fabricwatch_detector_processing_seconds{stage}``; each
finding moves ``fabricwatch_worker_anomalies_emitted_total``, the event-time-to-emission
histogram and the book of open anomalies (`open_anomalies`, exported as a gauge by the
worker), and is logged with its anomaly id. In replay the event-to-anomaly latency is
meaningless (old event times), but replay serves no metrics.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

from fabricwatch import metrics
from fabricwatch.models.findings import INFO, RESOLVED, UPDATE, Evidence, Finding
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
from .events import event_id

log = logging.getLogger("fabricwatch.pipeline")
# Bound once: `.labels()` takes a lock and a dict lookup per call.
_PROCESSING_S = {stage: metrics.DETECTOR_PROCESSING_SECONDS.labels(stage) for stage in metrics.DETECTOR_STAGES}
_EVENT_TO_ANOMALY_S = {stage: metrics.DETECTOR_EVENT_TO_ANOMALY_SECONDS.labels(stage)
                       for stage in metrics.DETECTOR_STAGES}


@dataclass(frozen=True)
class DetectionConfig:
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = 20.0
    pfc_detection_time_ms: int = DEFAULT_DETECTION_TIME_MS
    pfc_restoration_time_ms: int | None = None   # default: 2 x detection, as SONiC's pfcwd
    # Live worker only (None = off, as in replay): a finding confirmed by a sample older than
    # this, by the wall clock, is marked stale (info severity, `sample_age_s` evidence).
    max_sample_age_s: float | None = None


@dataclass
class SourceOutput:
    """What one snapshot produced in stage 1."""
    findings: list[Finding]
    pause_changes: list[PauseStateChange]


class DetectionPipeline:
    """Feed it snapshots of many sources in per-source event-time order; get findings."""

    def __init__(self, config: DetectionConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or DetectionConfig()
        if self.config.max_sample_age_s is not None and not self.config.max_sample_age_s > 0:
            raise ValueError(f"max_sample_age_s must be > 0 or None, got {self.config.max_sample_age_s!r}")
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
        self.open_anomalies: dict[str, tuple[str, str]] = {}   # dedup key -> (kind, severity)

    def __setstate__(self, state: dict) -> None:
        # Checkpoints written before `open_anomalies` existed still load.
        state.setdefault("open_anomalies", {})
        self.__dict__.update(state)

    def _account(self, stage: str, started_s: float, findings: list[Finding]) -> None:
        """Metrics, open-anomaly book and log lines of one stage call."""
        _PROCESSING_S[stage].observe(time.perf_counter() - started_s)
        if not findings:
            return
        now_ns = time.time_ns()
        for f in findings:
            _EVENT_TO_ANOMALY_S[stage].observe(max(0, now_ns - f.detected_ns) / 1e9)
            metrics.WORKER_ANOMALIES_EMITTED.labels(f.kind, f.state).inc()
            if f.state == RESOLVED:
                self.open_anomalies.pop(f.dedup_key, None)
            else:
                self.open_anomalies[f.dedup_key] = (f.kind, f.severity)
            level = logging.DEBUG if f.state == UPDATE else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "anomaly %s %s %s: %s", f.state, f.kind, f.entity.path(), f.summary,
                        extra={"anomaly_id": event_id(f), "dedup_key": f.dedup_key, "kind": f.kind,
                               "lifecycle": f.state, "severity": f.severity, "entity": f.entity.path(),
                               "stage": stage})

    def _mark_stale(self, findings: list[Finding]) -> list[Finding]:
        """Staleness rule: a worker that has fallen behind still reports what the backlog
        shows, but a finding whose confirming sample is older than `max_sample_age_s` is
        not news: it goes out as info, with the sample's age as evidence, so that nobody is
        paged and no automatic action runs on data that may no longer hold."""
        limit_s = self.config.max_sample_age_s
        if limit_s is None or not findings:
            return findings
        now_ns = time.time_ns()
        marked = []
        for f in findings:
            age_s = (now_ns - f.detected_ns) / 1e9
            if age_s > limit_s:
                self.stats["stale_findings"] += 1
                f = replace(f, severity=INFO, summary=f"[stale: {age_s:.0f} s old] {f.summary}",
                            evidence=[*f.evidence, Evidence("sample_age_s", age_s, limit_s, "s",
                                                            "detected on a backlog, not live data")])
            marked.append(f)
        return marked

    # -- stage 1: per source --------------------------------------------------------------
    def observe(self, snap: pb.Snapshot) -> SourceOutput:
        started = time.perf_counter()
        out = self._observe(snap)
        out.findings = self._mark_stale(out.findings)
        self._account("telemetry", started, out.findings)
        return out

    def _observe(self, snap: pb.Snapshot) -> SourceOutput:
        last = self._last_time_ns.get(snap.source)
        if last is not None and snap.time_unix_ns <= last:
            # A duplicate (at-least-once redelivery, collector resend) or a late sample:
            # rates cannot run backwards, so it is counted and skipped.
            self.stats["duplicate_or_late_snapshots"] += 1
            metrics.WORKER_LATE_SNAPSHOTS.inc()
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
        started = time.perf_counter()
        findings = self._mark_stale(self.storms.update(change))
        self._account("pause_states", started, findings)
        return findings

    def tick_cluster(self, now_ns: int) -> list[Finding]:
        """Let the locator's grace periods expire at event time `now_ns` (a timer calls it).

        The worker's timer passes the wall clock; it is capped at the newest sample this
        pipeline has seen, so a worker catching up on a backlog (or restarted after a crash)
        does not expire grace periods of old, half-arrived pictures at once and name a
        switch port as a storm's root.
        """
        started = time.perf_counter()
        newest_ns = max(self._last_time_ns.values(), default=0)
        findings = self._mark_stale(self.storms.poll(min(now_ns, newest_ns) if newest_ns else now_ns))
        self._account("cluster_timer", started, findings)
        return findings

    # -- stage 3: per job -----------------------------------------------------------------
    def add_rank_steps(self, snap: pb.Snapshot) -> list[Finding]:
        started = time.perf_counter()
        findings = self._mark_stale(self._add_rank_steps(snap))
        self._account("rank_steps", started, findings)
        return findings

    def _add_rank_steps(self, snap: pb.Snapshot) -> list[Finding]:
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
