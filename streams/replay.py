"""Replay a recorded telemetry stream through the detectors, without Kafka.

Input: JSON Lines, one `Snapshot` per line (proto3 JSON mapping, as `fabricwatch
simulate --record` writes). Records are validated like at the gateway and processed in
event-time order, so the output is deterministic: the same file gives the same anomalies,
byte for byte. Malformed lines are reported with their line number and skipped.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from google.protobuf import json_format

from fabricwatch.models.findings import Finding
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .decode import snapshot_from_json
from .events import to_event
from .pipeline import DetectionPipeline
from .validate import validate_snapshot

log = logging.getLogger("fabricwatch.replay")


@dataclass
class ReplayResult:
    events: list[ev.AnomalyEvent] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


def read_snapshots(lines: Iterable[str], stats: Counter) -> Iterator[pb.Snapshot]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield snapshot_from_json(line)
        except (json_format.ParseError, json.JSONDecodeError, ValueError, TypeError) as exc:
            stats["malformed_lines"] += 1
            if stats["malformed_lines"] <= 10:
                log.warning("line %d: not a Snapshot record: %s", lineno, str(exc)[:200])


def replay(snapshots: Iterable[pb.Snapshot], pipeline: DetectionPipeline) -> ReplayResult:
    """Run snapshots through `pipeline` in event-time order; events carry event times only."""
    result = ReplayResult()
    ordered = []
    for snap in snapshots:
        # No wall-clock window in replay: the recording's own time is the clock.
        verdict = validate_snapshot(snap, now_ns=snap.time_unix_ns)
        result.stats.update(f"problem:{r}" for r, _ in verdict.problems)
        if verdict.accepted:
            ordered.append(snap)
        else:
            result.stats["rejected_snapshots"] += 1
    ordered.sort(key=lambda s: (s.time_unix_ns, s.source, s.seq))
    for snap in ordered:
        findings: list[Finding] = pipeline.process(snap)
        result.events.extend(to_event(f, emitted_ns=f.detected_ns) for f in findings)
    result.stats.update(pipeline.stats)
    return result


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
    with open(input_path, encoding="utf-8", errors="replace") as fh:
        result = replay(read_snapshots(fh, stats), pipeline)
    result.stats.update(stats)
    with open(output_path, "w", encoding="utf-8") as out:
        write_events(result.events, out)
    return result
