"""The wire formats -> the models' arrays, and back: the only place the models' input is built.

* `pack`: consecutive validated `Snapshot` ticks of one source -> one `SourceRecord` (the
  telemetry topic's value): one `TickBlock` per block layout, its values as little-endian
  bytes [tick][entity][column]. The gateway packs each collector batch so; replay packs
  windows of a recording the same way.
* `to_batch`: a `SourceRecord` -> `models.frames.SourceBatch`, one ``frombuffer`` per block
  (no per-value or per-tick Python work).
* `to_view`: one `Snapshot` -> `models.frames.SourceView` (tests, the dashboard).

>>> snaps = [pb.Snapshot(cluster="c1", source="n1", source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=t, seq=t,
...          blocks=[pb.CounterBlock(entity_kind=pb.ENTITY_KIND_NIC_PORT, entity_ids=["mlx5_0/1"],
...                                  counter_names=["rx_prio3_pause"], counters=[t * 10])]) for t in (1, 2, 3)]
>>> batch = to_batch(rec.SourceRecord.FromString(pack(snaps, received_ns=9).SerializeToString()))
>>> batch.times_ns.tolist(), batch.stacks[0].counters[:, 0, 0].tolist(), batch.received_ns
([1, 2, 3], [10, 20, 30], 9)
>>> unpack(pack(snaps)) == snaps
True
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from fabricwatch.models.frames import (GPU, NIC_PORT, SWITCH_PORT, DeviceEvent, EntityFrame, FrameStack, RankProgress,
                                       RankStep, SourceBatch, SourceView)
from fabricwatch.protos.v1 import records_pb2 as rec
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
    view.rank_steps = rank_steps_of(snap)
    return view


def rank_progress_of(snap: pb.Snapshot) -> list[RankProgress]:
    return [RankProgress(r.job_id, r.rank, r.world_size, r.node, r.local_gpu, r.time_unix_ns, r.collectives_entered,
                         r.collectives_completed, r.last_entered_unix_ns, r.last_completed_unix_ns, r.step)
            for r in snap.rank_progress]


def rank_steps_of(snap: pb.Snapshot) -> list[RankStep]:
    return [RankStep(r.job_id, r.rank, r.world_size, r.node, r.local_gpu, r.step, r.start_unix_ns,
                     r.step_seconds, r.busy_seconds, r.collective_wait_seconds) for r in snap.rank_steps]


# -- records of the telemetry topic -------------------------------------------------------------
# Layouts remembered by `layout_id` / `to_batch` (a fleet has a few per kind of node).
MAX_LAYOUTS = 100_000
_LAYOUT_IDS: dict[tuple, bytes] = {}
_LAYOUTS: dict[bytes, tuple] = {}


def layout_id(key: tuple) -> bytes:
    """16 bytes naming a block layout (kind, ids, counter, gauge and label names)."""
    found = _LAYOUT_IDS.get(key)
    if found is None:
        if len(_LAYOUT_IDS) >= MAX_LAYOUTS:
            _LAYOUT_IDS.clear()
        found = _LAYOUT_IDS[key] = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    return found


def pack(snaps: Iterable[pb.Snapshot], received_ns: int = 0) -> rec.SourceRecord:
    """Consecutive ticks of one source (validated, in time order) as one `SourceRecord`.

    Rank steps are not carried (they travel on their own topic). A tick not newer than the
    one before it is left out: a record's times are strictly increasing.
    """
    out = rec.SourceRecord(received_unix_ns=received_ns)
    groups: dict[tuple, list] = {}          # layout -> [ticks, counter arrays, gauge arrays, {label: values}]
    times: list[int] = []
    for snap in snaps:
        if not times:
            out.cluster, out.source, out.source_kind = snap.cluster, snap.source, snap.source_kind
        elif snap.time_unix_ns <= times[-1]:
            continue
        tick = len(times)
        times.append(snap.time_unix_ns)
        out.seq.append(snap.seq)
        for block in snap.blocks:
            labels = block.labels
            key = (block.entity_kind, tuple(block.entity_ids), tuple(block.counter_names), tuple(block.gauge_names),
                   tuple(c.name for c in labels))
            g = groups.get(key)
            if g is None:
                g = groups[key] = [[], [], [], {c.name: [] for c in labels}]
            g[0].append(tick)
            g[1].extend(block.counters)          # flat lists: one array per layout at the end
            g[2].extend(block.gauges)
            for column in labels:
                g[3][column.name].extend(column.values)
        for e in snap.events:
            out.events.append(e)
            out.event_ticks.append(tick)
    out.time_unix_ns = np.array(times, dtype="<i8").tobytes()
    for key, (ticks, counters, gauges, labels) in groups.items():
        kind, ids, counter_names, gauge_names, _ = key
        n = len(ids)
        columns = []
        for name, values in labels.items():
            first = values[:n]
            if n and len(ticks) > 1 and all(values[i:i + n] == first for i in range(n, len(values), n)):
                values = first                       # the same every tick: sent once
            columns.append(pb.LabelColumn(name=name, values=values))
        out.blocks.add(entity_kind=kind, entity_ids=ids, counter_names=counter_names, gauge_names=gauge_names,
                       ticks=np.array(ticks, dtype="<u2").tobytes(),
                       counters=np.array(counters, dtype="<u8").tobytes() if counters else b"",
                       gauges=np.array(gauges, dtype="<f8").tobytes() if gauges else b"", labels=columns,
                       layout_id=layout_id(key))
    return out


def unpack(record: rec.SourceRecord) -> list[pb.Snapshot]:
    """The ticks of a `SourceRecord` as the snapshots they were packed from (tools, tests)."""
    snaps = [pb.Snapshot(cluster=record.cluster, source=record.source, source_kind=record.source_kind,
                         time_unix_ns=t, seq=q)
             for t, q in zip(np.frombuffer(record.time_unix_ns, dtype="<i8").tolist(), record.seq)]
    for block in record.blocks:
        n, m, g = len(block.entity_ids), len(block.counter_names), len(block.gauge_names)
        ticks = np.frombuffer(block.ticks, dtype="<u2").tolist()
        counters = np.frombuffer(block.counters, dtype="<u8").reshape(len(ticks), n * m)
        gauges = np.frombuffer(block.gauges, dtype="<f8").reshape(len(ticks), n * g)
        for k, tick in enumerate(ticks):
            snaps[tick].blocks.add(
                entity_kind=block.entity_kind, entity_ids=block.entity_ids, counter_names=block.counter_names,
                gauge_names=block.gauge_names, counters=counters[k].tolist(), gauges=gauges[k].tolist(),
                labels=[pb.LabelColumn(name=c.name, values=c.values[k * n:(k + 1) * n] if len(c.values) > n
                                       else c.values) for c in block.labels])
    for e, tick in zip(record.events, record.event_ticks):
        snaps[tick].events.append(e)
    return snaps


class RecordError(ValueError):
    """A telemetry record whose arrays do not match its layout."""


def to_batch(record: rec.SourceRecord) -> SourceBatch:
    """A `SourceRecord` as arrays; `RecordError` if its sizes do not add up."""
    raw_times = record.time_unix_ns
    if len(raw_times) % 8:
        raise RecordError(f"{record.source!r}: {len(raw_times)} bytes of tick times")
    times = np.frombuffer(raw_times, dtype="<i8")
    n_ticks = len(times)
    if n_ticks == 0 or (n_ticks > 1 and not (times[1:] > times[:-1]).all()):
        raise RecordError(f"{record.source!r}: {n_ticks} ticks, times not strictly increasing")
    stacks = []
    for block in record.blocks:
        layout = _layout_of(block)
        if layout is None:
            continue
        kind, ids, counter_names, gauge_names = layout
        raw_ticks, raw_counters, raw_gauges = block.ticks, block.counters, block.gauges
        n, m, k, t = len(ids), len(counter_names), len(gauge_names), len(raw_ticks) // 2
        if t == 0:
            continue
        ticks = np.frombuffer(raw_ticks, dtype="<u2").astype(np.intp)
        if len(raw_ticks) % 2 or len(raw_counters) != 8 * t * n * m or len(raw_gauges) != 8 * t * n * k \
                or ticks[-1] >= n_ticks or (t > 1 and not (ticks[1:] > ticks[:-1]).all()):
            raise RecordError(f"{record.source!r}: a {kind} block's arrays do not match {t} ticks x {n} x {m}+{k}")
        labels = {}
        for column in block.labels:
            values = list(column.values)
            if len(values) == n:
                labels[column.name] = [values] * t         # one tick's, for every tick
            elif len(values) == t * n:
                labels[column.name] = [values[i * n:(i + 1) * n] for i in range(t)]
            else:
                raise RecordError(f"{record.source!r}: label {column.name!r} has {len(values)} values, not {t * n}")
        stacks.append(FrameStack(
            kind, ids, counter_names, gauge_names, ticks,
            np.frombuffer(raw_counters, dtype="<u8").reshape(t, n, m),
            np.frombuffer(raw_gauges, dtype="<f8").reshape(t, n, k), labels))
    events: dict[int, list[DeviceEvent]] = {}
    for e, tick in zip(record.events, record.event_ticks):
        if tick < n_ticks:
            events.setdefault(int(tick), []).append(DeviceEvent(e.entity_id, e.kind, e.code, e.time_unix_ns, e.detail))
    return SourceBatch(record.cluster, record.source, _SOURCE_KIND.get(record.source_kind, "node"), times, stacks,
                       events, record.received_unix_ns)


def _layout_of(block: rec.TickBlock) -> tuple | None:
    """(kind, ids, counter names, gauge names) of a block, from the layout cache when it can."""
    cached = _LAYOUTS.get(block.layout_id) if block.layout_id else None
    if cached is not None and len(cached[1]) == len(block.entity_ids) and len(cached[2]) == len(block.counter_names) \
            and len(cached[3]) == len(block.gauge_names):
        return cached
    kind = _ENTITY_KIND.get(block.entity_kind)
    if kind is None or not block.entity_ids:
        return None
    layout = (kind, tuple(block.entity_ids), tuple(block.counter_names), tuple(block.gauge_names))
    if block.layout_id:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[block.layout_id] = layout
    return layout


def snapshot_batch(snap: pb.Snapshot, received_ns: int = 0) -> SourceBatch:
    """One snapshot's ticks (one) as a batch."""
    return to_batch(pack([snap], received_ns))
