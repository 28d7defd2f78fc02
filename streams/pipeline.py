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

Progress. Besides the watchdog's changes, stage 1 tells stage 2 how far it has processed
each source (`SourceProgress`, returned with the changes in `SourceOutput.pause_changes`,
on the same cluster-keyed partition, after that source's changes): the storm locator runs
its grace periods on the low watermark of the sources, so a backlog read faster on the
switches' partitions than on the nodes' names no storm root that the nodes' records would
explain. The sources processed since the last record go out together, in one record per
`MAX_SOURCES_PER_PROGRESS` sources, when some source has advanced `PROGRESS_INTERVAL_MS`
of its event time since its first unsent progress: a source's entries are at least
`PROGRESS_INTERVAL_MS` apart in its event time, and batches go out about once per
sampling interval (clock offsets between sources do not multiply them). Volume for a
12,500-node cluster at the node collector's PFC rate (10 samples/s): ~15,700 sources
(nodes, ~3,100 leaves, spines), so ~157k source entries/s (314k/s at most, at faster
sampling) in ~16 records of ≤ 1,000 entries per interval (~32 kB of JSON each, ~5 MB/s
on the pause-states topic, plus one record per interval per further stage-1 worker),
which stage 2 (one partition per cluster) decodes and applies at ~1 µs per entry
(~0.15 core). One record per source would be 157k records/s on that single partition:
more than one Faust consumer takes.

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
from fabricwatch.models.storm_locator import SourceProgress, StormLocator
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.models.topology import DEFAULT_NIC_RATE, Topology
from fabricwatch.models.unknown import UnknownAnomalyDetector
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .decode import to_view
from .events import event_id

log = logging.getLogger("fabricwatch.pipeline")
# Consecutive progress entries of one source are at least this far apart in its event time.
# Half the node collector's PFC sampling interval (100 ms): at that rate every sample's
# progress goes out (timestamp jitter never skips one), so live the low watermark trails
# the newest sample by one interval; faster sampling is thinned to 20 entries/s per source.
PROGRESS_INTERVAL_MS = 50
_PROGRESS_INTERVAL_NS = PROGRESS_INTERVAL_MS * 1_000_000
# Sources per SourceProgress record: ~32 kB of JSON, far below Kafka's 1 MB message limit.
MAX_SOURCES_PER_PROGRESS = 1000
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
    """What one snapshot produced in stage 1: findings, and the records for stage 2 in order."""
    findings: list[Finding]
    pause_changes: list[PauseStateChange | SourceProgress]


class _ProgressOutbox:
    """Stage 1's unsent per-source progress, per cluster, batched into `SourceProgress` records.

    A batch goes out when the source just processed has advanced `PROGRESS_INTERVAL_MS`
    since its first unsent progress (its own clock: offsets between sources' clocks do not
    matter), with every source whose progress is at least `PROGRESS_INTERVAL_MS` past what
    was last sent for it; the others wait for the next batch.
    """

    def __init__(self) -> None:
        self._through_ns: dict[str, dict[str, int]] = {}   # cluster -> source -> processed through (unsent)
        self._since_ns: dict[str, dict[str, int]] = {}     # cluster -> source -> its first unsent time
        self._sent_ns: dict[str, dict[str, int]] = {}      # cluster -> source -> its last entry sent

    def note(self, cluster: str, source: str, time_ns: int) -> list[SourceProgress]:
        """Record that ``source`` is processed through ``time_ns``; the records due now."""
        through = self._through_ns.get(cluster)
        if through is None:                            # a cluster's first sample goes out at once,
            through = self._through_ns[cluster] = {}   # so stage 2 starts on the watermark
            since, sent = self._since_ns[cluster], self._sent_ns[cluster] = {}, {}
            due = True
        else:
            since, sent = self._since_ns[cluster], self._sent_ns[cluster]
            due = time_ns - since.setdefault(source, time_ns) >= _PROGRESS_INTERVAL_NS
        through[source] = time_ns
        if not due:
            return []
        batch = {}
        for name, at_ns in list(through.items()):
            if at_ns - sent.get(name, -_PROGRESS_INTERVAL_NS) >= _PROGRESS_INTERVAL_NS:
                batch[name] = sent[name] = at_ns
                del through[name]
                since.pop(name, None)
        items = list(batch.items())
        return [SourceProgress(cluster, dict(items[i:i + MAX_SOURCES_PER_PROGRESS]))
                for i in range(0, len(items), MAX_SOURCES_PER_PROGRESS)]


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
        self._progress = _ProgressOutbox()
        self._last_time_ns: dict[str, int] = {}
        self._jobs_by_node: dict[str, set[str]] = {}
        self.stats: Counter[str] = Counter()
        self.open_anomalies: dict[str, tuple[str, str]] = {}   # dedup key -> (kind, severity)
        # Set while state is rebuilt from history (`streams.rebuild`): findings then only
        # move the open-anomaly book; they were emitted, counted and logged when first found.
        self.rebuilding = False

    def __setstate__(self, state: dict) -> None:
        # Checkpoints written before `open_anomalies` or progress records existed still load.
        state.setdefault("open_anomalies", {})
        state.setdefault("_progress", _ProgressOutbox())
        state["rebuilding"] = False
        self.__dict__.update(state)

    def _account(self, stage: str, started_s: float, findings: list[Finding]) -> None:
        """Metrics, open-anomaly book and log lines of one stage call."""
        _PROCESSING_S[stage].observe(time.perf_counter() - started_s)
        if not findings:
            return
        now_ns = time.time_ns()
        for f in findings:
            if f.state == RESOLVED:
                self.open_anomalies.pop(f.dedup_key, None)
            else:
                self.open_anomalies[f.dedup_key] = (f.kind, f.severity)
            if self.rebuilding:
                continue
            _EVENT_TO_ANOMALY_S[stage].observe(max(0, now_ns - f.detected_ns) / 1e9)
            metrics.WORKER_ANOMALIES_EMITTED.labels(f.kind, f.state).inc()
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
        changes: list[PauseStateChange | SourceProgress] = list(self.watchdog.update(view))
        changes += self._progress.note(snap.cluster, snap.source, snap.time_unix_ns)
        return SourceOutput(findings, changes)

    # -- stage 2: per cluster -------------------------------------------------------------
    def locate(self, record: PauseStateChange | SourceProgress) -> list[Finding]:
        """A watchdog change or a source-progress record, as stage 1 emitted it."""
        started = time.perf_counter()
        if isinstance(record, SourceProgress):
            found = self.storms.progress(record)
        else:
            found = self.storms.update(record)
        findings = self._mark_stale(found)
        self._account("pause_states", started, findings)
        return findings

    def tick_cluster(self, now_ns: int) -> list[Finding]:
        """Let the locator's grace periods expire at event time `now_ns` (a timer calls it).

        The worker's timer passes the wall clock; it is capped at the newest sample this
        pipeline has seen, so a worker catching up on a backlog (or restarted after a crash)
        does not expire grace periods of old, half-arrived pictures at once and name a
        switch port as a storm's root. Once progress records flow, the locator's clock is
        their low watermark and this only re-evaluates at it.
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
