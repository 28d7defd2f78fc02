"""Bytes in, records out: what the Faust agents call for each record of each stage.

Kept apart from the agents so that tests drive them without Kafka, and so that a malformed
record is counted and skipped here, never raised into the stream loop. Each call takes the
record's value, the stage instance of its partition and the record's timestamp (the
gateway's receive time, carried on from stage to stage: what staleness is measured on), and
returns the records to send, in order. While a stage rebuilds its state from history
(`rebuilding`: a lookback window, `streams.rebuild`), nothing is returned: that history
was delivered long ago. A gap after a checkpoint is replayed instead, as live records.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from google.protobuf.message import DecodeError

from fabricwatch.models.findings import Finding
from fabricwatch.models.frames import SourceBatch
from fabricwatch.models.pfc_storm import PauseStateChange
from fabricwatch.models.storm_locator import SourceProgress
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import records_pb2 as rec
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from . import facts as fact_codec
from .cloudevents import CloudEventError, anomaly_headers
from .codec import RecordError, pause_change_from_json, pause_change_to_json
from .decode import RecordError as TelemetryRecordError
from .decode import rank_progress_of, rank_steps_of, to_batch
from .events import to_event
from .facts import Fact
from .source_stage import SourceStage, partition_idle
from .storm_stage import StormStage
from .straggler_stage import StragglerStage

log = logging.getLogger("fabricwatch.worker")
ANOMALIES, PAUSE_STATES, FACTS = "anomalies", "pause_states", "facts"


class Record(NamedTuple):
    """One record to send: to which of the worker's output topics, key, value, headers.

    ``partition``: an explicit partition (facts go to the partition of the same number as
    the input's); ``timestamp_ms``: the gateway's receive time of what it derives from.
    """

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None
    timestamp_ms: int | None = None


class StageHandlers:
    """The worker's three stages, record by record; counters in `stats`.

    ``facts_partitions``: how many partitions the facts topic has; a stage's facts go to
    its input partition's number modulo that, so each input partition's facts stay in order.
    ``pause_partitions``: how many the pause-states topic has; a partition's progress goes
    to each (every cluster's storm locator waits for every telemetry partition).
    """

    def __init__(self, facts_partitions: int = 1, pause_partitions: int = 1) -> None:
        self.facts_partitions = facts_partitions
        self.pause_partitions = pause_partitions
        self.stats: Counter[str] = Counter()

    # -- helpers ----------------------------------------------------------------------------
    def _guarded(self, what: str, fn: Callable[[], list]) -> list:
        try:
            return fn()
        except Exception:  # a model bug must not stop the stream for every other entity
            self.stats["processing_errors"] += 1
            log.exception("detection failed on %s", what)
            return []

    def _malformed(self, what: str, raw: bytes, exc: Exception) -> None:
        self.stats["malformed_records"] += 1
        log.warning("skipping a malformed %s record (%d bytes): %s", what, len(raw), exc)

    def anomalies(self, findings: list[Finding], timestamp_ms: int | None = None) -> list[Record]:
        now_ns = time.time_ns()
        return [Record(ANOMALIES, e.dedup_key.encode(), e.SerializeToString(), self._headers(e),
                       timestamp_ms=timestamp_ms)
                for e in (to_event(f, now_ns) for f in findings)]

    def _headers(self, event: ev.AnomalyEvent) -> tuple[tuple[str, bytes], ...]:
        try:
            return tuple(anomaly_headers(event))
        except CloudEventError as exc:  # a finding without kind is a detector bug: still send the anomaly
            self.stats["events_without_cloudevent_headers"] += 1
            log.warning("sending anomaly %s without CloudEvents headers: %s", event.id, exc)
            return ()

    def facts(self, facts: list[Fact], partition: int, timestamp_ms: int | None) -> list[Record]:
        out = []
        for fact in facts:
            key, value = fact_codec.encode(fact)
            out.append(Record(FACTS, key, value, partition=partition % self.facts_partitions,
                              timestamp_ms=timestamp_ms))
        return out

    # -- the stages -----------------------------------------------------------------------
    def on_telemetry(self, raw: bytes, stage: SourceStage, partition: int, timestamp_ms: int | None = None,
                     rebuilding: bool = False) -> list[Record]:
        """Stage 1: one `SourceRecord` of one source."""
        return self.on_telemetry_many([(raw, stage, partition, timestamp_ms)], rebuilding)

    def on_telemetry_many(self, items: list[tuple[bytes, SourceStage, int, int | None]],
                          rebuilding: bool = False) -> list[Record]:
        """Stage 1: records (value, stage, partition, timestamp) as read, each partition's
        through its stage in one `SourceStage.observe_many` (the array work shared)."""
        by_stage: dict[int, tuple[SourceStage, int, list[SourceBatch]]] = {}
        for raw, stage, partition, timestamp_ms in items:
            try:
                batch = to_batch(rec.SourceRecord.FromString(raw))
            except (DecodeError, TelemetryRecordError) as exc:
                self._malformed("telemetry", raw, exc)
                continue
            if not batch.received_ns and timestamp_ms:
                batch.received_ns = timestamp_ms * 1_000_000
            by_stage.setdefault(id(stage), (stage, partition, []))[2].append(batch)
        records: list[Record] = []
        progress: list[SourceProgress] = []
        stamp = None
        for stage, partition, batches in by_stage.values():
            stage.accounting.rebuilding = rebuilding
            try:
                outs = stage.observe_many(batches, self._guarded)
            finally:
                stage.accounting.rebuilding = False
            if rebuilding:
                continue
            for batch, out in zip(batches, outs):
                stamp = batch.received_ns // 1_000_000 or None
                records += self.anomalies(out.findings, stamp)
                changes = out.pause_records
                if changes and isinstance(changes[-1], SourceProgress) \
                        and not changes[-1].cluster and not changes[-1].idle:
                    progress.append(changes[-1])
                    changes = changes[:-1]
                records += self.pause_states(changes, stamp)
                records += self.facts(out.facts, partition, stamp)
        # The partitions' progress last, as one record to each pause-states partition: after
        # every change of the call (all it says is "these came first"), one send for many.
        return records + self.pause_states(merge_progress(progress), stamp)

    def pause_states(self, changes: list[PauseStateChange | SourceProgress], timestamp_ms: int | None) -> list[Record]:
        """Watchdog changes to their cluster's partition; a partition's progress to every one."""
        out = []
        for r in changes:
            value = pause_change_to_json(r)
            if isinstance(r, SourceProgress) and not r.cluster:
                out += [Record(PAUSE_STATES, b"", value, partition=p, timestamp_ms=timestamp_ms)
                        for p in range(self.pause_partitions)]
            else:
                out.append(Record(PAUSE_STATES, _cluster_of(r).encode(), value, timestamp_ms=timestamp_ms))
        return out

    def on_idle(self, stage: SourceStage | None, topic: str, partition: int, partitions: int,
                end_offset: int | None = None) -> list[Record]:
        """Stage 1 of a partition with nothing left to read (before ``end_offset``): the others
        stop waiting for it."""
        fact, progress = stage.idle(end_offset) if stage is not None else \
            partition_idle(topic, partition, partitions, end_offset=end_offset)
        self.stats["idle_partitions_declared"] += 1
        return self.pause_states([progress], None) + self.facts([fact], partition, None)

    def on_pause_state(self, raw: bytes, stage: StormStage, timestamp_ms: int | None = None,
                       rebuilding: bool = False) -> list[Record]:
        """Stage 2: one watchdog change or progress record."""
        try:
            record = pause_change_from_json(raw)
        except RecordError as exc:
            self._malformed("pause-state", raw, exc)
            return []
        stage.accounting.rebuilding = rebuilding
        try:
            found = self._guarded("a pause-state record",
                                  lambda: stage.locate(record, (timestamp_ms or 0) * 1_000_000))
        finally:
            stage.accounting.rebuilding = False
        return [] if rebuilding else self.anomalies(found, timestamp_ms)

    def on_rank_steps(self, raw: bytes, stage: StragglerStage, partition: int, timestamp_ms: int | None = None,
                      rebuilding: bool = False) -> list[Record]:
        """Stage 3: one job's rank steps (held until node health covers them)."""
        try:
            snap = pb.Snapshot.FromString(raw)
        except DecodeError as exc:
            self._malformed("rank-steps", raw, exc)
            return []
        steps = rank_steps_of(snap)
        progress = rank_progress_of(snap)
        received_ns = (timestamp_ms or 0) * 1_000_000
        stage.accounting.rebuilding = rebuilding
        try:
            outs = self._guarded(f"rank steps from {snap.source}",
                                 lambda: [stage.add(steps, snap.cluster, received_ns)]) if steps or not progress else []
            hangs = self._guarded(f"rank progress from {snap.source}",
                                  lambda: stage.add_progress(progress, snap.cluster, received_ns)) if progress else []
        finally:
            stage.accounting.rebuilding = False
        if rebuilding:
            return []
        out = self.anomalies(hangs or [], timestamp_ms)
        if not outs:
            return out
        found, placements = outs[0]
        return self.anomalies(found, timestamp_ms) + out + self.facts(placements, partition, timestamp_ms)

    def on_release(self, stage: StragglerStage, partition: int) -> list[Record]:
        """Stage 3 when the facts' watermark moved: the held steps it now covers."""
        outs = self._guarded("held rank steps", lambda: [stage.release()])
        if not outs:
            return []
        found, placements = outs[0]
        return self.anomalies(found) + self.facts(placements, partition, None)

    def on_partition_ends(self, stage: StormStage, ends_by_stream: dict[str, int]) -> list[Record]:
        """Stage 2 given the end offsets of the idle partitions it asked for (`partition_ends`)."""
        return self.anomalies(self._guarded("partition end offsets", lambda: stage.on_partition_ends(ends_by_stream)))

    def on_timer(self, stage: StormStage, now_ns: int) -> list[Record]:
        """Stage 2 without records: let grace periods expire."""
        return self.anomalies(self._guarded("the cluster timer", lambda: stage.poll(now_ns)))


def merge_progress(progress: list[SourceProgress]) -> list[SourceProgress]:
    """Several telemetry partitions' progress (in the order made) as one record (none: []).

    >>> merge_progress([SourceProgress("", {"t/0": 5}, ("t/0", "t/1")), SourceProgress("", {"t/1": 7}, ("t/0", "t/1")),
    ...                 SourceProgress("", {"t/0": 9}, ("t/0", "t/1"))])
    [SourceProgress(cluster='', through_ns_by_source={'t/0': 9, 't/1': 7}, expect=('t/0', 't/1'), idle=False,
     end_offset=None)]
    """
    if len(progress) <= 1:
        return progress
    through: dict[str, int] = {}
    expect: dict[str, None] = {}
    for p in progress:
        for stream, at_ns in p.through_ns_by_source.items():
            through[stream] = max(at_ns, through.get(stream, at_ns))
        expect.update(dict.fromkeys(p.expect))
    return [SourceProgress("", through, tuple(expect))]


def _cluster_of(record) -> str:
    return record.cluster if hasattr(record, "cluster") else record.entity.cluster
