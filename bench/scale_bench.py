"""Benchmark: worker cores and memory for a cluster at real sampling, projected to 100,000 GPUs.

    python3 bench/scale_bench.py --nodes 512 2048 --seconds 60 [--broker host:port] [--out docs/benchmarks.md]

For each cluster size, all in one run on one broker (a fresh local one unless --broker):

1. **records**: the simulated cluster at the collectors' cadence (PFC counters every 100 ms,
   the rest every second, each node's ticks lingering 2 s and handed over at once when a
   port pauses, as `collectors.run_simulated.Linger` does), cut into Kafka records by the
   gateway's own `split_records`, written to a telemetry topic of its own (a topic prefix
   per run: nothing else is on it). Generated once per size and cached under --cache.
2. **reference**: a bare aiokafka consumer reads the same records, again and again until
   at least 5 CPU-seconds are measured (`kafka_bench.py`): records per CPU-second.
3. **worker**: a `fabricwatch worker` process drains the topic (checkpoints on, as in
   production); its CPU time (utime + stime of the process, from /proc) from its first
   commit to its last gives CPU-seconds per simulated second, hence the cores a cluster of
   that size needs to keep up in real time, and projected linearly to 12,500 nodes
   (100,000 GPUs). The worker's RSS at the end and its last checkpoint (every stage's
   state, compressed, as written to the state topic) per node give the memory and the
   state a node costs; the replay of the same ticks (`streams.pipeline`, no Kafka) is
   timed too.

The cluster runs the demo scenario (a NIC downgrade at 5 s, a PFC storm from 12 to 20 s,
a thermal straggler from 22 s), so the measured path includes findings, not only quiet
screens.

Every phase is repeated --repeats times; medians are reported. The machine is noisy:
compare ratios, not single times.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kafka_bench import REFERENCE_S, broker, reference_rate
from report import publish

REPO = Path(__file__).resolve().parents[1]
NODES_100K_GPUS = 12_500


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def generate(nodes: int, seconds: float, cache: Path) -> tuple[list[tuple[bytes, bytes]], dict]:
    """(key, value) records of the telemetry topic and what they hold; cached per size."""
    path = cache / f"scale-v2-{nodes}n-{int(seconds)}s.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    from fabricwatch.collectors.run_simulated import Linger, SimulationRun, build_simulator
    from fabricwatch.streams import topics
    from fabricwatch.streams.gateway import split_records

    sim = build_simulator(SimulationRun(nodes=nodes, seed=11),
                          start_unix_ns=time.time_ns() - int((seconds + 30) * 1e9))
    linger = Linger()
    records, ticks, node_ticks = [], 0, 0
    t0 = time.perf_counter()
    for _ in range(int(round(seconds / sim.interval_s))):
        for snap in sim.tick():
            del snap.rank_steps[:]
            ticks += 1
            node_ticks += snap.source_kind == 1
            for group in linger.add(snap):
                # telemetry only: the ranks' heartbeats (`rank_progress`) go to their own topic
                records += [(k, v) for topic, k, v in split_records(group) if topic == topics.TELEMETRY]
    info = {"nodes": nodes, "seconds": seconds, "ticks": ticks, "node_ticks": node_ticks, "records": len(records),
            "bytes": sum(len(v) for _, v in records), "generate_s": time.perf_counter() - t0}
    cache.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps((records, info)))
    return records, info


def gateway_cost(nodes: int = 128, seconds: float = 20.0) -> dict:
    """The gateway's work per collector batch, in process: parse the IngestBatch bytes,
    validate every snapshot, cut the Kafka records (gRPC's own per-call cost excluded:
    `pipeline_bench.py` measures the gateway process over gRPC)."""
    from fabricwatch.collectors.run_simulated import Linger, SimulationRun, build_simulator
    from fabricwatch.protos.v1 import telemetry_pb2 as pb
    from fabricwatch.streams.gateway import split_records
    from fabricwatch.streams.validate import validate_snapshot

    start_ns = time.time_ns() - int((seconds + 5) * 1e9)
    # A healthy cluster: the steady state to size for (a storm's ports go out every 100 ms,
    # which multiplies the batches of the nodes it holds while it lasts).
    sim = build_simulator(SimulationRun(nodes=nodes, seed=11, scenario="healthy"), start_unix_ns=start_ns)
    linger, batches = Linger(), []
    for _ in range(int(round(seconds / sim.interval_s))):
        for snap in sim.tick():
            batches += [pb.IngestBatch(snapshots=group).SerializeToString() for group in linger.add(snap)]
    now_ns = time.time_ns()
    t0 = time.process_time()
    records = 0
    for raw in batches:
        batch = pb.IngestBatch.FromString(raw)
        kept = [s for s in batch.snapshots if validate_snapshot(s, now_ns).accepted]
        records += len(split_records(kept, now_ns))
    cpu_s = time.process_time() - t0
    return {"batches": len(batches), "records": records, "us_per_node_s": cpu_s / (nodes * seconds) * 1e6,
            "cores_100k": cpu_s / (nodes * seconds) * NODES_100K_GPUS}


async def load(bootstrap: str, topic: str, records) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20,
                                max_request_size=4 << 20)
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key) for key, value in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def spawn_worker(bootstrap: str, prefix: str, group: str, log: Path, extra=()) -> subprocess.Popen:
    env = {**os.environ, "FABRICWATCH_TOPIC_PREFIX": prefix}
    return subprocess.Popen([sys.executable, "-m", "fabricwatch.cli", "--log-level", "INFO", "worker",
                             "--broker", bootstrap, "--app-id", group, "--stale-after", "0", *extra],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> int:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group, partitions=[TopicPartition(topic, p)
                                                                           for p in range(partitions)])
        return sum(max(0, o.offset) for o in offsets.values() if o is not None)
    except KafkaError:
        return 0
    finally:
        await admin.close()


async def moved_partitions(bootstrap: str, prefix: str, group: str, workdir: Path, timeout_s: float = 120) -> dict:
    """A second worker joins the drained group: how fast the partitions it is given resume
    (each loads its checkpoint from the state topic when assigned)."""
    log = workdir / f"{group}-second.log"
    started = time.monotonic()
    proc = spawn_worker(bootstrap, prefix, group, log)
    try:
        restored: list[float] = []
        while time.monotonic() - started < timeout_s:
            await asyncio.sleep(1.0)
            restored = [float(x) for x in re.findall(r"restored \S+ from its checkpoint .* in ([0-9.]+) s", log.read_text())]
            if len(restored) >= 6:               # half of the 12 telemetry partitions, and some of the others
                break
        return {"partitions": len(restored), "max_load_s": max(restored, default=float("nan")),
                "join_to_resumed_s": time.monotonic() - started}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def worker_run(bootstrap: str, prefix: str, topic: str, partitions: int, n: int, workdir: Path,
                     move: bool = False) -> dict:
    """Drain the topic with one worker; CPU-seconds and RSS from its first to its last commit;
    with ``move``, then a second worker takes half of the partitions."""
    group = f"bench-{uuid.uuid4().hex[:6]}"
    proc = spawn_worker(bootstrap, prefix, group, workdir / f"{group}.log")
    try:
        first = None
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            done = await committed(bootstrap, group, topic, partitions)
            now_cpu, now_rss = cpu_seconds(proc.pid), rss_bytes(proc.pid)
            if done and first is None:
                first = (done, now_cpu, now_rss, time.monotonic())
            if done >= n:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}; see {workdir / f'{group}.log'}")
            await asyncio.sleep(0.5)
        else:
            raise TimeoutError("worker did not drain the topic in 30 min")
        last = (done, now_cpu, now_rss, time.monotonic())
        out = {"records": last[0] - first[0], "cpu_s": last[1] - first[1], "wall_s": last[3] - first[3],
               "rss_start": first[2], "rss_end": last[2]}
        if move:
            out["move"] = await moved_partitions(bootstrap, prefix, group, workdir)
    finally:
        proc.terminate()                         # its shutdown checkpoint holds the drained state
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    written = re.findall(r"checkpointed \d+ partitions: (\d+) bytes", (workdir / f"{group}.log").read_text())
    out["checkpoint_bytes"] = max(map(int, written), default=0)     # the checkpoint of every partition
    return out


def in_process_rate(records) -> float:
    """Ticks per CPU-second of the stages alone (no Kafka, no Faust), over >= REFERENCE_S."""
    from fabricwatch.protos.v1 import records_pb2 as rec
    from fabricwatch.streams.decode import to_batch
    from fabricwatch.streams.pipeline import DetectionPipeline

    ticks, cpu = 0, 0.0
    while cpu < REFERENCE_S:
        pipeline = DetectionPipeline()
        c0 = time.process_time()
        for i in range(0, len(records), 500):
            batches = [to_batch(rec.SourceRecord.FromString(v)) for _, v in records[i:i + 500]]
            pipeline.process_batches(batches)
            ticks += sum(len(b.times_ns) for b in batches)
        cpu += time.process_time() - c0
    return ticks / cpu


async def one_size(bootstrap: str, nodes: int, args, workdir: Path) -> dict:
    from fabricwatch.streams import topics

    records, info = generate(nodes, args.seconds, Path(args.cache))
    print(f"{nodes} nodes: {info['records']} records, {info['ticks']} ticks, {info['bytes'] / 1e6:.0f} MB",
          file=sys.stderr)
    ref, work = [], []
    for r in range(args.repeats):
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        topic = f"{prefix}telemetry.v2"
        specs = [s for s in topics.all_topics()]
        specs = [topics.TopicSpec(s.name.replace(topics.PREFIX, prefix, 1), s.partitions, s.retention_ms,
                                  s.cleanup_policy, segment_ms=s.segment_ms) for s in specs]
        await topics.ensure_topics(bootstrap, specs)
        await load(bootstrap, topic, records)
        ref.append(await reference_rate(bootstrap, topic, len(records)))
        w = await worker_run(bootstrap, prefix, topic, topics.PARTITIONS, len(records), workdir,
                             move=r == args.repeats - 1)
        w["records_per_cpu_s"] = w["records"] / w["cpu_s"]
        work.append(w)
        print(f"  repeat {r + 1}: reference {ref[-1]:,.0f} records/CPU-s; worker {w['records_per_cpu_s']:,.0f} "
              f"records/CPU-s ({w['cpu_s']:.1f} CPU-s, {w['wall_s']:.1f} s wall)", file=sys.stderr)
    inproc = [in_process_rate(records) for _ in range(args.repeats)]
    med = statistics.median
    per_record_cpu = med(w["cpu_s"] / w["records"] for w in work)
    cpu_per_sim_s = per_record_cpu * info["records"] / info["seconds"]
    return {"info": info, "reference": med(ref), "worker": med(w["records_per_cpu_s"] for w in work),
            "cpu_per_sim_s": cpu_per_sim_s, "cores_100k": cpu_per_sim_s * NODES_100K_GPUS / nodes,
            "us_per_tick": per_record_cpu * info["records"] / info["ticks"] * 1e6,
            "inproc_us_per_tick": 1e6 / med(inproc),
            "rss_per_node": med(w["rss_end"] / nodes for w in work),
            "checkpoint_per_node": med(w["checkpoint_bytes"] / nodes for w in work), "runs": work, "refs": ref,
            "move": work[-1].get("move", {})}


def projection(results) -> str:
    """Worker CPU = fixed + per node x nodes, fitted through the sizes run: part of the
    cost (each partition's progress, the facts every worker reads) does not grow with the
    cluster, so the per-size projection overstates it."""
    if len(results) < 2:
        return ""
    xs = [r["info"]["nodes"] for r in results]
    ys = [r["cpu_per_sim_s"] for r in results]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return (f"Fitted: {fixed:.2f} CPU-s/s fixed + {slope * 1e6:.0f} CPU-us/s per node: "
            f"**{fixed + slope * NODES_100K_GPUS:.1f} cores for 12,500 nodes** (100,000 GPUs).")


async def main(args) -> None:
    from fabricwatch.machine import cpu_model, usable_cpus

    workdir = Path(tempfile.mkdtemp(prefix="fw-scale-"))
    async with broker(args.broker, args.kafka_port, workdir) as bootstrap:
        results = [await one_size(bootstrap, n, args, workdir) for n in args.nodes]
    runs = sorted((gateway_cost() for _ in range(args.repeats)), key=lambda g: g["us_per_node_s"])
    gateway = runs[(len(runs) - 1) // 2]
    load_avg = os.getloadavg()
    rows = []
    for r in results:
        i = r["info"]
        rows.append(f"| {i['nodes']:,} | {i['records']:,} | {i['ticks'] / i['records']:.1f} | {r['reference']:,.0f} | "
                    f"{r['worker']:,.0f} | {r['worker'] / r['reference']:.3f} | {r['us_per_tick']:.1f} | "
                    f"{r['inproc_us_per_tick']:.1f} | {r['cpu_per_sim_s']:.2f} | **{r['cores_100k']:.1f}** | "
                    f"{r['rss_per_node'] / 1e3:.0f} | {r['checkpoint_per_node'] / 1e3:.1f} |")
    report = f"""
### Worker cores at real sampling, projected to 100,000 GPUs ({time.strftime('%Y-%m-%d')})

Command: `python3 bench/scale_bench.py --nodes {' '.join(map(str, args.nodes))} --seconds {args.seconds:g} --repeats {args.repeats}`
Machine: {usable_cpus()} vCPU ({cpu_model()}), Python {platform.python_version()}; broker, worker and
generator on this machine; load average after the run {load_avg[0]:.2f} / {load_avg[1]:.2f} / {load_avg[2]:.2f}.
Workload: the simulated cluster (8 GPUs and 8 NICs per node) at the collectors' cadence, {args.seconds:g} s,
records as the gateway writes them (one per node per collector batch).

| nodes | records | ticks/record | reference: raw consume, records/CPU-s | worker, records/CPU-s | ratio | worker µs/tick | stages alone, µs/tick | worker CPU-s per simulated s | cores for 12,500 nodes | worker RSS per node, kB | checkpoint per node, kB |
|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Per repeat: {'; '.join(f"{r['info']['nodes']} nodes: " + ', '.join(f"{w['records'] / w['cpu_s']:,.0f}" for w in r['runs']) for r in results)} records/CPU-s.
{projection(results)}

Gateway, in process (parse the collectors' IngestBatch bytes, validate every snapshot, cut the
Kafka records; a healthy cluster of 128 nodes, 20 s, median of {args.repeats}): {gateway['us_per_node_s']:.0f} CPU-µs per node-second,
**{gateway['cores_100k']:.1f} cores for 12,500 nodes** before gRPC's own per-call cost ({gateway['batches']:,} batches,
{gateway['records']:,} records).

A second worker joining the drained group (the partitions it gets load their checkpoints
when assigned): {'; '.join(f"{r['info']['nodes']} nodes: {r['move'].get('partitions', 0)} partitions resumed, "
                          f"slowest checkpoint load {r['move'].get('max_load_s', float('nan')):.2f} s, "
                          f"{r['move'].get('join_to_resumed_s', float('nan')):.1f} s from its start (process start "
                          f"and the rebalance included)" for r in results)}.
"""
    publish(report, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--broker")
    p.add_argument("--kafka-port", type=int, default=19600)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "fabricwatch-bench"))
    p.add_argument("--out", help="append the markdown report to this file")
    asyncio.run(main(p.parse_args()))
