"""`unknown_anomaly` on a long healthy simulated cluster: the worker's alert decision vs others.

`fabricwatch eval`'s healthy runs last 300 s, shorter than the generic detector's warm-up,
so they cannot show its false alarms. This runs one healthy scenario for hours through the
whole pipeline (1 s sampling) and prints the `unknown_anomaly` findings it opened, plus how
often the detector's score per node window reached each level, before and after the
report gate (docs/detectors.md, "Alert decision"):

    python3 bench/unknown_healthy.py --nodes 2 --hours 8 --seed 1000
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from fabricwatch.evaluation.scenarios import Scenario
from fabricwatch.models.unknown import UnknownAnomalyDetector
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import replay

LEVELS = (0.5, 0.8, 0.9)
CHUNK_S = 600  # simulated seconds replayed at a time (bounded memory)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1000)
    args = ap.parse_args(argv)
    sc = Scenario("healthy-long", "healthy", args.seed, args.nodes, 1.0, args.hours * 3600,
                  nodes_per_unit=min(32, args.nodes))
    sim, pipe = sc.simulator(), DetectionPipeline(topology=sc.topology())
    det = next(d for d in pipe.sources.detectors if isinstance(d, UnknownAnomalyDetector))
    scores = defaultdict(list)  # node -> score of each window, in order
    close = det._close_window

    def recording(view, node):
        x = {k: node.sums[k] / node.counts[k] for k in node.sums if node.counts.get(k)}
        if x:  # the same evaluation close() makes (cached per feature), so nothing changes
            scores[view.source].append(node.model.score_one(x))
        return close(view, node)

    det._close_window = recording
    t0, opened = time.perf_counter(), 0
    for _ in range(int(sc.duration_s // CHUNK_S)):
        res = replay([s for tick in sim.run(CHUNK_S) for s in tick], pipe, finish=False)
        opened += sum(e.kind == "unknown_anomaly" and e.lifecycle == ev.LIFECYCLE_OPEN for e in res.events)
    windows = sum(map(len, scores.values()))
    print(f"{args.nodes} nodes x {args.hours:g} h = {sc.node_hours:g} node-hours, {windows} node windows, "
          f"{time.perf_counter() - t0:.0f} s; unknown_anomaly opened: {opened} "
          f"(threshold {det.threshold}, after {det.report_after} windows)")
    for level in LEVELS:
        early = sum(int((np.asarray(v[:det.report_after]) >= level).sum()) for v in scores.values())
        late = sum(int((np.asarray(v[det.report_after:]) >= level).sum()) for v in scores.values())
        print(f"score >= {level}: {early} windows inside the first {det.report_after} of their node, {late} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
