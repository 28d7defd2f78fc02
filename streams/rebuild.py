"""Keep the worker's detection state consistent with the offsets it has consumed.

One `StateKeeper` per worker sits between the agents and the `DetectionPipeline`:

* Before a record is processed, `admit` asks `streams.coverage.Coverage` whether the state
  already holds it (skip), holds everything before it (process), or misses records before
  it (a gap: after a takeover, or on taking a partition back). A gap is filled from the
  partition's history (`streams.history`). After a checkpoint (the state holds everything
  before the gap) its records are *replayed*: processed as they were then, their outputs
  returned to be sent again. Whoever processed them committed their offsets, but Kafka's
  commit does not wait for the outputs to be delivered, so a worker killed in between lost
  them (a storm's restoration, a switch port's pause change); sent twice they carry the
  same ids, and every reader of the outputs takes a repeat as one (event ids, facts keyed
  by what they describe, pause changes older than a port's last). With nothing covered,
  the lookback window is folded in with its outputs suppressed: that is history from
  before anything this state knows, long delivered. A worker that takes over a dead one's
  partitions thus knows the storms and stragglers it had open, resolves them under the
  same ids, and does not open them again.
* History is read from the covered offset, or, with nothing covered, from a lookback
  window before the first live record (per topic: rates need seconds, the storm locator's
  edge-triggered pause states and the straggler's step windows need minutes). The window
  bounds the rebuild's cost: at ~1,800 snapshots/s per core, 15 s of a partition of a
  12,500-node cluster (12 partitions) folds in about 9 s.
* `lock` is held by the agents while they fold a batch and send its outputs, and by the
  checkpoint while it pickles state and coverage: a checkpoint never claims a record
  whose outputs are still being handed to the producer (the checkpoint then flushes the
  producer before writing the file, so what it covers has been delivered).
* While a rebuild runs, `rebuilding` is set and the cluster timer waits: a half-rebuilt
  storm picture must not expire a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from fabricwatch import metrics

from .coverage import SKIP, Coverage, Gap

log = logging.getLogger("fabricwatch.worker")
# fold(value, replay): fold one record in; with ``replay`` its outputs are returned to be sent
# (a gap after a checkpoint), without, they are suppressed (a lookback window).
Fold = Callable[[bytes, bool], list]


class History(Protocol):
    async def offset_at(self, topic: str, partition: int, timestamp_ms: int) -> int | None: ...

    def read(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[tuple[int, bytes]]: ...


class StateKeeper:
    """Coverage, gap rebuilds and the state lock of one worker.

    lookback_s: per topic, how far before the first live record a rebuild starts when
    nothing of the partition is covered (also the most a stale coverage is caught up).
    """

    def __init__(self, coverage: Coverage, history: History, lookback_s: Mapping[str, float]) -> None:
        self.coverage = coverage
        self.history = history
        self.lookback_s = dict(lookback_s)
        self.lock = asyncio.Lock()
        self.rebuilding = 0
        self.stats: Counter[str] = Counter()

    async def admit(self, topic: str, partition: int, offset: int, timestamp_s: float,
                    fold: Fold) -> tuple[bool, list]:
        """(whether the record must be processed now, the outputs of a gap replayed before it)."""
        decision = self.coverage.admit(topic, partition, offset)
        if decision == SKIP:
            self.stats["covered_records_skipped"] += 1
            metrics.WORKER_COVERED_RECORDS_SKIPPED.labels(topic).inc()
            return False, []
        replayed: list = []
        if isinstance(decision, Gap):
            await self.rebuild(decision, int(timestamp_s * 1000), fold, replayed)
        return True, replayed

    def folded(self, topic: str, partition: int, offset: int) -> None:
        self.coverage.folded(topic, partition, offset)

    async def rebuild(self, gap: Gap, live_timestamp_ms: int, fold: Fold, replayed: list) -> int:
        """Fold the gap's records (at most the lookback window of them); returns how many.

        A gap after a checkpoint is replayed, its outputs appended to ``replayed``."""
        lookback_ms = int(self.lookback_s.get(gap.topic, 0.0) * 1000)
        if lookback_ms <= 0:
            return 0
        self.rebuilding += 1
        started, folded = time.perf_counter(), 0
        try:
            window_start = await self.history.offset_at(gap.topic, gap.partition, live_timestamp_ms - lookback_ms)
            start = gap.end_offset if window_start is None else window_start
            if gap.start_offset is not None:
                start = max(start, gap.start_offset)
            if start >= gap.end_offset:
                return 0
            replay = gap.start_offset is not None          # after a checkpoint
            async for offset, value in self.history.read(gap.topic, gap.partition, start, gap.end_offset):
                replayed += fold(value, replay)           # a lookback window's fold returns nothing
                self.coverage.folded(gap.topic, gap.partition, offset)
                folded += 1
        except Exception as exc:   # history unreadable: detect live on what state there is
            self.stats["rebuild_failures"] += 1
            metrics.WORKER_REBUILD_FAILURES.labels(gap.topic).inc()
            log.warning("state rebuild of %s[%d] stopped after %d records: %s", gap.topic, gap.partition,
                        folded, exc)
        finally:
            self.rebuilding -= 1
            if replayed:
                self.stats["replayed_outputs"] += len(replayed)
            if folded:
                self.stats["rebuilt_records"] += folded
                metrics.WORKER_REBUILT_RECORDS.labels(gap.topic).inc(folded)
                log.warning("rebuilt detection state of %s[%d] from %d records before offset %d in %.2f s%s",
                            gap.topic, gap.partition, folded, gap.end_offset, time.perf_counter() - started,
                            f" ({len(replayed)} outputs sent again)" if replayed else "")
        return folded
