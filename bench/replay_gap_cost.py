"""Benchmark: what a takeover sends again, per source-second of a replayed gap.

    python3 bench/replay_gap_cost.py [--nodes 64] [--seconds 30]

A worker that takes over a partition replays the records between its checkpoint and the
dead worker's commit and sends their outputs again (`streams.rebuild`). This runs healthy
simulated nodes at the collectors' cadence, one record per source per second (the
collector's linger), through one partition's stage 1, and counts the outputs by topic:
multiply by the sources of a partition and the checkpoint interval for the worst case.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.encoding import Cadence
from fabricwatch.streams import topics
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.decode import pack
from fabricwatch.streams.facts import FactBook
from fabricwatch.streams.handlers import StageHandlers
from fabricwatch.streams.source_stage import SourceStage


def main(nodes: int, seconds: int) -> None:
    topo = rail_optimised("c", n_nodes=nodes, nodes_per_unit=32, n_spines=4)
    sim = ClusterSimulator(topo, seed=1, cadence=Cadence(), start_unix_ns=time.time_ns(), rank_steps=False)
    stage = SourceStage(DetectionConfig(), topo, FactBook(topo), topics.TELEMETRY, 0, topics.DEFAULT_PARTITIONS)
    handlers = StageHandlers(facts_partitions=topics.DEFAULT_PARTITIONS, pause_partitions=3)
    counts: Counter[str] = Counter()
    out_bytes = sources = 0
    for _ in range(seconds):
        by_source = defaultdict(list)
        for _ in range(round(Cadence().full_interval_s / Cadence().pfc_interval_s)):
            for snap in sim.tick():
                by_source[snap.source].append(snap)
        sources = len(by_source)
        for snaps in by_source.values():
            for r in handlers.on_telemetry(pack(snaps).SerializeToString(), stage, 0, None, False):
                counts[r.topic] += 1
                out_bytes += len(r.value)
    source_seconds = sources * seconds
    print(f"{sources} sources x {seconds} s: outputs {dict(counts)}, {out_bytes} bytes")
    print(f"per source-second: {sum(counts.values()) / source_seconds:.3f} records, {out_bytes / source_seconds:.0f} bytes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=30)
    args = parser.parse_args()
    main(args.nodes, args.seconds)
