"""The worker's metrics that are read rather than counted, refreshed by a Faust timer.

Consumed records per topic come from Faust's own monitor (it counts every message
anyway), decode and processing errors from `StageHandlers.stats`, open anomalies from
`DetectionPipeline.open_anomalies`, and the consumer lag per assigned partition from the
Kafka consumer: highwater minus the position of the stream (the offset after the last
record handed to an agent, or the fetch position before the first one). Reading them
every few seconds costs the stream loop nothing per record.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from pathlib import Path

from fabricwatch import metrics
from fabricwatch.metrics import CounterMirror

from .handlers import StageHandlers
from .pipeline import DetectionPipeline

log = logging.getLogger("fabricwatch.worker")
REFRESH_INTERVAL_S = 5.0
# StageHandlers.stats keys -> `reason` label of fabricwatch_worker_decode_errors_total.
DECODE_ERROR_REASONS = {"malformed_records": "malformed_record", "processing_errors": "processing_error",
                        "events_without_cloudevent_headers": "event_without_headers"}


def checkpoint_age_s(path: Path) -> float:
    """Seconds since the checkpoint file was written; NaN when there is none."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return math.nan


class WorkerMetrics:
    """Call `refresh()` on a timer (`REFRESH_INTERVAL_S`)."""

    def __init__(self, app, handlers: StageHandlers, pipeline: DetectionPipeline,
                 checkpoint_path: Path | None = None) -> None:
        self.app = app
        self.handlers = handlers
        self.pipeline = pipeline
        self._consumed = CounterMirror(metrics.WORKER_RECORDS_CONSUMED)
        self._errors = CounterMirror(metrics.WORKER_DECODE_ERRORS, rename=DECODE_ERROR_REASONS)
        self._open_labels: set[tuple[str, str]] = set()
        self._lag_labels: set[tuple[str, str]] = set()
        if checkpoint_path is not None:
            metrics.WORKER_CHECKPOINT_AGE.set_function(lambda: checkpoint_age_s(checkpoint_path))

    async def refresh(self) -> None:
        self._consumed.sync(self.app.monitor.messages_received_by_topic)
        self._errors.sync(self.handlers.stats)
        self.export_open_anomalies()
        await self.export_lag()

    def export_open_anomalies(self) -> None:
        counts = Counter(self.pipeline.open_anomalies.values())
        for kind, severity in self._open_labels - set(counts):
            metrics.WORKER_OPEN_ANOMALIES.labels(kind, severity).set(0)   # keep the series, at 0
        for (kind, severity), n in counts.items():
            metrics.WORKER_OPEN_ANOMALIES.labels(kind, severity).set(n)
        self._open_labels |= set(counts)

    async def export_lag(self) -> None:
        try:
            lags = await consumer_lag(self.app)
        except Exception as exc:  # between rebalances the consumer may not answer: skip one refresh
            log.debug("consumer lag not available: %s", exc)
            return
        for labels in self._lag_labels - set(lags):          # partitions revoked by a rebalance
            metrics.WORKER_CONSUMER_LAG.remove(*labels)
        for (topic, partition), lag in lags.items():
            metrics.WORKER_CONSUMER_LAG.labels(topic, partition).set(lag)
        self._lag_labels = set(lags)


async def consumer_lag(app) -> dict[tuple[str, str], int]:
    """(topic, partition) -> highwater minus position, for every assigned partition that has one."""
    consumer = app.consumer
    read_offsets = app.monitor.tp_read_offsets      # last offset handed to a stream, per partition
    lags: dict[tuple[str, str], int] = {}
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)
        if highwater is None:                          # nothing fetched from it yet
            continue
        last_read = read_offsets.get(tp)
        position = last_read + 1 if last_read is not None else await consumer.position(tp)
        if position is None:
            continue
        lags[(tp.topic, str(tp.partition))] = max(0, highwater - position)
    return lags
