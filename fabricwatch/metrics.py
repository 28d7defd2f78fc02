"""Every Prometheus metric of fabricwatch, in one place, and the `/metrics` endpoint.

Each process (gateway, worker, collectors, simulator) imports the metrics it moves from
here and serves the default registry with `start_metrics_server` when started with
``--metrics-listen``. Names carry their unit (``_seconds``, ``_bytes``) and counters end
in ``_total``; deploy/grafana/fabricwatch.json and deploy/prometheus/fabricwatch-rules.yml
use exactly these names (tests/test_metrics.py checks that).

Hot paths move metrics per batch or per snapshot, never per counter value: label
children are bound once (``.labels()`` takes a lock and a dict lookup) and stats that a
component already keeps in a `collections.Counter` are mirrored with `CounterMirror`
on a timer instead of being counted twice.

Metrics are grouped by component (gateway, worker, collector, actions) and a process
exposes only the groups it moves (`register_components`): a gateway does not export a
collector's zero ``last_send_timestamp``, which would read as a silent collector.

Default ports of ``--metrics-listen`` given without a value (all on 127.0.0.1;
``METRICS_PORTS`` in fabricwatch/cli.py):

==================  =====
process             port
==================  =====
gateway             9701
worker              9702
collect             9703
collect-switch      9704
simulate            9705
respond             9706
dashboard           9707
feed                9708
==================  =====
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import start_http_server

from fabricwatch.netaddr import is_loopback

# `*_created` series double the series count and no dashboard or rule reads them.
disable_created_metrics()

# What each command exposes; the action layer runs in the worker.
COMMAND_COMPONENTS = {"gateway": ("gateway",), "worker": ("worker", "actions"), "collect": ("collector",),
                      "collect-switch": ("collector",), "simulate": ("collector",), "respond": ("actions",),
                      # process metrics only (CPU, memory, file descriptors) for these two
                      "dashboard": (), "feed": ()}
COMPONENTS: dict[str, list] = {"gateway": [], "worker": [], "collector": [], "actions": []}


def _metric(component: str, cls, name: str, documentation: str, labelnames=(), **kwargs):
    """A metric kept out of any registry until its component is registered."""
    metric = cls(name, documentation, labelnames, registry=None, **kwargs)
    COMPONENTS[component].append(metric)
    return metric


# The reason codes of streams/validate.py, plus the gateway's own refusals (authorisation,
# the broker's record size, a validator failure). Pre-created so that rate() starts from 0
# instead of missing the first rejection.
REJECT_REASONS = (
    "bad_source", "bad_cluster", "bad_source_kind", "timestamp_out_of_range", "too_large",
    "bad_entity_kind", "bad_column_names", "bad_entity_id", "bad_counter_count", "bad_gauge_count",
    "bad_label_column", "too_many_label_columns", "non_finite_gauge", "gauge_out_of_range", "bad_rank_step",
    "rank_step_time_out_of_range", "rank_step_not_allowed", "bad_rank_progress", "rank_progress_time_out_of_range",
    "rank_progress_not_allowed", "rank_progress_not_monotone", "bad_event",
    "source_not_allowed", "too_large_for_kafka", "validation_error",
)
DETECTOR_STAGES = ("telemetry", "pause_states", "rank_steps", "cluster_timer")

# Buckets: Kafka acks=all writes take ms; one snapshot's detection tens of µs to ms;
# event time -> anomaly spans collector linger + gateway + Kafka + worker batching.
KAFKA_WRITE_BUCKETS_S = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
PROCESSING_BUCKETS_S = (.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1)
EVENT_TO_ANOMALY_BUCKETS_S = (.05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 300)

# -- gateway ------------------------------------------------------------------------------
GATEWAY_SNAPSHOTS_RECEIVED = _metric("gateway", Counter,
    "fabricwatch_gateway_snapshots_received_total", "Snapshots received from collectors (before validation).")
GATEWAY_SNAPSHOTS_ACCEPTED = _metric("gateway", Counter,
    "fabricwatch_gateway_snapshots_accepted_total",
    "Snapshots accepted and written to Kafka (possibly with parts dropped).")
GATEWAY_SNAPSHOTS_REJECTED = _metric("gateway", Counter,
    "fabricwatch_gateway_snapshots_rejected_total", "Snapshots refused whole by validation or authorisation.")
GATEWAY_REJECTED_RECORDS = _metric("gateway", Counter,
    "fabricwatch_gateway_rejected_records_total",
    "Snapshots refused or parts of snapshots dropped, by streams/validate.py reason code.", ["reason"])
GATEWAY_RECEIVED_BYTES = _metric("gateway", Counter,
    "fabricwatch_gateway_received_bytes_total", "Serialized size of the received ingest batches.")
GATEWAY_KAFKA_WRITE_SECONDS = _metric("gateway", Histogram,
    "fabricwatch_gateway_kafka_write_seconds", "Time to write one batch's records to Kafka until every ack.",
    buckets=KAFKA_WRITE_BUCKETS_S)
GATEWAY_KAFKA_WRITE_ERRORS = _metric("gateway", Counter,
    "fabricwatch_gateway_kafka_write_errors_total",
    "Batches whose Kafka write failed (not acked; the collector resends).")
GATEWAY_BATCHES_IN_FLIGHT = _metric("gateway", Gauge,
    "fabricwatch_gateway_batches_in_flight", "Batches being validated or written to Kafka right now.")
GATEWAY_UNAUTHENTICATED_STREAMS = _metric("gateway", Counter,
    "fabricwatch_gateway_unauthenticated_streams_total", "Streams and calls refused for a missing or unknown token.")
GATEWAY_CLUSTERS_RESTAMPED = _metric("gateway", Counter,
    "fabricwatch_gateway_clusters_restamped_total",
    "Snapshots whose own cluster field was replaced by their token's (or the gateway's) cluster.")
GATEWAY_RESOURCE_EXHAUSTED = _metric("gateway", Counter,
    "fabricwatch_gateway_resource_exhausted_total",
    "Batches refused with RESOURCE_EXHAUSTED: their token had too many batches or bytes in flight",
    ["bound"])

# -- worker -------------------------------------------------------------------------------
WORKER_RECORDS_CONSUMED = _metric("worker", Counter,
    "fabricwatch_worker_records_consumed_total", "Kafka records consumed by the worker's agents.", ["topic"])
WORKER_DECODE_ERRORS = _metric("worker", Counter,
    "fabricwatch_worker_decode_errors_total",
    "Records skipped by the worker: malformed_record (undecodable) or processing_error (a detector raised).",
    ["reason"])
WORKER_GPU_XIDS = _metric("worker", Counter,
    "fabricwatch_worker_gpu_xids_total",
    "XID events read, by what NVIDIA's Xid catalog makes of them: gpu_fault (opens or updates gpu_xid), "
    "application (a user bug or a solo XID 45: job-level, no anomaly), consequence (XID 45 attached to a fault).",
    ["category"])
WORKER_LATE_SNAPSHOTS = _metric("worker", Counter,
    "fabricwatch_worker_late_snapshots_total", "Snapshots skipped as duplicates or older than the source's last one.")
DETECTOR_PROCESSING_SECONDS = _metric("worker", Histogram,
    "fabricwatch_detector_processing_seconds", "Processing time of one record by a detection stage.", ["stage"],
    buckets=PROCESSING_BUCKETS_S)
DETECTOR_EVENT_TO_ANOMALY_SECONDS = _metric("worker", Histogram,
    "fabricwatch_detector_event_to_anomaly_seconds",
    "Wall clock at emission minus the event time of the sample that confirmed or cleared the anomaly.",
    ["stage"], buckets=EVENT_TO_ANOMALY_BUCKETS_S)
WORKER_OPEN_ANOMALIES = _metric("worker", Gauge,
    "fabricwatch_worker_open_anomalies", "Anomalies open in this worker's detectors.", ["kind", "severity"])
WORKER_ANOMALIES_EMITTED = _metric("worker", Counter,
    "fabricwatch_worker_anomalies_emitted_total", "Anomaly events emitted, by kind and lifecycle.",
    ["kind", "lifecycle"])
WORKER_CONSUMER_LAG = _metric("worker", Gauge,
    "fabricwatch_worker_consumer_lag_messages",
    "Kafka highwater minus the worker's position, per assigned topic partition.", ["topic", "partition"])
WORKER_CHECKPOINT_AGE = _metric("worker", Gauge,
    "fabricwatch_worker_checkpoint_age_seconds",
    "Seconds since this worker last checkpointed its partitions' state to the state topic (NaN: not yet).")
WORKER_CHECKPOINT_BYTES = _metric("worker", Gauge,
    "fabricwatch_worker_checkpoint_bytes", "Compressed size of the last checkpoint of this worker's partitions.")
WORKER_STATE_LOAD_SECONDS = _metric("worker", Histogram,
    "fabricwatch_worker_state_load_seconds",
    "Time to read and restore one partition's checkpoint after it was assigned here.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
WORKER_CAUGHT_UP = _metric("worker", Gauge,
    "fabricwatch_worker_caught_up",
    "1 when every partition assigned here is within the caught-up lag of its end and the facts are read, else 0.")
WORKER_FACTS_WATERMARK_LAG = _metric("worker", Gauge,
    "fabricwatch_worker_facts_watermark_lag_seconds",
    "Wall clock minus the low watermark of stage 1 over every telemetry partition (how far node health trails).")
WORKER_STATE_REFUSED = _metric("worker", Counter,
    "fabricwatch_worker_state_refused_total",
    "Entities refused at a worker state cap (ids come from the senders; a cap keeps id churn from growing "
    "the worker and its checkpoint): sources, nodes, jobs, hang_jobs, hang_ranks, clusters, rate_layouts "
    "(the oldest block layout of a source evicted).",
    ["bound"])
WORKER_HELD_RANK_STEPS = _metric("worker", Gauge,
    "fabricwatch_worker_held_rank_step_records",
    "Rank-step records held until node health covers them (stage 3's event-time join).")
WORKER_REBUILT_RECORDS = _metric("worker", Counter,
    "fabricwatch_worker_rebuilt_records_total",
    "Records folded into detection state from a partition's history (takeover, restart): replayed after a "
    "checkpoint, outputs suppressed in a lookback window.",
    ["topic"])
WORKER_COVERED_RECORDS_SKIPPED = _metric("worker", Counter,
    "fabricwatch_worker_covered_records_skipped_total",
    "Redelivered records skipped because the restored detection state already holds them.", ["topic"])
WORKER_REBUILD_FAILURES = _metric("worker", Counter,
    "fabricwatch_worker_rebuild_failures_total",
    "State rebuilds that stopped early (history unreadable or stalled); detection went on live.", ["topic"])

# -- collectors (node, switch, simulator) and their gateway sender ------------------------
COLLECTOR_SAMPLES = _metric("collector", Counter,
    "fabricwatch_collector_samples_total", "Samples taken, by source (ethtool_pfc, sysfs, nvml, gnmi, simulator...).",
    ["source"])
COLLECTOR_OVERRUNS = _metric("collector", Counter,
    "fabricwatch_collector_overruns_total", "Sampling ticks skipped because the collector fell behind.", ["source"])
COLLECTOR_FIELD_ERRORS = _metric("collector", Counter,
    "fabricwatch_collector_field_errors_total", "Fields that could not be read or parsed, by kind.", ["kind"])
COLLECTOR_BUFFERED_SNAPSHOTS = _metric("collector", Gauge,
    "fabricwatch_collector_buffered_snapshots", "Snapshots waiting for a gateway ack (queued or on the wire).")
COLLECTOR_DROPPED_SNAPSHOTS = _metric("collector", Counter,
    "fabricwatch_collector_dropped_snapshots_total", "Oldest snapshots dropped because the send buffer was full.")
COLLECTOR_RECONNECTS = _metric("collector", Counter,
    "fabricwatch_collector_reconnects_total", "Reconnects after a broken stream, by peer (gateway or switch).",
    ["peer"])
COLLECTOR_SNAPSHOTS_ACKED = _metric("collector", Counter,
    "fabricwatch_collector_snapshots_acked_total", "Snapshots acked by the gateway, by result.", ["result"])
COLLECTOR_LAST_SEND_TIMESTAMP = _metric("collector", Gauge,
    "fabricwatch_collector_last_send_timestamp_seconds",
    "Unix time of the last batch acked by the gateway (the sender's start until the first ack).")

# -- actions (instrumented by the action layer) -------------------------------------------
ACTION_DECISIONS = _metric("actions", Counter,
    "fabricwatch_action_decisions_total", "Action decisions, by action and outcome.", ["action", "outcome"])
GUARD_TRIPS = _metric("actions", Counter,
    "fabricwatch_guard_trips_total", "Guard-rail trips that stopped or held back an action, by guard.", ["guard"])
ALERTS_SENT = _metric("actions", Counter,
    "fabricwatch_alerts_sent_total", "Alerts handed to a sink, by sink and result (ok or failed: SendResult.ok).",
    ["sink", "result"])
ALERTS_DROPPED = _metric("actions", Counter,
    "fabricwatch_alerts_dropped_total", "Alerts dropped from a sink's full backlog (oldest first), by sink.",
    ["sink"])
ALERT_BACKLOG = _metric("actions", Gauge,
    "fabricwatch_alert_backlog", "Alerts waiting in a sink's queue, by sink.", ["sink"])

for _reason in REJECT_REASONS:
    GATEWAY_REJECTED_RECORDS.labels(_reason)
for _result in ("accepted", "rejected"):
    COLLECTOR_SNAPSHOTS_ACKED.labels(_result)
for _stage in DETECTOR_STAGES:
    DETECTOR_PROCESSING_SECONDS.labels(_stage)


WORKER_CHECKPOINT_AGE.set(float("nan"))


def metric_names() -> set[str]:
    """Names of every fabricwatch metric family, as exposed (counters with ``_total``)."""
    return {m._name + "_total" if isinstance(m, Counter) else m._name
            for metrics in COMPONENTS.values() for m in metrics}


_registered: dict[int, set[str]] = {}


def register_components(components, registry: CollectorRegistry = REGISTRY) -> None:
    """Expose the metrics of `components` in `registry` (idempotent)."""
    done = _registered.setdefault(id(registry), set())
    for component in components:
        if component not in COMPONENTS:
            raise ValueError(f"unknown metrics component {component!r} (known: {', '.join(COMPONENTS)})")
        if component in done:
            continue
        for metric in COMPONENTS[component]:
            registry.register(metric)
        done.add(component)


class CounterMirror:
    """Mirrors a stats `collections.Counter` kept elsewhere into a labelled Prometheus counter.

    Call `sync(stats)` on a timer: each key's increase since the last sync is added to
    ``metric.labels(<key mapped by rename>)``. Keys not in ``rename`` are ignored (when it
    is given), so unrelated stats do not leak into the metric.
    """

    def __init__(self, metric: Counter, rename: Mapping[str, str] | None = None) -> None:
        self.metric = metric
        self.rename = dict(rename) if rename is not None else None
        self._seen: dict[str, int] = {}

    def sync(self, stats: Mapping[str, int]) -> None:
        for key, value in list(stats.items()):
            label = key if self.rename is None else self.rename.get(key)
            if label is None:
                continue
            delta = value - self._seen.get(key, 0)
            if delta > 0:
                self.metric.labels(label).inc(delta)
            self._seen[key] = value


# -- the endpoint -------------------------------------------------------------------------
class MetricsEndpoint(NamedTuple):
    host: str
    port: int


_servers: dict[int, object] = {}


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError with the offending text."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics-listen {listen!r}: expected host:port, e.g. 127.0.0.1:9701")
    return host.strip("[]"), int(port)



def start_metrics_server(listen: str = "127.0.0.1:0", *, allow_remote: bool = False,
                         components=tuple(COMPONENTS), registry: CollectorRegistry = REGISTRY) -> MetricsEndpoint:
    """Serve ``/metrics`` (the process and Python metrics, plus `components`) from a daemon
    thread; returns the bound (host, port).

    A non-loopback address is refused unless ``allow_remote``: metrics name nodes,
    switches and jobs, and the endpoint has no authentication.
    """
    host, port = parse_listen(listen)
    if not is_loopback(host) and not allow_remote:
        raise ValueError(f"refusing to serve metrics on {listen}: not a loopback address "
                         "(pass --metrics-allow-remote to expose them to other hosts)")
    register_components(components, registry)
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    bound_port = httpd.server_address[1]
    _servers[bound_port] = httpd
    return MetricsEndpoint(host, bound_port)


def stop_metrics_server(endpoint: MetricsEndpoint) -> None:
    httpd = _servers.pop(endpoint.port, None)
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()
