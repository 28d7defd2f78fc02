"""Drive the simulated cluster: tick, pace to the wall clock, send and/or record.

With the collector cadence (the default) the simulated nodes hand their snapshots over as
the node collector does: held for `LINGER_S` of event time and sent together (one gateway
batch, so one Kafka record per node per ~2 s), but at once, with what is held, when a tick
shows a port pausing for at least `node.URGENT_PAUSE_DUTY` of it or an XID (storms reach
the worker within a tick). Switches send each tick, as the gNMI collector does.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import yaml

from fabricwatch import metrics
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.demo import demo_scenario
from fabricwatch.simulator.encoding import COLLECTOR_CADENCE

from .node import URGENT_PAUSE_DUTY
from .sender import GatewaySender, SenderConfig

log = logging.getLogger("fabricwatch.simulate")
# The node collector's `gateway.linger_s`; its hand-over rule is collectors/node.py `PauseWatch`.
LINGER_S = 2.0
CADENCES = ("collector", "uniform")


@dataclass(frozen=True)
class SimulationRun:
    nodes: int = 64
    seed: int = 7
    interval_s: float = 1.0           # uniform cadence only
    duration_s: float = 60.0          # simulated seconds; 0 = forever
    realtime: bool = True             # pace ticks to the wall clock
    scenario: str = "demo"            # "demo" (injected faults) | "healthy"
    record_path: str | None = None    # a recording of every snapshot (fabricwatch.recording)
    topology_out: str | None = None
    cadence: str = "collector"        # "collector" (PFC 100 ms, the rest 1 s, lingering) | "uniform"

    def __post_init__(self) -> None:
        if self.cadence not in CADENCES:
            raise ValueError(f"cadence must be one of {CADENCES}, got {self.cadence!r}")


def build_simulator(run: SimulationRun, start_unix_ns: int | None = None) -> ClusterSimulator:
    topology, faults = demo_scenario(n_nodes=run.nodes, seed=run.seed)
    if run.scenario == "healthy":
        faults = ()
    start = start_unix_ns if start_unix_ns is not None else time.time_ns()
    cadence = COLLECTOR_CADENCE if run.cadence == "collector" else None
    return ClusterSimulator(topology, seed=run.seed, start_unix_ns=start, faults=faults, interval_s=run.interval_s,
                            cadence=cadence)


class Linger:
    """Per source, hold snapshots and hand them over in groups, as the node collector does.

    >>> from fabricwatch.protos.v1 import telemetry_pb2 as pb
    >>> linger = Linger(linger_s=2.0)
    >>> ready = [g for t in range(0, 25) for g in linger.add(pb.Snapshot(source="n1", time_unix_ns=t * 10**8))]
    >>> [len(g) for g in ready], len(linger.flush())
    ([21], 4)
    """

    def __init__(self, linger_s: float = LINGER_S, urgent_pause_fraction: float = URGENT_PAUSE_DUTY) -> None:
        self.linger_ns = int(linger_s * 1e9)
        self.urgent_pause_fraction = urgent_pause_fraction
        self._held: dict[str, list] = {}
        self._last_pause_us: dict[str, list[int]] = {}

    def add(self, snap) -> list[list]:
        """Hold ``snap``; the groups due now (this source's, if it is due)."""
        if snap.source_kind == 2:                       # a switch: every tick goes out
            return [[snap]]
        held = self._held.setdefault(snap.source, [])
        held.append(snap)
        urgent = bool(snap.events) or self._pausing(snap)
        if urgent or snap.time_unix_ns - held[0].time_unix_ns >= self.linger_ns:
            del self._held[snap.source]
            return [held]
        return []

    def _pausing(self, snap) -> bool:
        """A port paused (or paused its peer) for the fraction of the tick since the last one."""
        for block in snap.blocks:
            names = list(block.counter_names)
            cols = [j for j, n in enumerate(names) if n.endswith("_pause_duration")]
            if not cols or len(names) > 16:             # the PFC tick's layout only
                continue
            m = len(names)
            now = [block.counters[i * m + j] for i in range(len(block.entity_ids)) for j in cols]
            before = self._last_pause_us.get(snap.source)
            self._last_pause_us[snap.source] = now
            if before is not None and len(before) == len(now):
                limit_us = self.urgent_pause_fraction * 1e5        # of a 100 ms tick, in microseconds
                return any(b - a >= limit_us for a, b in zip(before, now))
        return False

    def flush(self) -> list:
        """Everything still held, in one list (the end of a run)."""
        out = [s for held in self._held.values() for s in held]
        self._held.clear()
        return out


async def run_simulation(run: SimulationRun, sender_config: SenderConfig | None) -> Counter:
    from fabricwatch.recording import open_recording

    sim = build_simulator(run)
    if run.topology_out:
        with open(run.topology_out, "w", encoding="utf-8") as fh:
            yaml.safe_dump(sim.topology.to_dict(), fh, sort_keys=False)
    stats: Counter[str] = Counter()
    stop = asyncio.Event()
    sender = GatewaySender(sender_config) if sender_config else None
    sender_task = asyncio.create_task(sender.run(stop)) if sender else None
    record_fh, recorder = open_recording(run.record_path) if run.record_path else (None, None)
    linger = Linger() if run.cadence == "collector" else None
    ticks = int(round(run.duration_s / sim.interval_s)) if run.duration_s else None
    samples = metrics.COLLECTOR_SAMPLES.labels("simulator")

    def submit(group) -> None:
        for snap in group:
            sender.submit(snap)

    try:
        i = 0
        while ticks is None or i < ticks:
            snapshots = sim.tick()
            if run.realtime:
                # A tick is stamped at the end of its interval: send it when that moment comes,
                # so event time never runs ahead of the wall clock.
                due_ns = sim.start_unix_ns + int((i + 1) * sim.interval_s * 1e9)
                await asyncio.sleep(max(0.0, (due_ns - time.time_ns()) / 1e9))
            else:
                await asyncio.sleep(0)
            samples.inc(len(snapshots))
            for snap in snapshots:
                stats["snapshots"] += 1
                if recorder:
                    recorder.write(snap)
                if sender:
                    for group in (linger.add(snap) if linger else [[snap]]):
                        submit(group)
            i += 1
        if sender:
            if linger:
                submit(linger.flush())
            stats["drained"] = int(await sender.drain(timeout_s=30))
    finally:
        stop.set()
        if sender_task:
            await sender_task
            stats.update({f"sender_{k}": v for k, v in sender.stats.items()})
        if record_fh:
            record_fh.close()
    return stats
