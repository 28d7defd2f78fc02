"""Stage 1: the detectors that run next to each source's telemetry, for one partition.

A `SourceStage` holds the state of the sources of one telemetry partition (in the worker,
one per assigned partition, moved with it; in replay, one for everything) and folds in one
record at a time (`models.frames.SourceBatch`: the ticks of one source that one collector
batch carried):

1. ticks not newer than the source's last are dropped (a redelivery, a resend) and counted;
2. rates for every block layout, over all its ticks at once;
3. the per-source rules (downgrade, flap, GPU faults, the learned baseline), each given only
   the blocks it reads; the PFC watchdog, whose onsets and restorations feed stage 2; the
   health tracker, whose digests feed stage 3 through the facts;
4. progress: the partition's low watermark (its live sources, `models.watermark`), sent
   every `PROGRESS_INTERVAL_MS` of it, at most once per `observe_many` call (after the
   call's last record), as a `Progress` fact and as a `SourceProgress` record to every
   pause-states partition after the watchdog changes it follows (the worker merges the
   partitions of one batch into one such record, `streams.handlers`), so the
   stages that join this partition with others judge a moment only once it has been
   processed here. When the partition has nothing left to read, the worker says so
   (`idle`): the others stop waiting for it until it reports again.

Volume at 100,000 GPUs (12,500 nodes, 24 partitions): at most ~20 progress facts per
partition per second, and at most one progress record per worker batch (~20 per second)
to each pause-states partition, ~0.2 kB each; health digests only for nodes with
something to report.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fabricwatch import metrics
from fabricwatch.models.ecmp_imbalance import EcmpImbalanceDetector
from fabricwatch.models.ecn_pfc_misorder import EcnPfcMisorderDetector
from fabricwatch.models.fec import FecMemory
from fabricwatch.models.findings import Finding
from fabricwatch.models.frames import LayoutGroup, SourceBatch, layout_groups
from fabricwatch.models.gpu_faults import GpuFaultDetector
from fabricwatch.models.health_tracker import HealthTracker
from fabricwatch.models.link_down import LinkDownDetector
from fabricwatch.models.link_downgrade import LinkDowngradeDetector
from fabricwatch.models.link_flap import LinkFlapDetector
from fabricwatch.models.lossless_drop import LosslessDropDetector
from fabricwatch.models.pfc_storm import PauseStateChange, PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import SOURCE_LIVENESS_MS, SOURCE_MAX_LAG_MS, SourceProgress
from fabricwatch.models.topology import Topology
from fabricwatch.models.unknown import UnknownAnomalyDetector
from fabricwatch.models.watermark import LowWatermark

from .accounting import Accounting
from .config import DetectionConfig
from .facts import Fact, FactBook, NominalVote, Progress
from .impact import assess

# The partition's progress goes out each time its low watermark advanced this much of event
# time: half the node collector's PFC interval, so that live it trails the newest sample by
# about one interval.
PROGRESS_INTERVAL_MS = 50
_PROGRESS_INTERVAL_NS = PROGRESS_INTERVAL_MS * 1_000_000
# Silent nodes are looked for this often (partition event time).
HEALTH_SWEEP_NS = 1_000_000_000
# Sources whose last tick time is remembered (for duplicates); more is id churn, refused.
MAX_SOURCES = 200_000


Guard = Callable[[str, Callable[[], list]], list]


def _unguarded(what: str, fn: Callable[[], list]) -> list:
    return fn()


@dataclass
class SourceOutput:
    """What one record produced: findings; stage 2's records (watchdog changes, then
    progress), per cluster, in order; facts for every worker."""

    findings: list[Finding] = field(default_factory=list)
    pause_records: list[PauseStateChange | SourceProgress] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)


class SourceStage:
    """The stage-1 state of the sources of one telemetry partition.

    ``stream`` names the partition (``"<topic>/<p>"``) and ``streams`` every partition of
    the topic (what stage 2 and 3 wait for); replay uses one stream for everything.
    """

    # checkpoints from before impact lack these: their findings' impact is estimated
    topology: Topology | None = None
    facts: FactBook | None = None

    def __init__(self, config: DetectionConfig, topology: Topology | None, facts: FactBook,
                 topic: str = "replay", partition: int = 0, partitions: int = 1) -> None:
        self.config = config
        self.facts, self.topology = facts, topology
        self.topic, self.partition, self.partitions = topic, partition, partitions
        self.stream = partition_stream(topic, partition)
        self.streams = tuple(partition_stream(topic, i) for i in range(partitions))
        self.rates = RateTracker()
        fec = FecMemory()       # one per stage: the link detectors share its evidence
        self.downgrade = LinkDowngradeDetector(topology, config.default_nic_rate, config.gpu_busy_utilization_pct,
                                               nominal=facts.nominal, fec=fec)
        self.gpu_faults = GpuFaultDetector()
        self.detectors = [self.downgrade, LinkFlapDetector(topology, fec=fec), LinkDownDetector(topology, fec=fec),
                          self.gpu_faults, UnknownAnomalyDetector(), EcmpImbalanceDetector(topology),
                          # congestion tuning (issue 15): the peers of a switch are the switches of this stage
                          EcnPfcMisorderDetector(topology), LosslessDropDetector()]
        self.watchdog = PfcWatchdog(config.pfc_detection_time_ms, config.pfc_restoration_time_ms)
        self.health = HealthTracker(topology=topology, nominal=facts.nominal)
        self.accounting = Accounting("telemetry", config.max_sample_age_s)
        self._last_time_ns: dict[str, int] = {}
        self._watermark = LowWatermark(SOURCE_LIVENESS_MS * 1_000_000, SOURCE_MAX_LAG_MS * 1_000_000)
        self._sent_ns = self._sent_pauses_ns = -(2**62)
        self._linger_ns = int(config.collector_linger_s * 1e9)
        self._swept_ns = 0
        self.stats: Counter[str] = Counter()

    def rebind(self, facts: FactBook) -> None:
        """After a restore: use this worker's shared facts (the nominal rates are not state)."""
        self.downgrade.nominal = facts.nominal
        self.health.nominal = facts.nominal
        self.facts = facts

    # -- records ----------------------------------------------------------------------------
    def observe(self, batch: SourceBatch) -> SourceOutput:
        return self.observe_many([batch])[0]

    def observe_many(self, batches: list[SourceBatch], guard: Guard = _unguarded) -> list[SourceOutput]:
        """Records in the order they were read: what each produced.

        The array work runs once over the stacks of every record (`models.frames.LayoutGroup`:
        rates, and each detector's screen), then each record is judged alone, in order; a
        record whose stacks the screens found quiet costs a few dictionary lookups.
        ``guard(what, fn)`` runs each step and returns ``[]`` where a step failed, so that a
        model bug on one record loses that record only.
        """
        started = time.perf_counter()
        outs = [SourceOutput() for _ in batches]
        kept = [(i, b) for i, b in ((i, self._admit(b)) for i, b in enumerate(batches)) if b is not None]
        for group in layout_groups([b for _, b in kept]):
            guard(f"the stacks of {len(group.sources)} sources", lambda g=group: self._screen(g))
        shared_s = (time.perf_counter() - started) / max(1, len(batches))
        for i, batch in kept:
            judged = guard(f"a record of {batch.source}", lambda b=batch: [self._judge(b, time.perf_counter() - shared_s)])
            if judged:
                outs[i] = judged[0]
        if kept:
            # The partition's progress once per call, after the last record's own output:
            # what the others wait for is the same, one record instead of one per record.
            self._progress(outs[kept[-1][0]])
        return outs

    def _screen(self, group: LayoutGroup) -> list:
        self.rates.update_group(group)
        for screener in self._screeners:
            screener.screen(group)
        return []

    def _admit(self, batch: SourceBatch) -> SourceBatch | None:
        """The record's ticks newer than its source's last (None: nothing new), counted."""
        last = self._last_time_ns.get(batch.source)
        if last is not None and batch.times_ns[-1] <= last:
            # A duplicate (at-least-once redelivery, collector resend) or late: rates cannot
            # run backwards, so it is counted and skipped.
            self.stats["duplicate_or_late_snapshots"] += len(batch.times_ns)
            metrics.WORKER_LATE_SNAPSHOTS.inc(len(batch.times_ns))
            self.accounting.account([], time.perf_counter())
            return None
        if last is None and len(self._last_time_ns) >= MAX_SOURCES:
            self.stats["sources_refused"] += 1
            return None
        if last is not None:
            kept = batch.after(last)
            dropped = len(batch.times_ns) - len(kept.times_ns)
            if dropped:
                self.stats["duplicate_or_late_snapshots"] += dropped
                metrics.WORKER_LATE_SNAPSHOTS.inc(dropped)
            batch = kept
        self._last_time_ns[batch.source] = int(batch.times_ns[-1])
        self.stats["snapshots"] += len(batch.times_ns)
        self.stats["records"] += 1
        return batch

    def _judge(self, batch: SourceBatch, started: float) -> SourceOutput:
        out = SourceOutput()
        findings: list[Finding] = []
        for detector in self.detectors:
            findings += detector.update_batch(batch)
        out.pause_records = list(self.watchdog.update_batch(batch))
        out.facts = list(self.health.update_batch(batch, findings))
        out.facts += [NominalVote(*vote) for vote in self.downgrade.take_votes()]
        self._advance(batch, out)
        findings.sort(key=lambda f: (f.detected_ns, f.kind, f.entity.path()))
        if findings:
            findings = assess(findings, self.facts, self.topology)
        out.findings = self.accounting.settle(findings, batch.source, batch.received_ns, started)
        return out

    @property
    def _screeners(self) -> list:
        return [*self.detectors, self.watchdog, self.health]

    def _advance(self, batch: SourceBatch, out: SourceOutput) -> None:
        """The record's source moved the watermark; silent nodes looked for when due."""
        self._watermark.advance(((batch.source, int(batch.times_ns[-1])),))
        self._watermark.settle()            # each record's: the watermark ratchets as it did record by record
        newest = self._watermark.newest_ns
        if newest - self._swept_ns >= HEALTH_SWEEP_NS:
            self._swept_ns = newest
            out.facts += self.health.sweep(newest)

    def _progress(self, out: SourceOutput) -> None:
        """The partition's progress, when it advanced `PROGRESS_INTERVAL_MS` since last sent."""
        through = self._watermark.settle()
        newest = self._watermark.newest_ns
        if through - self._sent_ns >= _PROGRESS_INTERVAL_NS:
            # node health is complete through the slowest live source
            self._sent_ns = through
            out.facts.append(Progress(self.topic, self.partition, self.partitions, through))
        # watchdog changes are complete through the newest tick, up to a collector's linger
        # past the slowest source (a pausing port is handed over at once, never held)
        pauses_through = max(through, min(through + self._linger_ns, newest))
        if pauses_through - self._sent_pauses_ns >= _PROGRESS_INTERVAL_NS:
            self._sent_pauses_ns = pauses_through
            out.pause_records.append(SourceProgress("", {self.stream: pauses_through}, self.streams))

    def idle(self, end_offset: int | None = None) -> tuple[Progress, SourceProgress]:
        """The partition has nothing left to read (before ``end_offset``): what tells the other
        stages so. Its next record's progress goes out whatever it advanced (the others wait
        for it again)."""
        self._sent_ns = self._sent_pauses_ns = -(2**62)
        return partition_idle(self.topic, self.partition, self.partitions, self._watermark.value_ns, end_offset)

    # -- state ----------------------------------------------------------------------------
    @property
    def open_anomalies(self) -> dict[str, tuple[str, str]]:
        return self.accounting.open_anomalies


def partition_idle(topic: str, partition: int, partitions: int, through_ns: int = 0,
                   end_offset: int | None = None) -> tuple[Progress, SourceProgress]:
    """A telemetry partition (with or without a stage yet) is idle, read up to ``end_offset``:
    its fact and its record."""
    streams = tuple(partition_stream(topic, i) for i in range(partitions))
    return (Progress(topic, partition, partitions, through_ns, idle=True, end_offset=end_offset),
            SourceProgress("", {partition_stream(topic, partition): through_ns}, streams, idle=True, end_offset=end_offset))


def partition_stream(topic: str, partition: int) -> str:
    """The name of a telemetry partition as a stream of the storm stage's watermark."""
    return f"{topic}/{partition}"


def stream_partition(stream: str) -> tuple[str, int]:
    """`partition_stream` read back: (topic, partition)."""
    topic, _, partition = stream.rpartition("/")
    return topic, int(partition)
