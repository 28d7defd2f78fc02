"""Benchmark: do the stages keyed by cluster and by job fit one core at 100,000 GPUs?

    python3 bench/join_stages_bench.py [--nodes 12500] [--ranks 100000] [--seconds 20] [--out docs/benchmarks.md]

Stage 2 (storms) sits on the pause-states partition of its cluster and stage 3
(stragglers) on the rank-steps partition of its job: neither spreads over workers as the
cluster grows. This measures each alone, in process, on its worst realistic input at
100,000 GPUs, as CPU-seconds per second of event time:

* **storm stage**, 12,500 nodes: the progress of 12 telemetry partitions (20 records/s
  each, as stage 1 sends them) through a healthy fabric, then the same with a storm whose
  source holds its whole leaf (every port of it changes state: 32 NICs and uplinks) and a
  second storm per second of event time starting and ending elsewhere;
* **straggler stage**, one job on every GPU (100,000 ranks, one step per second: a large
  synchronous job), one rank slowed, released as the facts' watermark passes each step,
  as `streams.straggler_stage` does;
* **hang heartbeats** of that job (every rank every 5 s, in records of one node's 8
  ranks, 20,000 records/s, judged at once), healthy (10 collectives a second), then hung:
  one rank never enters the next collective and every other rank waits inside it for the
  rest of the run, until the hang is named.

Headroom = 1 core / CPU-seconds per second. The target is 5x.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from fabricwatch.machine import cpu_model, usable_cpus
from fabricwatch.models.findings import EntityRef, Evidence
from fabricwatch.models.frames import RankProgress, RankStep
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PauseStateChange
from fabricwatch.models.storm_locator import SourceProgress
from fabricwatch.models.topology import rail_optimised
from fabricwatch.rank import HEARTBEAT_INTERVAL_S
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.facts import FactBook, Progress
from fabricwatch.streams.storm_stage import StormStage
from fabricwatch.streams.straggler_stage import StragglerStage
from report import publish

S = 10**9
PARTITIONS = 12
PROGRESS_PER_S = 20
T0 = 1_767_225_600 * S


def storm_stage_cpu_per_s(nodes: int, seconds: int, storms: bool) -> float:
    topo = rail_optimised("c", n_nodes=nodes, nodes_per_unit=32, n_spines=8)
    stage = StormStage(DetectionConfig(), topo, FactBook(topo))
    streams = tuple(f"t/{p}" for p in range(PARTITIONS))
    nics = topo.nic_ports
    records = []
    for tick in range(seconds * PROGRESS_PER_S):
        at = T0 + tick * S // PROGRESS_PER_S
        if storms and tick % PROGRESS_PER_S == 0:
            second = tick // PROGRESS_PER_S
            source = nics[(second * 7919) % len(nics)]
            leaf_ports = [n for n in nics if n.switch == source.switch]
            # the source NIC pauses its leaf port (held); the leaf pauses every other NIC on it
            changes = [(EntityRef("c", node=source.node, device=source.entity_id.split("/")[0], port="1"), PAUSING),
                       (EntityRef("c", switch=source.switch, port=source.switch_port), PAUSED)]
            changes += [(EntityRef("c", node=n.node, device=n.entity_id.split("/")[0], port="1"), PAUSED)
                        for n in leaf_ports if n is not source]
            for ref, role in changes:
                name = "tx_pause_duty" if role == PAUSING else "rx_pause_duty"
                records.append(PauseStateChange(ref, 3, role, True, at - S // 5, at, [Evidence(name, 0.99, 0.5, "s/s")]))
                records.append(PauseStateChange(ref, 3, role, False, at - S // 5, at + S // 2,
                                                [Evidence(name, 0.0, 0.5, "s/s")]))
        for p in range(PARTITIONS):
            records.append(SourceProgress("", {streams[p]: at}, streams))
    records.sort(key=lambda r: r.at_ns if isinstance(r, PauseStateChange) else
                 next(iter(r.through_ns_by_source.values())))
    c0 = time.process_time()
    for r in records:
        stage.locate(r)
    return (time.process_time() - c0) / seconds


def straggler_stage_cpu_per_s(ranks: int, seconds: int, per_record: int = 8) -> float:
    """One job of ``ranks`` ranks; records of ``per_record`` ranks (one node's) per step."""
    facts = FactBook()
    stage = StragglerStage(DetectionConfig(), facts)
    stage.clock = lambda: 0.0
    records = []
    for step in range(seconds):
        start = T0 + step * S
        for first in range(0, ranks, per_record):
            steps = []
            for rank in range(first, min(ranks, first + per_record)):
                busy = 0.8 * (1.5 if rank == 12345 % ranks and step >= 2 else 1.0)
                steps.append(RankStep("big", rank, ranks, f"n{rank // 8}", rank % 8, step, start, 1.0, busy, 1.0 - busy))
            records.append((start, steps))
    c0 = time.process_time()
    found = 0
    last = None
    for start, steps in records:
        if start != last:                                   # stage 1's progress: 3 s behind the steps
            last = start
            facts.apply(Progress("t", 0, 1, start - 2 * S))
        f, _ = stage.add(steps, "c")
        found += len(f)
    f, _ = stage.flush()
    found += len(f)
    cpu = time.process_time() - c0
    assert found, "the slowed rank was not named"
    return cpu / seconds


def hang_heartbeats_cpu_per_s(ranks: int, seconds: int, hang: bool, per_record: int = 8) -> float:
    """One job of ``ranks`` ranks, each beating every `HEARTBEAT_INTERVAL_S`, spread evenly."""
    stage = StragglerStage(DetectionConfig(), FactBook())
    stage.wall_clock_ns = lambda: T0 + 10**6 * S
    culprit, hang_at = 12345 % ranks, 5 * S
    period = int(HEARTBEAT_INTERVAL_S * S)
    nodes = range(0, ranks, per_record)
    records = []
    for t in range(0, seconds * S, period):
        for i, first in enumerate(nodes):
            at = t + i * period // len(nodes)
            beats = []
            for rank in range(first, min(ranks, first + per_record)):
                n = at * 10 // S                                       # 10 collectives a second
                if hang and at >= hang_at:
                    stop = hang_at * 10 // S
                    entered, completed, last_c = (stop, stop, hang_at) if rank == culprit else (stop + 1, stop, hang_at)
                    last_e = hang_at
                else:
                    entered = completed = n
                    last_e = last_c = at
                beats.append(RankProgress("big", rank, ranks, f"n{rank // 8}", rank % 8, T0 + at, entered, completed,
                                          T0 + last_e, T0 + last_c))
            records.append(beats)
    c0 = time.process_time()
    found = [f for beats in records for f in stage.add_progress(beats, "c")]
    cpu = time.process_time() - c0
    if hang:
        assert [f.entity.rank for f in found if f.state == "open"] == [str(culprit)], found
    else:
        assert not found, found
    return cpu / seconds


def main(args) -> None:
    storm_quiet = statistics.median(storm_stage_cpu_per_s(args.nodes, args.seconds, False) for _ in range(3))
    storm_busy = statistics.median(storm_stage_cpu_per_s(args.nodes, args.seconds, True) for _ in range(3))
    strag = statistics.median(straggler_stage_cpu_per_s(args.ranks, max(6, args.seconds // 4)) for _ in range(3))
    beat_seconds = max(40, args.seconds * 2)
    beats_quiet = statistics.median(hang_heartbeats_cpu_per_s(args.ranks, beat_seconds, False) for _ in range(3))
    beats_hung = statistics.median(hang_heartbeats_cpu_per_s(args.ranks, beat_seconds, True) for _ in range(3))
    rows = [("storm stage, healthy fabric (progress only)", storm_quiet),
            ("storm stage, a storm holding a whole leaf every second", storm_busy),
            (f"straggler stage, one job of {args.ranks:,} ranks at 1 step/s", strag),
            (f"hang heartbeats of that job, healthy ({beat_seconds} s)", beats_quiet),
            (f"hang heartbeats of that job, hung after 5 s ({beat_seconds} s)", beats_hung)]
    report = f"""
### Stages keyed by cluster and by job at 100,000 GPUs ({time.strftime('%Y-%m-%d')})

Command: `python3 bench/join_stages_bench.py --nodes {args.nodes} --ranks {args.ranks} --seconds {args.seconds}`
Machine: {usable_cpus()} vCPU ({cpu_model()}), Python {platform.python_version()}; in process, median of 3.

| stage and input | CPU-s per second of event time | headroom on one core |
|---|---|---|
""" + "\n".join(f"| {name} | {cpu:.3f} | {1 / cpu:.1f}x |" for name, cpu in rows) + "\n"
    publish(report, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=12_500)
    p.add_argument("--ranks", type=int, default=100_000)
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--out")
    main(p.parse_args())
