"""Protobuf `Snapshot` -> `models.frames.SourceView` (numpy arrays), and back to JSON.

This is the only place where the models' input is built from the wire format, for the
worker and for replay alike.
"""
from __future__ import annotations

import numpy as np
from google.protobuf import json_format

from fabricwatch.models.frames import GPU, NIC_PORT, SWITCH_PORT, DeviceEvent, EntityFrame, RankStep, SourceView
from fabricwatch.protos.v1 import telemetry_pb2 as pb

_ENTITY_KIND = {pb.ENTITY_KIND_GPU: GPU, pb.ENTITY_KIND_NIC_PORT: NIC_PORT, pb.ENTITY_KIND_SWITCH_PORT: SWITCH_PORT}
_SOURCE_KIND = {pb.SOURCE_KIND_NODE: "node", pb.SOURCE_KIND_SWITCH: "switch"}


def to_view(snap: pb.Snapshot) -> SourceView:
    """Decode a validated snapshot; blocks of unknown kind are skipped."""
    view = SourceView(
        cluster=snap.cluster,
        source=snap.source,
        source_kind=_SOURCE_KIND.get(snap.source_kind, "node"),
        time_ns=snap.time_unix_ns,
        seq=snap.seq,
    )
    for block in snap.blocks:
        kind = _ENTITY_KIND.get(block.entity_kind)
        n = len(block.entity_ids)
        if kind is None or n == 0:
            continue
        # Columnar blocks: one C-level conversion per block, no loop over entities or counters.
        view.frames.append(
            EntityFrame(
                kind=kind,
                ids=tuple(block.entity_ids),
                counter_names=tuple(block.counter_names),
                counters=np.array(block.counters, dtype=np.uint64).reshape(n, len(block.counter_names)),
                gauge_names=tuple(block.gauge_names),
                gauges=np.array(block.gauges, dtype=np.float64).reshape(n, len(block.gauge_names)),
                labels={column.name: list(column.values) for column in block.labels},
            )
        )
    view.events = [DeviceEvent(e.entity_id, e.kind, e.code, e.time_unix_ns, e.detail) for e in snap.events]
    view.rank_steps = [
        RankStep(r.job_id, r.rank, r.world_size, r.node, r.local_gpu, r.step, r.start_unix_ns,
                 r.step_seconds, r.busy_seconds, r.collective_wait_seconds)
        for r in snap.rank_steps
    ]
    return view


def snapshot_to_json(snap: pb.Snapshot) -> str:
    """One JSON Lines record (proto3 JSON mapping, field names as in the .proto)."""
    return json_format.MessageToJson(snap, preserving_proto_field_name=True, indent=None)


def snapshot_from_json(line: str) -> pb.Snapshot:
    """Parse one JSON Lines record; raises `json_format.ParseError` on malformed input."""
    return json_format.Parse(line, pb.Snapshot())
