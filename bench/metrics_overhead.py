"""Hot-path cost of the Prometheus instrumentation (fabricwatch/metrics.py), in µs.

    python bench/metrics_overhead.py [--repeat 5]

For each instrumented path: what the metrics add per call (the exact calls the code makes,
timed alone) next to the cost of the path itself, as a share of it:

* gateway, per batch of 64 eight-port node snapshots: `IngestService.ingest` into a
  discarding sink (validation, splitting) vs. its metric calls (ByteSize, counters,
  in-flight gauge, Kafka-write histogram, rejected-reasons loop);
* worker, per snapshot: `DetectionPipeline.observe` vs. its timing and histogram;
* sender, per submitted snapshot: the buffer-depth gauge;
* node collector, per tick: one samples counter per due source.

Best of `--repeat` runs; the first line names the machine (fabricwatch.machine).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import nic_snapshot  # noqa: E402

from fabricwatch import metrics  # noqa: E402
from fabricwatch.protos.v1 import telemetry_pb2 as pb  # noqa: E402
from fabricwatch.streams.gateway import IngestService  # noqa: E402
from fabricwatch.streams.pipeline import DetectionPipeline  # noqa: E402

BATCH = 64


class DiscardSink:
    async def write(self, records) -> None:
        return None


def best_us(fn, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def gateway(repeat: int) -> dict[str, float]:
    service = IngestService(DiscardSink())
    now = time.time_ns()
    batch = pb.IngestBatch(batch_id=1, snapshots=[nic_snapshot(source=f"node-{i:04d}", t_ns=now) for i in range(BATCH)])
    raw = batch.SerializeToString()
    loop = asyncio.new_event_loop()

    def ingest():
        # a fresh copy: validation edits snapshots in place
        loop.run_until_complete(service.ingest(pb.IngestBatch.FromString(raw), None))

    def copy_only():
        pb.IngestBatch.FromString(raw)

    total = best_us(ingest, 200, repeat) - best_us(copy_only, 200, repeat)
    ack = pb.IngestAck(accepted=BATCH)

    def metric_calls():
        metrics.GATEWAY_SNAPSHOTS_RECEIVED.inc(len(batch.snapshots))
        metrics.GATEWAY_RECEIVED_BYTES.inc(batch.ByteSize())
        with metrics.GATEWAY_BATCHES_IN_FLIGHT.track_inprogress():
            started = time.perf_counter()
            metrics.GATEWAY_KAFKA_WRITE_SECONDS.observe(time.perf_counter() - started)
        metrics.GATEWAY_SNAPSHOTS_ACCEPTED.inc(ack.accepted)
        metrics.GATEWAY_SNAPSHOTS_REJECTED.inc(ack.rejected)
        for reason, count in ack.problems_by_reason.items():
            metrics.GATEWAY_REJECTED_RECORDS.labels(reason).inc(count)

    added = best_us(metric_calls, 5000, repeat)
    loop.close()
    return {"gateway_ingest_us_per_batch": total, "gateway_metrics_us_per_batch": added,
            "gateway_bytesize_us_per_batch": best_us(batch.ByteSize, 5000, repeat)}


def pipeline(repeat: int) -> dict[str, float]:
    p = DetectionPipeline()
    t0 = time.time_ns()
    snaps = [nic_snapshot(source="node-0001", t_ns=t0 + i * 10**8, seq=i + 1) for i in range(20_000)]
    it = iter(snaps)
    observe = best_us(lambda: p.observe(next(it)), 4000, min(repeat, 5))
    hist = metrics.DETECTOR_PROCESSING_SECONDS.labels("telemetry")

    def timing():
        started = time.perf_counter()
        hist.observe(time.perf_counter() - started)

    return {"pipeline_observe_us_per_snapshot": observe,
            "pipeline_metrics_us_per_snapshot": best_us(timing, 20000, repeat)}


def small(repeat: int) -> dict[str, float]:
    gauge = metrics.COLLECTOR_BUFFERED_SNAPSHOTS
    sample = metrics.COLLECTOR_SAMPLES.labels("ethtool_pfc")
    return {"sender_metrics_us_per_submit": best_us(lambda: gauge.set(17), 50000, repeat),
            "collector_metrics_us_per_source_tick": best_us(sample.inc, 50000, repeat),
            "labels_lookup_us": best_us(lambda: metrics.COLLECTOR_SAMPLES.labels("sysfs"), 50000, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from fabricwatch.machine import cpu_model, usable_cpus

    results = {**gateway(args.repeat), **pipeline(args.repeat), **small(args.repeat)}
    print(f"# {cpu_model()}, {usable_cpus()} usable CPUs, Python {sys.version.split()[0]}")
    for key, v in results.items():
        print(f"{key:42s} {v:10.2f}")
    print(f"{'gateway_metrics_share_pct':42s} "
          f"{100 * results['gateway_metrics_us_per_batch'] / results['gateway_ingest_us_per_batch']:10.2f}")
    print(f"{'pipeline_metrics_share_pct':42s} "
          f"{100 * results['pipeline_metrics_us_per_snapshot'] / results['pipeline_observe_us_per_snapshot']:10.2f}")


if __name__ == "__main__":
    main()
