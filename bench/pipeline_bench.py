"""Benchmark: gateway -> Kafka -> worker throughput and latency, against raw aiokafka.

    python3 bench/pipeline_bench.py --nodes 512 --ticks 20 [--broker host:port] [--out docs/benchmarks.md]

Phases, all in one run on one broker (a fresh local one unless --broker):

1. reference: the same records produced straight to a topic, then consumed by a bare
   aiokafka consumer (no decoding), re-read until 5 CPU-seconds are measured
   (`kafka_bench.py`): the physical ceiling of this machine, per CPU-second.
2. worker: the snapshots pre-loaded into the telemetry topic, then a `fabricwatch worker`
   process (Faust, decode, rates, all detectors) drains them; throughput from its
   committed offsets. Ratio worker / raw is the cost of everything we add.
3. gateway: the snapshots sent by the collector sender over gRPC (TLS off, loopback) to a
   `fabricwatch gateway` process, acked after the Kafka write.
4. latency: the worker running and caught up, snapshots sent at a fixed rate with fresh
   timestamps; a link flips between 400G and 200G on some nodes at every full tick (the
   simulator samples at the collectors' cadence: PFC-only ticks carry no rate), and the
   time from each flipping sample's timestamp to its anomaly on the topic is measured.
   The sender is driven directly: the node collector's linger (`--collector-linger`,
   urgent ticks excepted) comes on top.

Snapshots are ticks at the collectors' cadence (10 PFC-only per full one), so the
throughput columns mix small and full snapshots; `scale_bench.py` measures the worker
per node-second at scale.

Every phase is repeated `--repeats` times and the median reported; the machine is noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from fabricwatch.collectors.run_simulated import SimulationRun, build_simulator
from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.machine import cpu_model, usable_cpus
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams import topics
from fabricwatch.streams.decode import pack
from kafka_bench import broker, reference_rate
from report import publish

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(nodes: int, ticks: int) -> list[pb.Snapshot]:
    sim = build_simulator(SimulationRun(nodes=nodes, seed=11, scenario="healthy"),
                          start_unix_ns=time.time_ns() - (ticks + 5) * 10**9)
    snaps = []
    for _ in range(ticks):
        snaps += [s for s in sim.tick() if s.source_kind == pb.SOURCE_KIND_NODE]
    for s in snaps:
        del s.rank_steps[:]    # the telemetry topic carries counters only
    return snaps


def values_in(snap: pb.Snapshot) -> int:
    return sum(len(b.entity_ids) * (len(b.counter_names) + len(b.gauge_names)) for b in snap.blocks)


async def produce(bootstrap: str, topic: str, snaps: list[pb.Snapshot]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1 << 20)
    await producer.start()
    try:
        # as the gateway writes them: one `SourceRecord` per collector batch (here one tick)
        futures = [await producer.send(topic, pack([s]).SerializeToString(), key=s.source.encode()) for s in snaps]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def spawn(*argv: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fabricwatch.cli", *argv], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


TELEMETRY_TPS = [TopicPartition(topics.TELEMETRY, p) for p in range(topics.SPECS[topics.TELEMETRY].partitions)]


async def committed_total(bootstrap: str, group: str, tps: list[TopicPartition] = TELEMETRY_TPS) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group, partitions=tps)
        return sum(max(0, o.offset) for o in offsets.values() if o is not None)
    except KafkaError:   # the group (or the offsets topic) does not exist yet
        return 0
    finally:
        await admin.close()


async def worker_rate(bootstrap: str, snaps: list[pb.Snapshot], workdir: Path) -> float:
    """Pre-load the telemetry topic, start a worker, time it from first to last commit."""
    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    end_before = await end_offsets(bootstrap)
    await produce(bootstrap, topics.TELEMETRY, snaps)
    group = f"bench-{uuid.uuid4().hex[:6]}"
    ready = workdir / f"{group}.ready"
    proc = spawn("worker", "--broker", bootstrap, "--app-id", group, log=workdir / f"{group}.log",
                 env={"FABRICWATCH_WORKER_READY_FILE": str(ready)})
    target = sum(end_before.values()) + len(snaps)
    try:
        samples = []   # (time, committed)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = await committed_total(bootstrap, group)
            samples.append((time.perf_counter(), done))
            if done >= target:
                break
            await asyncio.sleep(0.25)
        else:
            raise TimeoutError("worker did not catch up in 600 s")
        # from the first commit that moved past what existed before this phase to the last
        base = sum(end_before.values())
        moving = [(t, c) for t, c in samples if c > base]
        (t0, c0), (t1, c1) = moving[0], moving[-1]
        return (c1 - c0) / (t1 - t0)
    finally:
        proc.terminate()
        proc.wait(30)


async def end_offsets(bootstrap: str) -> dict:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topics.TELEMETRY, p) for p in range(topics.SPECS[topics.TELEMETRY].partitions)]
        return await consumer.end_offsets(tps)
    finally:
        await consumer.stop()


def restamp(snaps: list[pb.Snapshot], t_ns: int) -> None:
    for s in snaps:
        s.time_unix_ns = t_ns
        s.seq += 1


async def gateway_rate(listen: str, snaps: list[pb.Snapshot]) -> float:
    sender = GatewaySender(SenderConfig(target=listen, max_batch=64, max_in_flight=16, max_buffered=10**7))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        restamp(snaps, time.time_ns())
        by_source: dict[str, int] = {}
        for s in snaps:   # strictly increasing time per source, as a collector sends
            by_source[s.source] = by_source.get(s.source, 0) + 1
            s.time_unix_ns += by_source[s.source] * 1000
        t0 = time.perf_counter()
        for s in snaps:
            sender.submit(s)
        assert await sender.drain(600), "gateway did not ack everything"
        assert sender.stats["rejected"] == 0, sender.stats
        return len(snaps) / (time.perf_counter() - t0)
    finally:
        stop.set()
        await task


# Flips sampled this soon after the first sample are the start-up transient: every source is
# new to the worker (its layouts, rate trackers and baselines are built on its first
# records), so the first seconds queue up and drain; they are reported apart.
WARM_UP_S = 5.0


async def latency(bootstrap: str, listen: str, workdir: Path, nodes: int, rate_per_s: float,
                  seconds: float) -> list[tuple[float, float]]:
    """Per flip: (seconds from the first sample to the flipping one, latency in s from the
    sample's timestamp to the anomaly record's arrival)."""
    group = f"bench-lat-{uuid.uuid4().hex[:6]}"
    ready = workdir / f"{group}.ready"
    proc = spawn("worker", "--broker", bootstrap, "--app-id", group, log=workdir / f"{group}.log",
                 env={"FABRICWATCH_WORKER_READY_FILE": str(ready)})
    # Ready (its first rebalance done: with an empty topic nothing is committed to wait on),
    # then caught up from the beginning of the topic.
    deadline = time.monotonic() + 120
    while not ready.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"worker not ready; see {workdir / f'{group}.log'}")
        await asyncio.sleep(0.2)
    target = sum((await end_offsets(bootstrap)).values())
    while await committed_total(bootstrap, group) < target:
        await asyncio.sleep(0.5)
    sim = build_simulator(SimulationRun(nodes=nodes, seed=5, scenario="healthy"), start_unix_ns=time.time_ns())
    consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="latest")
    await consumer.start()
    sender = GatewaySender(SenderConfig(target=listen, max_batch=64, max_in_flight=16, max_buffered=10**7))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    sent_flips: dict[tuple[str, int], int] = {}
    latencies: list[tuple[float, float]] = []
    first_sample_ns = time.time_ns()

    async def read() -> None:
        while not stop.is_set():
            for records in (await consumer.getmany(timeout_ms=200)).values():
                arrived = time.time_ns()
                for r in records:
                    e = ev.AnomalyEvent.FromString(r.value)
                    if e.kind == "link_downgrade" and e.entity.node and e.detected_unix_ns in sent_flips.values():
                        latencies.append(((e.detected_unix_ns - first_sample_ns) / 1e9,
                                          (arrived - e.detected_unix_ns) / 1e9))

    reader = asyncio.create_task(read())
    try:
        flip_nodes = max(1, nodes // 8)
        per_tick = nodes
        ticks = int(seconds * rate_per_s / per_tick)
        interval = per_tick / rate_per_s
        t_start = time.monotonic()
        full_ticks: dict[str, int] = {}
        for i in range(ticks):
            snaps = [s for s in sim.tick() if s.source_kind == pb.SOURCE_KIND_NODE]
            now = time.time_ns()
            # Fresh timestamps (the simulated nodes' clock skews dropped); a source's second
            # snapshot of a tick (a full tick's PFC-only and full reads) 1 µs later, so that
            # the two are not taken for duplicates.
            seen: dict[str, int] = {}
            for k, s in enumerate(snaps):
                del s.rank_steps[:]
                n = seen[s.source] = seen.get(s.source, -1) + 1
                s.time_unix_ns = now + n * 1000
                rate = next((c for b in s.blocks if b.entity_kind == pb.ENTITY_KIND_NIC_PORT
                             for c in b.labels if c.name == "rate"), None)
                if k < flip_nodes and rate is not None:     # full ticks only: PFC-only ticks carry no rate
                    full = full_ticks[s.source] = full_ticks.get(s.source, 0) + 1
                    rate.values[0] = "200 Gb/sec (4X HDR)" if full % 2 else "400 Gb/sec (4X NDR)"
                    if full > 2:
                        sent_flips[(s.source, i)] = s.time_unix_ns
                sender.submit(s)
            await asyncio.sleep(max(0.0, t_start + (i + 1) * interval - time.monotonic()))
        await sender.drain(60)
        await asyncio.sleep(5)
    finally:
        stop.set()
        await task
        await reader
        await consumer.stop()
        proc.terminate()
        proc.wait(30)
    return latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def main(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    async with broker(args.broker, args.kafka_port, workdir) as bootstrap:
        listen = f"127.0.0.1:{free_port()}"
        gateway = spawn("gateway", "--broker", bootstrap, "--listen", listen, log=workdir / "gateway.log")
        try:
            print(f"generating {args.nodes} nodes x {args.ticks} ticks ...", file=sys.stderr)
            snaps = generate(args.nodes, args.ticks)
            n = len(snaps)
            values = statistics.mean(values_in(s) for s in snaps)
            size = statistics.mean(len(s.SerializeToString()) for s in snaps)
            raw, work, gw = [], [], []
            await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
            for r in range(0 if args.latency_only else args.repeats):
                topic = f"bench.raw.{uuid.uuid4().hex[:6]}"
                await topics.ensure_topics(bootstrap, [topics.TopicSpec(topic, partitions=12, retention_ms=3600_000)])
                await produce(bootstrap, topic, snaps)
                raw.append(await reference_rate(bootstrap, topic, n))
                work.append(await worker_rate(bootstrap, snaps, workdir))
                gw.append(await gateway_rate(listen, snaps))
                print(f"repeat {r + 1}: raw {raw[-1]:.0f}/s worker {work[-1]:.0f}/s gateway {gw[-1]:.0f}/s",
                      file=sys.stderr)
            lat_rate = args.latency_rate or 0.5 * min(statistics.median(work), statistics.median(gw))
            flips = await latency(bootstrap, listen, workdir, args.nodes, lat_rate, args.latency_seconds)
        finally:
            gateway.terminate()
            gateway.wait(30)
    med = statistics.median
    lat = [late for _, late in flips]
    steady = [late for at, late in flips if at >= WARM_UP_S]
    warm_up = [late for at, late in flips if at < WARM_UP_S]
    throughput = "" if args.latency_only else f"""Workload: {n} node snapshots from the simulator ({args.nodes} nodes x 8 GPUs x 8 NICs x {args.ticks} ticks),
{values:.0f} counter/gauge values and {size / 1024:.1f} KiB per snapshot.

| measure (median of {args.repeats}) | node snapshots/s | values/s | ratio to raw consume |
|---|---|---|---|
| raw aiokafka consume of the same records (reference) | {med(raw):,.0f} | {med(raw) * values:,.0f} | 1.00 |
| worker: Faust + decode + rates + detectors | {med(work):,.0f} | {med(work) * values:,.0f} | {med(work) / med(raw):.3f} |
| gateway: gRPC ingest + validation + Kafka write (acked) | {med(gw):,.0f} | {med(gw) * values:,.0f} | {med(gw) / med(raw):.3f} |

Per-repeat: raw {', '.join(f'{x:,.0f}' for x in raw)}; worker {', '.join(f'{x:,.0f}' for x in work)};
gateway {', '.join(f'{x:,.0f}' for x in gw)}.
"""
    report = f"""
### Pipeline throughput and latency ({time.strftime('%Y-%m-%d')})

Command: `python3 bench/pipeline_bench.py --nodes {args.nodes} {"" if args.latency_only else
        f"--ticks {args.ticks} --repeats {args.repeats} "}{f"--latency-rate {args.latency_rate:g} " if args.latency_rate else ""}{
        f"--latency-seconds {args.latency_seconds:g}"}{" --latency-only" if args.latency_only else ""}`
Machine: {usable_cpus()} vCPU ({cpu_model()}), Python {platform.python_version()},
broker, gateway, worker and load generator all on this machine; load average after the run
{os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} / {os.getloadavg()[2]:.2f}.
{throughput}
End-to-end latency at {lat_rate:,.0f} snapshots/s sent through the gateway (sample timestamp
-> anomaly record received from the anomalies topic), {len(lat)} link flips:
p50 **{pct(lat, 0.5) * 1000:.0f} ms**, p99 **{pct(lat, 0.99) * 1000:.0f} ms**, max {max(lat, default=float('nan')) * 1000:.0f} ms.
After the first {WARM_UP_S:g} s ({len(steady)} flips): p50 **{pct(steady, 0.5) * 1000:.0f} ms**, p99
**{pct(steady, 0.99) * 1000:.0f} ms**, max {max(steady, default=float('nan')) * 1000:.0f} ms; the {len(warm_up)} flips of the first
{WARM_UP_S:g} s, while every source is new to the worker: max {max(warm_up, default=float('nan')) * 1000:.0f} ms.
"""
    publish(report, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--ticks", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--broker")
    p.add_argument("--kafka-port", type=int, default=19500)
    p.add_argument("--latency-rate", type=float, default=0, help="snapshots/s for the latency phase (default: half the measured max)")
    p.add_argument("--latency-seconds", type=float, default=20)
    p.add_argument("--latency-only", action="store_true", help="skip the throughput phases (needs --latency-rate)")
    p.add_argument("--out", help="append the markdown report to this file")
    asyncio.run(main(p.parse_args()))
