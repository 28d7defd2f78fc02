"""Drive the simulated cluster: tick, pace to the wall clock, send and/or record."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import yaml

from fabricwatch import metrics

from .sender import GatewaySender, SenderConfig
from .simulator import ClusterSimulator, demo_scenario

log = logging.getLogger("fabricwatch.simulate")


@dataclass(frozen=True)
class SimulationRun:
    nodes: int = 64
    seed: int = 7
    interval_s: float = 1.0
    duration_s: float = 60.0          # simulated seconds; 0 = forever
    realtime: bool = True             # pace ticks to the wall clock
    scenario: str = "demo"            # "demo" (injected faults) | "healthy"
    record_path: str | None = None    # JSON Lines copy of every snapshot
    topology_out: str | None = None


def build_simulator(run: SimulationRun, start_unix_ns: int | None = None) -> ClusterSimulator:
    topology, faults = demo_scenario(n_nodes=run.nodes, seed=run.seed)
    if run.scenario == "healthy":
        faults = ()
    start = start_unix_ns if start_unix_ns is not None else time.time_ns()
    return ClusterSimulator(topology, seed=run.seed, start_unix_ns=start, faults=faults, interval_s=run.interval_s)


async def run_simulation(run: SimulationRun, sender_config: SenderConfig | None) -> Counter:
    from fabricwatch.streams.decode import snapshot_to_json

    sim = build_simulator(run)
    if run.topology_out:
        with open(run.topology_out, "w", encoding="utf-8") as fh:
            yaml.safe_dump(sim.topology.to_dict(), fh, sort_keys=False)
    stats: Counter[str] = Counter()
    stop = asyncio.Event()
    sender = GatewaySender(sender_config) if sender_config else None
    sender_task = asyncio.create_task(sender.run(stop)) if sender else None
    record = open(run.record_path, "w", encoding="utf-8") if run.record_path else None
    ticks = int(run.duration_s / run.interval_s) if run.duration_s else None
    samples = metrics.COLLECTOR_SAMPLES.labels("simulator")
    try:
        i = 0
        while ticks is None or i < ticks:
            snapshots = sim.tick()
            if run.realtime:
                # A tick is stamped at the end of its interval: send it when that moment comes,
                # so event time never runs ahead of the wall clock.
                due_ns = sim.start_unix_ns + int((i + 1) * run.interval_s * 1e9)
                await asyncio.sleep(max(0.0, (due_ns - time.time_ns()) / 1e9))
            else:
                await asyncio.sleep(0)
            samples.inc(len(snapshots))
            for snap in snapshots:
                stats["snapshots"] += 1
                if sender:
                    sender.submit(snap)
                if record:
                    record.write(snapshot_to_json(snap) + "\n")
            i += 1
        if sender:
            stats["drained"] = int(await sender.drain(timeout_s=30))
    finally:
        stop.set()
        if sender_task:
            await sender_task
            stats.update({f"sender_{k}": v for k, v in sender.stats.items()})
        if record:
            record.close()
    return stats
