"""Bytes in, bytes out: what the Faust agents call for each record.

Kept apart from the agents so that tests drive it without Kafka, and so that a malformed
record is counted and skipped here, never raised into the stream loop.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from google.protobuf.message import DecodeError

from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .events import to_event
from .pipeline import DetectionPipeline

log = logging.getLogger("fabricwatch.worker")


class TelemetryHandler:
    def __init__(self, pipeline: DetectionPipeline) -> None:
        self.pipeline = pipeline
        self.stats: Counter[str] = Counter()

    def on_snapshot(self, raw: bytes) -> list[tuple[bytes, bytes]]:
        """Anomaly events (key, value) caused by one telemetry record."""
        try:
            snap = pb.Snapshot.FromString(raw)
        except DecodeError as exc:
            self.stats["malformed_records"] += 1
            log.warning("skipping a malformed telemetry record (%d bytes): %s", len(raw), exc)
            return []
        try:
            findings = self.pipeline.process(snap)
        except Exception:  # a model bug must not stop the stream for every other node
            self.stats["processing_errors"] += 1
            log.exception("detection failed on a snapshot of %s", snap.source)
            return []
        now_ns = time.time_ns()
        out = []
        for finding in findings:
            event = to_event(finding, now_ns)
            out.append((event.dedup_key.encode(), event.SerializeToString()))
        return out
