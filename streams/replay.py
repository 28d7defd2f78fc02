"""Replay a recorded telemetry stream through the detectors, without Kafka.

Input: a recording (`fabricwatch.recording`: binary by default, JSON Lines accepted), one
`Snapshot` per record. Records are validated like at the gateway and processed in event
time: ticks are cut into windows of `WINDOW_S`, and each source's ticks of one window go
through the stages as one record (as a collector's batch would), so the worker's batch
code is what runs; windows go in time order, sources in name order within one. The output
is deterministic: the same file gives the same anomalies, byte for byte.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from google.protobuf import json_format

from fabricwatch.models.findings import Finding
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.recording import read_snapshots

from .decode import pack, rank_progress_of, rank_steps_of, to_batch
from .events import to_event
from .pipeline import DetectionPipeline
from .validate import validate_snapshot

log = logging.getLogger("fabricwatch.replay")
# A source's ticks within one window of event time travel as one record (the node collector
# lingers 2 s on a quiet fabric; storms are handed over tick by tick, which the per-source
# state does not notice). Shorter windows cost speed, longer ones delay the low watermark.
WINDOW_S = 1.0

__all__ = ["ReplayResult", "accepted_in_order", "read_snapshots", "replay", "replay_file", "write_events"]


@dataclass
class ReplayResult:
    events: list[ev.AnomalyEvent] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


def replay(snapshots: Iterable[pb.Snapshot], pipeline: DetectionPipeline, window_s: float = WINDOW_S,
           finish: bool = True) -> ReplayResult:
    """Run snapshots through `pipeline` in event-time order; events carry event times only.

    ``finish``: the input ends here (rank steps still held are released); False when the
    recording is fed in chunks, for every chunk but the last.
    """
    result = ReplayResult()
    ordered = accepted_in_order(snapshots, result.stats)
    window_ns = int(window_s * 1e9)
    findings: list[Finding] = []
    i = 0
    while i < len(ordered):
        end = (ordered[i].time_unix_ns // window_ns + 1) * window_ns
        j = i
        while j < len(ordered) and ordered[j].time_unix_ns < end:
            j += 1
        findings += _window(ordered[i:j], pipeline)
        i = j
    if finish:
        findings += pipeline.finish()
    result.events.extend(to_event(f, emitted_ns=f.detected_ns) for f in findings)
    result.stats.update(pipeline.counters())
    return result


def accepted_in_order(snapshots: Iterable[pb.Snapshot], stats: Counter) -> list[pb.Snapshot]:
    """The snapshots the gateway would accept (problems counted in ``stats``), in event-time order."""
    ordered = []
    for snap in snapshots:
        # No wall-clock window in replay: the recording's own time is the clock.
        verdict = validate_snapshot(snap, now_ns=snap.time_unix_ns)
        stats.update(f"problem:{r}" for r, _ in verdict.problems)
        if verdict.accepted:
            ordered.append(snap)
        else:
            stats["rejected_snapshots"] += 1
    ordered.sort(key=lambda s: (s.time_unix_ns, s.source, s.seq))
    return ordered


def _window(snaps: list[pb.Snapshot], pipeline: DetectionPipeline) -> list[Finding]:
    by_source: dict[str, list[pb.Snapshot]] = {}
    for snap in snaps:
        by_source.setdefault(snap.source, []).append(snap)
    batches = []
    # sources in the order of their first tick (as they would arrive), names breaking ties
    for source in sorted(by_source, key=lambda src: (by_source[src][0].time_unix_ns, src)):
        # rank-step carriers (the rank SDK's) are not ticks of the source; empty ticks are (it is alive)
        ticks = [s for s in by_source[source] if s.blocks or s.events or not (s.rank_steps or s.rank_progress)]
        if ticks:
            batches.append(to_batch(pack(ticks)))
    findings = pipeline.process_batches(batches)
    for snap in snaps:
        if snap.rank_steps:
            findings += pipeline.add_rank_steps(rank_steps_of(snap), snap.cluster)
        if snap.rank_progress:
            findings += pipeline.add_rank_progress(rank_progress_of(snap), snap.cluster)
    return findings


def write_events(events: Iterable[ev.AnomalyEvent], out: TextIO) -> int:
    n = 0
    for event in events:
        out.write(json_format.MessageToJson(event, preserving_proto_field_name=True, indent=None,
                                            sort_keys=True))
        out.write("\n")
        n += 1
    return n


def replay_file(input_path: str | Path, output_path: str | Path, pipeline: DetectionPipeline) -> ReplayResult:
    stats: Counter = Counter()
    with open(input_path, "rb") as fh:
        result = replay(read_snapshots(fh, stats), pipeline)
    result.stats.update(stats)
    with open(output_path, "w", encoding="utf-8") as out:
        write_events(result.events, out)
    return result
