"""Benchmark: what the congestion-tuning detectors and the fabric report's summary cost.

    python3 bench/switch_costs_bench.py [--nodes 256] [--seconds 30] [--out docs/benchmarks.md]

A simulated rail-optimised fabric (the simulator's gNMI-shaped switch snapshots, 1 s full
ticks and 100 ms PFC ticks as the collectors send them), decoded once. Then, in process,
CPU time (`time.process_time`) per record, median of 3:

* **reference**: decoding the same records (`snapshot_batch`, what every consumer pays);
* stage 1 on the **switch records** with every detector, and again without
  `ecn_pfc_misorder`, `lossless_drop` and `ecmp_imbalance`: the difference is their cost;
* `FabricSummary.add` (the dashboard's `/report` and `fabricwatch report`) on every record,
  and its memory per port (tracemalloc, after the run);
* the dashboard's whole per-record work (`dashboard.feed.apply_record` of the telemetry
  record as the gateway writes it: its own state, then the summary).

Scaled to 100,000 GPUs: about 1,000 switches at one full tick a second (plus PFC ticks)
and 12,500 nodes at 11 records a second.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(__file__))

from report import publish  # noqa: E402

from fabricwatch.simulator.cluster import ClusterSimulator  # noqa: E402
from fabricwatch.simulator.encoding import COLLECTOR_CADENCE  # noqa: E402
from fabricwatch.dashboard.feed import apply_record  # noqa: E402
from fabricwatch.dashboard.state import FabricState  # noqa: E402
from fabricwatch.machine import cpu_model, usable_cpus  # noqa: E402
from fabricwatch.models.ecmp_imbalance import EcmpImbalanceDetector  # noqa: E402
from fabricwatch.models.ecn_pfc_misorder import EcnPfcMisorderDetector  # noqa: E402
from fabricwatch.models.fabric_summary import FabricSummary  # noqa: E402
from fabricwatch.models.lossless_drop import LosslessDropDetector  # noqa: E402
from fabricwatch.models.topology import rail_optimised  # noqa: E402
from fabricwatch.streams.config import DetectionConfig  # noqa: E402
from fabricwatch.streams import topics  # noqa: E402
from fabricwatch.streams.decode import pack, snapshot_batch  # noqa: E402
from fabricwatch.streams.facts import FactBook  # noqa: E402
from fabricwatch.streams.source_stage import SourceStage  # noqa: E402

TUNING = (EcnPfcMisorderDetector, LosslessDropDetector, EcmpImbalanceDetector)
GPUS_100K_SWITCHES = 1_000
GPUS_100K_NODES = 12_500


def snapshots(nodes: int, seconds: float):
    topo = rail_optimised("b", n_nodes=nodes, nodes_per_unit=32, n_spines=8)
    sim = ClusterSimulator(topo, seed=2, cadence=COLLECTOR_CADENCE, rank_steps=False)
    return topo, [s for tick in sim.run(seconds) for s in tick]


def cpu_s(fn) -> float:
    started = time.process_time()
    fn()
    return time.process_time() - started


def stage_cpu(topo, switch_snaps, with_tuning: bool) -> float:
    stage = SourceStage(DetectionConfig(), topo, FactBook(topo))
    if not with_tuning:
        stage.detectors = [d for d in stage.detectors if not isinstance(d, TUNING)]
    batches = [snapshot_batch(s) for s in switch_snaps]
    return cpu_s(lambda: [stage.observe(b) for b in batches])


def main(args) -> None:
    topo, snaps = snapshots(args.nodes, args.seconds)
    switch_snaps = [s for s in snaps if s.source_kind == 2]
    switches = len({s.source for s in switch_snaps})
    decode = statistics.median(cpu_s(lambda: [snapshot_batch(s) for s in switch_snaps]) for _ in range(3))
    full = statistics.median(stage_cpu(topo, switch_snaps, True) for _ in range(3))
    bare = statistics.median(stage_cpu(topo, switch_snaps, False) for _ in range(3))
    tuning_us = (full - bare) / len(switch_snaps) * 1e6
    decode_us = decode / len(switch_snaps) * 1e6

    batches = [snapshot_batch(s) for s in snaps]
    summary_s = []
    for _ in range(3):
        summary = FabricSummary(topo)
        summary_s.append(cpu_s(lambda summary=summary: [summary.add(b) for b in batches]))
    summary_us = statistics.median(summary_s) / len(batches) * 1e6
    tracemalloc.start()
    summary = FabricSummary(topo)
    for b in batches:
        summary.add(b)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_port = held / max(1, len(summary.ports))
    raw = [pack([s]).SerializeToString() for s in snaps]
    dash_s = []
    for _ in range(3):
        state = FabricState(topology=topo)
        dash_s.append(cpu_s(lambda state=state: [apply_record(state, topics.TELEMETRY, r) for r in raw]))
    dash_us = statistics.median(dash_s) / len(raw) * 1e6
    switch_rps = len(switch_snaps) / args.seconds / switches
    node_rps = (len(snaps) - len(switch_snaps)) / args.seconds / args.nodes
    at_scale_tuning = tuning_us * 1e-6 * switch_rps * GPUS_100K_SWITCHES
    records_100k = switch_rps * GPUS_100K_SWITCHES + node_rps * GPUS_100K_NODES
    at_scale_summary = summary_us * 1e-6 * records_100k
    ports_100k = len(summary.ports) / (args.nodes * 8) * 100_000
    load = os.getloadavg()[0]
    report = f"""
### Congestion-tuning detectors and the fabric report's summary ({time.strftime('%Y-%m-%d')})

Command: `python3 bench/switch_costs_bench.py --nodes {args.nodes} --seconds {args.seconds}`
Machine: {usable_cpus()} vCPU ({cpu_model()}), Python {platform.python_version()}, load average {load:.2f};
in process, CPU time, median of 3. {len(snaps):,} records ({len(switch_snaps):,} from {switches} switches,
{switch_rps:.1f} records/s each; nodes {node_rps:.1f} records/s each) at the collectors' cadence.

| what | µs per record | x decoding the same switch records ({decode_us:.0f} µs) | at 100,000 GPUs |
|---|---|---|---|
| `ecn_pfc_misorder` + `lossless_drop` + `ecmp_imbalance`, per switch record | {tuning_us:.0f} | {tuning_us / decode_us:.2f}x | {at_scale_tuning:.3f} cores ({GPUS_100K_SWITCHES:,} switches) |
| `FabricSummary.add`, per record (nodes and switches) | {summary_us:.0f} | {summary_us / decode_us:.2f}x | {at_scale_summary:.2f} cores in the dashboard |
| the dashboard's whole `apply_record` of a telemetry record (its state + the summary) | {dash_us:.0f} | {dash_us / decode_us:.2f}x | {dash_us * 1e-6 * records_100k:.1f} cores ({records_100k:,.0f} records/s) |
| `FabricSummary` memory | {per_port:.0f} B per port ({len(summary.ports):,} ports) | | {ports_100k * per_port / 1e6:.0f} MB for ~{ports_100k:,.0f} ports (capped at 500,000 ports, 4,096 per source) |
"""
    publish(report, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=256)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--out")
    main(p.parse_args())
