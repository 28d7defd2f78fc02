"""JSON encoding of the records that pass between the worker's stages.

Two records travel on the pause-states topic, told apart by ``"type"``: a watchdog
`PauseStateChange` (``pause_state_change``) and stage 1's `SourceProgress`
(``source_progress``) that drives the storm locator's low watermark. A record without a
type is a change, as every record was before progress existed. These are internal
records, versioned by the topic name; the public ones are protobuf.

>>> from fabricwatch.models.findings import EntityRef, Evidence
>>> c = PauseStateChange(EntityRef(cluster="c1", node="n1", device="mlx5_0", port="1"), 3, "pausing", True,
...                      10, 20, [Evidence("tx_pause_duty", 0.99, 0.95, "ratio")])
>>> pause_change_from_json(pause_change_to_json(c)) == c
True
>>> p = SourceProgress("c1", {"n1": 20, "leaf-u0-r0": 30})
>>> pause_change_to_json(p)
b'{"type":"source_progress","cluster":"c1","through_ns_by_source":{"n1":20,"leaf-u0-r0":30}}'
>>> pause_change_from_json(pause_change_to_json(p)) == p
True
>>> p = SourceProgress("", {"t/0": 20}, ("t/0", "t/1"), idle=True, end_offset=42)
>>> pause_change_to_json(p)
b'{"type":"source_progress","cluster":"","through_ns_by_source":{"t/0":20},"expect":["t/0","t/1"],"idle":true,"end_offset":42}'
>>> pause_change_from_json(pause_change_to_json(p)) == p
True
>>> pause_change_from_json(b'{"type":"source_progress","cluster":"","through_ns_by_source":{"t/0":20},"idle":true}')
SourceProgress(cluster='', through_ns_by_source={'t/0': 20}, expect=(), idle=True, end_offset=None)
"""
from __future__ import annotations

import dataclasses
import json

from fabricwatch.models.findings import EntityRef, Evidence
from fabricwatch.models.pfc_storm import PauseStateChange
from fabricwatch.models.storm_locator import SourceProgress

CHANGE_TYPE, PROGRESS_TYPE = "pause_state_change", "source_progress"
MAX_EXPECTED_STREAMS = 4096


class RecordError(ValueError):
    """An internal record that cannot be decoded."""


def pause_change_to_json(record: PauseStateChange | SourceProgress) -> bytes:
    """Either record of the pause-states topic, with its type."""
    if isinstance(record, SourceProgress):
        doc = {"type": PROGRESS_TYPE, "cluster": record.cluster, "through_ns_by_source": record.through_ns_by_source}
        if record.expect:
            doc["expect"] = list(record.expect)
        if record.idle:
            doc["idle"] = True
        if record.end_offset is not None:
            doc["end_offset"] = record.end_offset
    else:
        doc = {"type": CHANGE_TYPE, **dataclasses.asdict(record)}
    return json.dumps(doc, separators=(",", ":")).encode()


def pause_change_from_json(raw: bytes) -> PauseStateChange | SourceProgress:
    """Either record of the pause-states topic; `RecordError` for anything else."""
    try:
        doc = json.loads(raw)
        kind = doc.get("type", CHANGE_TYPE)
        if kind == PROGRESS_TYPE:
            return _progress(doc)
        if kind != CHANGE_TYPE:
            raise ValueError(f"unknown record type {kind!r}")
        return PauseStateChange(
            entity=EntityRef(**doc["entity"]), priority=int(doc["priority"]), role=str(doc["role"]),
            active=bool(doc["active"]), onset_ns=int(doc["onset_ns"]), at_ns=int(doc["at_ns"]),
            evidence=[Evidence(**e) for e in doc.get("evidence", [])],
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"not a pause-state record: {exc}") from exc


def _progress(doc: dict) -> SourceProgress:
    cluster, through = doc["cluster"], doc["through_ns_by_source"]
    if not isinstance(cluster, str) or not isinstance(through, dict):
        raise ValueError("source_progress needs a cluster name and a through_ns_by_source object")
    for source, at_ns in through.items():
        # bool is an int in Python, and JSON has no other way to say "not a time"
        if not source or type(at_ns) is not int or at_ns < 0:
            raise ValueError(f"source_progress: {source!r} -> {at_ns!r} is not a source and an event time in ns")
    expect = doc.get("expect", [])
    if not isinstance(expect, list) or len(expect) > MAX_EXPECTED_STREAMS or \
            not all(isinstance(s, str) and s for s in expect):
        raise ValueError("source_progress: expect must be a list of stream names")
    idle = doc.get("idle", False)
    if type(idle) is not bool:
        raise ValueError("source_progress: idle must be true or false")
    end_offset = doc.get("end_offset")         # absent before idleness named its end offset
    if end_offset is not None and (type(end_offset) is not int or end_offset < 0):
        raise ValueError("source_progress: end_offset must be an offset")
    return SourceProgress(cluster, through, tuple(expect), idle, end_offset)
