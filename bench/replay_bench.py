"""Benchmark: `fabricwatch replay` throughput, binary recordings against JSON Lines.

    python3 bench/replay_bench.py [--nodes 64] [--seconds 30] [--repeats 3] [--out docs/benchmarks.md]

One simulated recording at the collectors' cadence (the demo scenario: a downgrade, a PFC
storm, a thermal straggler), written once in each format that `replay` reads: the binary
default (``FWREC1``: length-delimited `Snapshot` protobufs) and JSON Lines (protobuf's
JSON, the format of earlier releases, still accepted). Each is replayed `--repeats` times in
this process (`streams.replay.replay_file`: read, validate, every detector, write the
events); CPU time per snapshot, medians. The JSON Lines replay of the same snapshots, in
the same run, is the reference; both must give the same events.

``--baseline-python PY`` also replays the JSON Lines file with another installation (for
example a virtualenv of an earlier release, ``pip install -e`` of its checkout) in a
subprocess, timed inside it the same way: the "faster than release X" figure.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from report import publish


def record(nodes: int, seconds: float, workdir: Path) -> tuple[dict[str, Path], int]:
    from fabricwatch.collectors.run_simulated import SimulationRun, build_simulator
    from fabricwatch.recording import open_recording

    paths = {"binary": workdir / "run.fwrec", "jsonl": workdir / "run.jsonl"}
    writers = [open_recording(str(p)) for p in paths.values()]
    sim = build_simulator(SimulationRun(nodes=nodes, seed=11), start_unix_ns=time.time_ns() - int(seconds * 1e9))
    n = 0
    for _ in range(int(round(seconds / sim.interval_s))):
        for snap in sim.tick():
            n += 1
            for _, w in writers:
                w.write(snap)
    for fh, _ in writers:
        fh.close()
    return paths, n


def replay_cpu(path: Path, workdir: Path) -> tuple[float, list[str]]:
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.streams.replay import replay_file

    out = workdir / (path.name + ".events.jsonl")
    t0 = time.process_time()
    result = replay_file(path, out, DetectionPipeline())
    cpu_s = time.process_time() - t0
    return cpu_s, sorted(e.id for e in result.events)


BASELINE = """
import sys, time
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import replay_file
t0 = time.process_time()
replay_file(sys.argv[1], sys.argv[2], DetectionPipeline())
print(time.process_time() - t0)
"""


def baseline_cpu(python: str, path: Path, workdir: Path) -> float:
    out = subprocess.run([python, "-c", BASELINE, str(path), str(workdir / "baseline.events.jsonl")],
                         check=True, capture_output=True, text=True, cwd=workdir)
    return float(out.stdout.split()[-1])


def main(args) -> None:
    from fabricwatch.machine import cpu_model, usable_cpus

    workdir = Path(tempfile.mkdtemp(prefix="fw-replay-"))
    paths, n = record(args.nodes, args.seconds, workdir)
    runs: dict[str, list[float]] = {k: [] for k in paths}
    ids = {}
    for _ in range(args.repeats):
        for fmt, path in paths.items():
            cpu_s, ids[fmt] = replay_cpu(path, workdir)
            runs[fmt].append(n / cpu_s)
    base = [n / baseline_cpu(args.baseline_python, paths["jsonl"], workdir) for _ in range(args.repeats)] \
        if args.baseline_python else []
    assert ids["binary"] == ids["jsonl"], "the two formats gave different events"
    med = {fmt: statistics.median(r) for fmt, r in runs.items()}
    load = os.getloadavg()
    report = f"""
### Replay throughput ({time.strftime('%Y-%m-%d')})

Command: `python3 bench/replay_bench.py --nodes {args.nodes} --seconds {args.seconds:g} --repeats {args.repeats}{' --baseline-python ' + args.baseline_python if args.baseline_python else ''}`
Machine: {usable_cpus()} vCPU ({cpu_model()}), Python {platform.python_version()}; load average after the run
{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}. Recording: {args.nodes} simulated nodes, {args.seconds:g} s at the
collectors' cadence, {n:,} snapshots, {len(ids['binary'])} events; binary
{paths['binary'].stat().st_size / 1e6:.1f} MB, JSON Lines {paths['jsonl'].stat().st_size / 1e6:.1f} MB.

| format | snapshots per CPU-second (median of {args.repeats}) | ratio to JSON Lines |
|---|---|---|
| JSON Lines (reference, same run) | {med['jsonl']:,.0f} | 1.00 |
| binary `FWREC1` (the default) | {med['binary']:,.0f} | {med['binary'] / med['jsonl']:.2f} |
{baseline_row(base, med)}
Per repeat: binary {', '.join(f'{r:,.0f}' for r in runs['binary'])}; JSON Lines {', '.join(f'{r:,.0f}' for r in runs['jsonl'])}.
"""
    publish(report, args.out)


def baseline_row(base: list[float], med: dict[str, float]) -> str:
    if not base:
        return ""
    b = statistics.median(base)
    return (f"| `--baseline-python`: JSON Lines replayed by that installation | {b:,.0f} | {b / med['jsonl']:.2f} "
            f"(binary is **{med['binary'] / b:.1f}x** faster) |\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-python", help="also replay the JSON Lines file with this interpreter's fabricwatch")
    p.add_argument("--out", help="append the markdown report to this file")
    main(p.parse_args())
