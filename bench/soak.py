"""Soak: the whole stack at a sustained rate for a long time; are memory and latency flat?

    python3 bench/soak.py --nodes 150 --minutes 30 [--out docs/benchmarks.md]

Starts a fresh local broker, a gateway, a worker and a responder (shadow mode, the example
policy) as their own processes, then streams a simulated healthy cluster through the
gateway at one snapshot per node per second, with a NIC link flipping between 400G and
200G on a few nodes every 10 s so that anomalies open and resolve all the time. Every
minute it records the snapshots sent, the latency from each flipped sample's timestamp to
its anomaly on the topic (p50/p99), and the RSS of each process (from /proc). The report
compares the first and the last minute. Not part of CI: it runs as long as you ask.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bench import free_port, pct, spawn  # noqa: E402

from fabricwatch.collectors.run_simulated import SimulationRun, build_simulator  # noqa: E402
from fabricwatch.collectors.sender import GatewaySender, SenderConfig  # noqa: E402
from fabricwatch.localkafka import LocalKafka  # noqa: E402
from fabricwatch.machine import cpu_model, usable_cpus  # noqa: E402
from fabricwatch.protos.v1 import events_pb2 as ev  # noqa: E402
from fabricwatch.protos.v1 import telemetry_pb2 as pb  # noqa: E402
from fabricwatch.streams import topics  # noqa: E402

FLIP_EVERY_TICKS = 10
FLIP_NODES = 4


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def soak(args, workdir: Path) -> list[dict]:
    from aiokafka import AIOKafkaConsumer

    kafka = LocalKafka(port=args.kafka_port, state_dir=workdir / "kafka")
    bootstrap = kafka.start()
    procs = {}
    try:
        await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
        listen = f"127.0.0.1:{free_port()}"
        procs["gateway"] = spawn("gateway", "--broker", bootstrap, "--listen", listen, log=workdir / "gateway.log")
        ready = workdir / "worker.ready"
        procs["worker"] = spawn("worker", "--broker", bootstrap, "--state-dir", str(workdir),
                                log=workdir / "worker.log", env={"FABRICWATCH_WORKER_READY_FILE": str(ready)})
        procs["responder"] = spawn("respond", "--broker", bootstrap, log=workdir / "respond.log")
        while not ready.exists():
            await asyncio.sleep(0.2)
        consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=bootstrap, group_id=None,
                                    auto_offset_reset="latest")
        await consumer.start()
        sim = build_simulator(SimulationRun(nodes=args.nodes, seed=3, scenario="healthy"),
                              start_unix_ns=time.time_ns())
        sender = GatewaySender(SenderConfig(target=listen, max_batch=64, max_in_flight=16, max_buffered=10**6))
        stop = asyncio.Event()
        sender_task = asyncio.create_task(sender.run(stop))
        flipped: set[int] = set()
        minutes: list[dict] = [{"sent": 0, "latencies": []}]

        async def read() -> None:
            while not stop.is_set():
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    arrived = time.time_ns()
                    for r in records:
                        e = ev.AnomalyEvent.FromString(r.value)
                        if e.kind == "link_downgrade" and e.detected_unix_ns in flipped:
                            minutes[-1]["latencies"].append((arrived - e.detected_unix_ns) / 1e9)

        reader = asyncio.create_task(read())
        t0 = time.monotonic()
        next_minute = t0 + 60
        tick = 0
        while time.monotonic() - t0 < args.minutes * 60:
            now = time.time_ns()
            down = (tick // FLIP_EVERY_TICKS) % 2 == 1
            for k, snap in enumerate(s for s in sim.tick() if s.source_kind == pb.SOURCE_KIND_NODE):
                del snap.rank_steps[:]
                snap.time_unix_ns = now
                if k < FLIP_NODES and tick % FLIP_EVERY_TICKS == 0 and tick:
                    nic = next(b for b in snap.blocks if b.entity_kind == pb.ENTITY_KIND_NIC_PORT)
                    rate = next(c for c in nic.labels if c.name == "rate")
                    rate.values[0] = "200 Gb/sec (4X HDR)" if down else "400 Gb/sec (4X NDR)"
                    flipped.add(now)
                sender.submit(snap)
                minutes[-1]["sent"] += 1
            tick += 1
            await asyncio.sleep(max(0.0, t0 + tick - time.monotonic()))
            if time.monotonic() >= next_minute:
                minutes[-1]["rss"] = {name: rss_mib(p.pid) for name, p in procs.items()}
                pid_file = kafka.data_dir / "kafka.pid"
                minutes[-1]["rss"]["broker"] = rss_mib(int(pid_file.read_text())) if pid_file.exists() else float("nan")
                minutes[-1]["buffered"] = sender.buffered
                print(f"minute {len(minutes)}: sent {minutes[-1]['sent']}, latency p50 "
                      f"{pct(minutes[-1]['latencies'], .5):.3f} s, rss {minutes[-1]['rss']}", file=sys.stderr)
                minutes.append({"sent": 0, "latencies": []})
                next_minute += 60
        stop.set()
        await sender_task
        await reader
        await consumer.stop()
        return [m for m in minutes if "rss" in m]
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
        kafka.stop()


def report(args, minutes: list[dict]) -> str:
    lines = [f"\n## Soak ({time.strftime('%Y-%m-%d')}): {args.nodes} nodes at 1 snapshot/node/s for {args.minutes} min\n",
             f"Command: `python3 bench/soak.py --nodes {args.nodes} --minutes {args.minutes}`; machine: "
             f"{cpu_model()}, {usable_cpus()} usable CPUs; broker, gateway, worker, responder and the load "
             f"generator on the same machine.\n",
             "| minute | snapshots | latency p50 (s) | latency p99 (s) | gateway RSS (MiB) | worker RSS | "
             "responder RSS | broker RSS | sender buffer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, m in enumerate(minutes, 1):
        rss = m["rss"]
        lines.append(f"| {i} | {m['sent']} | {pct(m['latencies'], .5):.3f} | {pct(m['latencies'], .99):.3f} | "
                     f"{rss['gateway']:.0f} | {rss['worker']:.0f} | {rss['responder']:.0f} | {rss['broker']:.0f} | "
                     f"{m['buffered']} |")
    first, last = minutes[0], minutes[-1]
    all_lat = [x for m in minutes for x in m["latencies"]]
    lines.append(f"\nFirst vs last minute: latency p50 {pct(first['latencies'], .5):.3f} -> "
                 f"{pct(last['latencies'], .5):.3f} s, p99 {pct(first['latencies'], .99):.3f} -> "
                 f"{pct(last['latencies'], .99):.3f} s; worker RSS {first['rss']['worker']:.0f} -> "
                 f"{last['rss']['worker']:.0f} MiB, gateway {first['rss']['gateway']:.0f} -> "
                 f"{last['rss']['gateway']:.0f} MiB, responder {first['rss']['responder']:.0f} -> "
                 f"{last['rss']['responder']:.0f} MiB. Whole run: {len(all_lat)} flips measured, p50 "
                 f"{statistics.median(all_lat) if all_lat else float('nan'):.3f} s, p99 {pct(all_lat, .99):.3f} s.\n")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=150)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--kafka-port", type=int, default=19700)
    p.add_argument("--out", help="append the markdown report to this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fabricwatch-soak-") as tmp:
        minutes = asyncio.run(soak(args, Path(tmp)))
    text = report(args, minutes)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
