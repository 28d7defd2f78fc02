"""Stage 2: PFC storm sources, per cluster, from every source's watchdog records.

A `StormStage` holds one `models.storm_locator.StormLocator` per cluster of one
pause-states partition (the topic is keyed by cluster). Its input is stage 1's records
for those clusters, from every telemetry partition: watchdog changes and, after them,
each partition's progress (`SourceProgress`, sent to every pause-states partition). The
stage keeps the low watermark over the telemetry partitions (`LowWatermark.partitions`:
a partition not read yet is waited for, an idle one is not). Changes are held until
the watermark has passed them and then applied in event-time order, each with the
locators' clock at its own time, and the grace periods run on the watermark: every change
a partition emitted up to its progress has been read before that progress, so a backlog,
drained in any order across partitions and workers, is judged as live telemetry is, at
the cost of about one progress interval (50 ms) plus the partitions' spread of latency.
Changes read before the first progress are held for it as well: a worker's first batch
of a backlog may carry many seconds of every partition's changes, partition after
partition, and only the progress after them says which came first. The jobs on the
victims' nodes come from the facts (placements that stage 3 publishes), as they are
known when the storm is judged.

An idle partition's claim holds only while nothing more was written there
(`models.watermark.IdleClaims`): its reader may die right after it, and what is written
next would be judged late (a deadlock missed, a storm split in two). The worker looks the
claimed partitions' end offsets up every 0.1 s (`partition_ends`, `on_partition_ends`):
while a partition is idle, the stage's answers wait up to one look-up more; with none
idle, nothing waits.

Load: a healthy fabric sends no changes, only progress (at most one record per worker
batch to each pause-states partition, naming the telemetry partitions it advanced, each
at most every 50 ms of its event time); a storm sends a few changes per paused port. One partition serves a 100,000-GPU cluster with room to spare
(docs/benchmarks.md).
"""
from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Mapping

from fabricwatch.models.findings import Finding
from fabricwatch.models.pfc_storm import PauseStateChange
from fabricwatch.models.pfc_deadlock import PfcDeadlockDetector
from fabricwatch.models.storm_locator import SourceProgress, StormLocator
from fabricwatch.models.topology import Topology
from fabricwatch.models.watermark import IdleClaims, LowWatermark

from .accounting import Accounting
from .config import DetectionConfig
from .facts import FactBook
from .impact import assess

# Clusters with a locator per stage instance; more is id churn (refused, counted).
MAX_CLUSTERS = 1024
_EMPTY = Topology("", [], 8, {}, [], [])
# What the locators are told: one stream, the stage's watermark over the partitions.
_PARTITIONS = "partitions"
# Changes held for the watermark at most; beyond, the oldest are applied early (counted).
MAX_HELD_CHANGES = 100_000
# The watermark this far behind the newest partition's progress is reported (`stalled`):
# live partitions keep within about a second of each other.
STALL_REPORT_NS = 10_000_000_000


class StormStage:
    """Storm locators of the clusters of one pause-states partition."""

    def __init__(self, config: DetectionConfig, topology: Topology | None, facts: FactBook) -> None:
        self.topology = topology or _EMPTY
        self.facts = facts
        self.accounting = Accounting("pause_states", config.max_sample_age_s)
        self._locators: dict[str, StormLocator] = {}
        # next to each locator: the cluster's PFC deadlock model, fed the same changes in the same order
        self._deadlocks: dict[str, PfcDeadlockDetector] = {}
        self._placements_version = -1
        self._newest_ns = 0
        self._partitions: LowWatermark | None = None      # from the first partition progress on
        self._released_ns = 0                                # the watermark: changes applied, clocks moved
        self._claims = IdleClaims()                          # idle partitions, passed as far as confirmed
        # changes not yet complete (newer than the watermark): (at, entity, role, seq, change)
        self._held: list[tuple[int, str, str, int, PauseStateChange]] = []
        self._seq = 0
        self.stats: Counter[str] = Counter()

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_partitions", None)
        state.setdefault("_held", [])
        state.setdefault("_seq", 0)
        state.setdefault("_deadlocks", {})
        parts = state.get("_partitions")
        state.setdefault("_released_ns", parts.value_ns if parts is not None else 0)
        state.setdefault("_claims", IdleClaims())
        state["stats"] = Counter(state.get("stats", {}))
        self.__dict__.update(state)

    def rebind(self, facts: FactBook) -> None:
        self.facts, self._placements_version = facts, -1

    def _locator(self, cluster: str) -> StormLocator | None:
        loc = self._locators.get(cluster)
        if loc is None:
            if len(self._locators) >= MAX_CLUSTERS:
                self.stats["clusters_refused"] += 1
                return None
            loc = self._locators[cluster] = StormLocator(self.topology, cluster=cluster)
            self._placements_version = -1
        if self._placements_version != self.facts.placements_version:
            self._placements_version = self.facts.placements_version
            for each in self._locators.values():
                each.set_jobs(self.facts.jobs_by_node)
        return loc

    def _deadlock(self, cluster: str) -> PfcDeadlockDetector:
        """The cluster's deadlock model (made with its locator; a state restored from before it had none)."""
        dl = self._deadlocks.get(cluster)
        if dl is None:
            dl = self._deadlocks[cluster] = PfcDeadlockDetector(self.topology, cluster=cluster)
        return dl

    def locate(self, record: PauseStateChange | SourceProgress, received_ns: int = 0) -> list[Finding]:
        """One record of stage 1 (a watchdog change, or a partition's progress)."""
        started = time.perf_counter()
        if isinstance(record, SourceProgress) and not record.cluster:
            return self.accounting.settle(self._assessed(self._partition_progress(record)), "", received_ns, started)
        if isinstance(record, SourceProgress):          # per-source progress (a stage 1 without partitions)
            cluster = record.cluster
            early = self._release(2**63) if self._partitions is None else []   # no partitions to wait for
            self._newest_ns = max(self._newest_ns, max(record.through_ns_by_source.values(), default=0))
            loc = self._locator(cluster)
            found = early + (loc.progress(record) if loc is not None else [])
            if loc is not None and record.through_ns_by_source:
                found += self._deadlock(cluster).advance(min(record.through_ns_by_source.values()))
            return self.accounting.settle(self._assessed(found), cluster, received_ns, started)
        cluster = record.entity.cluster
        self._newest_ns = max(self._newest_ns, record.at_ns)
        if self._partitions is not None and record.at_ns <= self._released_ns:
            self.stats["changes_behind_watermark"] += 1    # a partition revived after it was declared idle
            found = self._apply(record)
        else:
            self._seq += 1
            heapq.heappush(self._held, (record.at_ns, record.entity.path(), record.role, self._seq, record))
            found = []
            if len(self._held) > MAX_HELD_CHANGES:
                self.stats["changes_applied_early"] += 1
                found = self._release(self._held[0][0])
        return self.accounting.settle(self._assessed(found), cluster, received_ns, started)

    def _assessed(self, found: list[Finding]) -> list[Finding]:
        return assess(found, self.facts, self.topology) if found else found

    def _apply(self, change: PauseStateChange) -> list[Finding]:
        loc = self._locator(change.entity.cluster)
        if loc is None:
            return []
        dl = self._deadlock(change.entity.cluster)
        if self._partitions is not None:            # the clock at the change, then the change
            return loc.progress(self._told(change.entity.cluster, change.at_ns)) + loc.update(change) + dl.update(change)
        return loc.update(change) + dl.update(change)

    def _release(self, through_ns: int) -> list[Finding]:
        """Apply the held changes up to ``through_ns``, in event-time order."""
        found: list[Finding] = []
        while self._held and self._held[0][0] <= through_ns:
            found += self._apply(heapq.heappop(self._held)[-1])
        return found

    def _partition_progress(self, record: SourceProgress) -> list[Finding]:
        """A telemetry partition's progress (or idleness): changes it completes, clocks moved."""
        wm = self._partitions
        if wm is None:
            wm = self._partitions = LowWatermark.partitions()
            wm.expect(record.expect, 0)                     # a partition not read yet may be anywhere behind
        if record.idle:
            for stream in record.through_ns_by_source:
                wm.idle(stream)
                self._claims.claim(stream, record.end_offset)
        else:
            wm.advance(record.through_ns_by_source.items())
            self._claims.heard(record.through_ns_by_source)
            self._newest_ns = max(self._newest_ns, max(record.through_ns_by_source.values(), default=0))
        return self._moved()

    def partition_ends(self) -> list[str]:
        """The idle partitions whose end offsets to look up now (none: the watermark is not
        held by them); the minimum they hold back is noted, for `on_partition_ends`."""
        if self._partitions is None:
            return []
        return self._claims.ask(self._partitions.minimum_ns(), self._released_ns)

    def on_partition_ends(self, ends_by_stream: Mapping[str, int]) -> list[Finding]:
        """The end offsets of the partitions `partition_ends` named, looked up after it was
        asked: the watermark past those still at their claim, up to where it stood then."""
        started = time.perf_counter()
        if self._partitions is None:
            return []
        stale = self._claims.answer(ends_by_stream, self._partitions)
        if stale:
            self.stats["idle_partitions_written_since"] += len(stale)
        found = self._assessed(self._moved())
        self.accounting.account(found, started)
        return found

    def _moved(self) -> list[Finding]:
        """The watermark to the partitions' minimum, past the idle ones only as far as confirmed:
        the changes it completes applied, the clocks moved."""
        before = self._released_ns
        low = self._claims.cap(self._partitions.minimum_ns())
        if low <= before and before:
            return []
        now = self._released_ns = max(before, low)
        found = self._release(now)
        return (found + [f for cluster, loc in self._locators.items() for f in loc.progress(self._told(cluster, now))]
                + [f for dl in self._deadlocks.values() for f in dl.advance(now)])

    @staticmethod
    def _told(cluster: str, at_ns: int) -> SourceProgress:
        return SourceProgress(cluster, {_PARTITIONS: at_ns}, (_PARTITIONS,))

    @property
    def watermark_ns(self) -> int | None:
        """The low watermark over the telemetry partitions (None before any progress)."""
        return None if self._partitions is None else self._released_ns

    def stalled(self) -> str | None:
        """What holds the watermark, when it trails the newest progress by `STALL_REPORT_NS`
        (None otherwise): the slowest live partitions and the idle ones not confirmed yet."""
        wm = self._partitions
        if wm is None:
            return None
        # before it first moved: stalled once the partitions heard from spread that far
        since_ns = self._released_ns or min((t for t in wm.through_ns.values() if t), default=wm.newest_ns)
        if wm.newest_ns - since_ns < STALL_REPORT_NS:
            return None

        def behind(through_ns: int) -> str:
            return f"{(wm.newest_ns - through_ns) / 1e9:.1f} s behind" if through_ns else "none yet"

        slowest = ", ".join(f"{stream} {behind(through)}" for stream, through in wm.holders())
        claims = ", ".join(f"{stream} at offset {end}" for stream, end in sorted(self._claims.ends.items()))
        return (f"storm watermark: {behind(self._released_ns)}; slowest live partitions: {slowest or 'none'}; "
                f"idle claims: {claims or 'none'} (confirmed: {behind(self._claims.confirmed_ns)})")

    def poll(self, now_ns: int) -> list[Finding]:
        """Let grace periods expire when no record arrives (a timer calls it).

        The wall clock is capped at the newest event time this stage has seen, so a worker
        catching up on a backlog does not expire grace periods of half-arrived pictures;
        on the watermark only the partitions' progress moves the locators' clocks anyway.
        """
        started = time.perf_counter()
        at_ns = min(now_ns, self._newest_ns) if self._newest_ns else now_ns
        found = [f for loc in self._locators.values() for f in loc.poll(at_ns)]
        if self._partitions is None:                # on the watermark, only the partitions' progress moves time
            found += [f for dl in self._deadlocks.values() for f in dl.advance(at_ns)]
        found = self._assessed(found)
        self.accounting.account(found, started, stage="cluster_timer")
        return found

    @property
    def open_anomalies(self) -> dict[str, tuple[str, str]]:
        return self.accounting.open_anomalies
