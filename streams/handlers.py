"""Bytes in, bytes out: what the Faust agents call for each record.

Kept apart from the agents so that tests drive them without Kafka, and so that a
malformed record is counted and skipped here, never raised into the stream loop.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from google.protobuf.message import DecodeError

from fabricwatch.models.findings import Finding
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .cloudevents import CloudEventError, anomaly_headers
from .codec import RecordError, pause_change_from_json, pause_change_to_json
from .events import to_event
from .pipeline import DetectionPipeline

log = logging.getLogger("fabricwatch.worker")


class Record(NamedTuple):
    """One record for a topic: anomalies carry their CloudEvents headers (`streams.cloudevents`)."""

    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


class StageHandlers:
    """The worker's three stages over one shared `DetectionPipeline`."""

    def __init__(self, pipeline: DetectionPipeline) -> None:
        self.pipeline = pipeline
        self.stats: Counter[str] = Counter()

    def _guarded(self, what: str, fn: Callable[[], list[Finding]]) -> list[Finding]:
        try:
            return fn()
        except Exception:  # a model bug must not stop the stream for every other entity
            self.stats["processing_errors"] += 1
            log.exception("detection failed on %s", what)
            return []

    def _decode(self, raw: bytes) -> pb.Snapshot | None:
        try:
            return pb.Snapshot.FromString(raw)
        except DecodeError as exc:
            self.stats["malformed_records"] += 1
            log.warning("skipping a malformed record (%d bytes): %s", len(raw), exc)
            return None

    def events(self, findings: list[Finding]) -> list[Record]:
        now_ns = time.time_ns()
        return [Record(e.dedup_key.encode(), e.SerializeToString(), self._headers(e))
                for e in (to_event(f, now_ns) for f in findings)]

    def _headers(self, event: ev.AnomalyEvent) -> tuple[tuple[str, bytes], ...]:
        try:
            return tuple(anomaly_headers(event))
        except CloudEventError as exc:  # a finding without kind is a detector bug: still send the anomaly
            self.stats["events_without_cloudevent_headers"] += 1
            log.warning("sending anomaly %s without CloudEvents headers: %s", event.id, exc)
            return ()

    def on_snapshot(self, raw: bytes) -> tuple[list[Record], list[Record]]:
        """Stage 1. (anomaly records, pause-state records keyed by cluster)."""
        snap = self._decode(raw)
        if snap is None:
            return [], []
        out = None

        def run() -> list[Finding]:
            nonlocal out
            out = self.pipeline.observe(snap)
            return out.findings

        findings = self._guarded(f"a snapshot of {snap.source}", run)
        changes = out.pause_changes if out else []
        return self.events(findings), [Record(snap.cluster.encode(), pause_change_to_json(c)) for c in changes]

    def on_pause_state(self, raw: bytes) -> list[Record]:
        """Stage 2: the storm locator."""
        try:
            change = pause_change_from_json(raw)
        except RecordError as exc:
            self.stats["malformed_records"] += 1
            log.warning("skipping a malformed pause-state record: %s", exc)
            return []
        return self.events(self._guarded("a pause-state record", lambda: self.pipeline.locate(change)))

    def on_rank_steps(self, raw: bytes) -> list[Record]:
        """Stage 3: the straggler detector."""
        snap = self._decode(raw)
        if snap is None:
            return []
        return self.events(self._guarded(f"rank steps from {snap.source}", lambda: self.pipeline.add_rank_steps(snap)))

    def rebuild_with(self, stage: Callable[[bytes], object]) -> Callable[[bytes], None]:
        """`stage` as a fold for `streams.rebuild`: state moves, nothing is counted, logged or returned."""
        def fold(raw: bytes) -> None:
            self.pipeline.rebuilding = True
            try:
                stage(raw)
            finally:
                self.pipeline.rebuilding = False
        return fold

    def on_timer(self, now_ns: int) -> list[Record]:
        """Let time-based state expire (storm grace periods) when no record arrives."""
        return self.events(self._guarded("the cluster timer", lambda: self.pipeline.tick_cluster(now_ns)))
