"""The worker's metrics that are read rather than counted, refreshed by a Faust timer.

Consumed records per topic come from Faust's own monitor (it counts every message
anyway), decode and processing errors from `StageHandlers.stats`, XIDs by catalog category from the GPU fault detectors, open anomalies from the
stages of the partitions held here, the consumer lag per assigned partition from the
Kafka consumer (highwater minus the position of the stream: the offset after the last
record handed to an agent, or the fetch position before the first one), whether the
worker is caught up (every partition within the caught-up lag and the facts read), how far
node health trails the wall clock, and the rank steps held for it. Reading them every few
seconds costs the stream loop nothing per record.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter

from fabricwatch import metrics
from fabricwatch.metrics import CounterMirror

from .fact_reader import FactReader
from .handlers import StageHandlers
from .partitions import PartitionStates
from .source_stage import SourceStage
from .storm_stage import StormStage
from .straggler_stage import StragglerStage

log = logging.getLogger("fabricwatch.worker")
REFRESH_INTERVAL_S = 5.0
# StageHandlers.stats keys -> `reason` label of fabricwatch_worker_decode_errors_total.
# GpuFaultDetector.stats keys -> `category` label of fabricwatch_worker_gpu_xids_total.
GPU_XID_CATEGORIES = {"xid_gpu_fault": "gpu_fault", "xid_application": "application",
                      "xid_consequence": "consequence"}
DECODE_ERROR_REASONS = {"malformed_records": "malformed_record", "processing_errors": "processing_error",
                        "events_without_cloudevent_headers": "event_without_headers"}


def state_refusals(states: PartitionStates) -> Counter[str]:
    """Entities refused at each state cap, summed over the partitions held here (by bound)."""
    out: Counter[str] = Counter()
    for _, s in states.of_kind(SourceStage):
        out["sources"] += s.stats.get("sources_refused", 0)
        out["nodes"] += s.health.stats.get("nodes_refused", 0)
        out["rate_layouts"] += s.rates.stats.get("layouts_evicted", 0)
    for _, s in states.of_kind(StragglerStage):
        out["jobs"] += s.stats.get("jobs_refused", 0)
        out["hang_jobs"] += s.hangs.stats.get("jobs_refused", 0)
        out["hang_ranks"] += s.hangs.stats.get("ranks_refused", 0)
    for _, s in states.of_kind(StormStage):
        out["clusters"] += s.stats.get("clusters_refused", 0)
    return out


class WorkerMetrics:
    """Call `refresh()` on a timer (`REFRESH_INTERVAL_S`)."""

    def __init__(self, app, handlers: StageHandlers, states: PartitionStates, reader: FactReader,
                 caught_up_lag: int) -> None:
        self.app = app
        self.handlers = handlers
        self.states = states
        self.reader = reader
        self.caught_up_lag = caught_up_lag
        self._consumed = CounterMirror(metrics.WORKER_RECORDS_CONSUMED)
        self._errors = CounterMirror(metrics.WORKER_DECODE_ERRORS, rename=DECODE_ERROR_REASONS)
        self._xids = CounterMirror(metrics.WORKER_GPU_XIDS, rename=GPU_XID_CATEGORIES)
        self._refused = CounterMirror(metrics.WORKER_STATE_REFUSED)
        self._refused_logged: Counter[str] = Counter()
        self._open_labels: set[tuple[str, str]] = set()
        self._lag_labels: set[tuple[str, str]] = set()
        metrics.WORKER_CHECKPOINT_AGE.set_function(lambda: max(0.0, time.time() - states.checkpointed_at_s)
                                                   if not math.isnan(states.checkpointed_at_s) else math.nan)

    async def refresh(self) -> None:
        self._consumed.sync(self.app.monitor.messages_received_by_topic)
        self._errors.sync(self.handlers.stats)
        self._xids.sync(sum((s.gpu_faults.stats for _, s in self.states.of_kind(SourceStage)), Counter()))
        self.export_refusals()
        self.export_open_anomalies()
        lags = await self.export_lag()
        caught_up = self.reader.ready.is_set() and lags is not None and all(
            lag <= self.caught_up_lag for lag in lags.values())
        metrics.WORKER_CAUGHT_UP.set(1 if caught_up else 0)
        wm = self.states.facts.watermark_ns
        metrics.WORKER_FACTS_WATERMARK_LAG.set((time.time_ns() - wm) / 1e9 if wm else math.nan)
        metrics.WORKER_HELD_RANK_STEPS.set(sum(s.held for _, s in self.states.of_kind(StragglerStage)))

    def export_refusals(self) -> None:
        """Counted, and said in the log once per refresh for each cap that refused more."""
        refused = state_refusals(self.states)
        self._refused.sync(refused)
        for bound, n in sorted(refused.items()):
            if n > self._refused_logged[bound]:
                log.warning("state cap %r: %d more refused here (%d in all on the partitions held); "
                            "an id churning sender, or a cluster larger than the cap", bound,
                            n - self._refused_logged[bound], n)
            self._refused_logged[bound] = n

    def export_open_anomalies(self) -> None:
        counts = Counter(self.states.open_anomalies.values())
        for kind, severity in self._open_labels - set(counts):
            metrics.WORKER_OPEN_ANOMALIES.labels(kind, severity).set(0)   # keep the series, at 0
        for (kind, severity), n in counts.items():
            metrics.WORKER_OPEN_ANOMALIES.labels(kind, severity).set(n)
        self._open_labels |= set(counts)

    async def export_lag(self) -> dict[tuple[str, str], int] | None:
        try:
            lags = await consumer_lag(self.app)
        except Exception as exc:  # between rebalances the consumer may not answer: skip one refresh
            log.debug("consumer lag not available: %s", exc)
            return None
        for labels in self._lag_labels - set(lags):          # partitions revoked by a rebalance
            metrics.WORKER_CONSUMER_LAG.remove(*labels)
        for (topic, partition), lag in lags.items():
            metrics.WORKER_CONSUMER_LAG.labels(topic, partition).set(lag)
        self._lag_labels = set(lags)
        return lags


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
