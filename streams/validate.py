"""Validate one `Snapshot` at the gateway: refuse what is broken, keep what is valid.

A snapshot is refused whole only when nothing in it can be trusted (no source, an absurd
timestamp, too big). Otherwise the broken parts are dropped and the rest is kept: a block
whose value count does not match its entities x columns, an entity with a bad or repeated
id, a label column of the wrong length, an out-of-range or infinite gauge (set to NaN,
i.e. "not read"), a rank step with impossible timings, an absurd step number or world
size, a start time outside the gateway's clock window, or a node its sender may not
report for; a rank progress heartbeat likewise (and one whose counters are impossible:
completed above entered, or going back within the snapshot). Every problem has a reason code, counted by the gateway and returned to the
sender.

Every check is linear in the size of the input (sets, never list scans inside loops):
one snapshot's validation must never stall the gateway for the other collectors. The
caches (layouts seen before, gauge bounds) are bounded in entries and in bytes, because
their keys are chosen by the sender.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.protos.v1 import telemetry_pb2 as pb

# Limits on one snapshot; a node has ~8 GPUs and ~8-16 NIC ports, a switch up to ~512 ports.
MAX_BLOCKS = 32
MAX_ENTITIES_PER_BLOCK = 4096
MAX_COLUMNS = 2048
MAX_RANK_STEPS = 4096
MAX_RANK_PROGRESS = 4096         # heartbeats in one snapshot (a node's ranks, a few periods each)
MAX_EVENTS = 4096
MAX_LABEL_COLUMNS = 64           # rate, state, phys_state, link_layer, netdev, uuid, bdf, ...: a handful
MAX_NAME_LEN = 253
MAX_LABEL_LEN = 1024
MAX_EVENT_DETAIL_LEN = 1024
# Rank steps: the largest jobs run ~10^5 ranks for ~10^7 steps; a node has at most a few dozen GPUs.
MAX_WORLD_SIZE = 1 << 20
MAX_STEP_NUMBER = 1 << 40
MAX_LOCAL_GPU = 255
# Collectives entered by one process: 10^4 a second for a year is ~3e11; more is garbage.
MAX_COLLECTIVES = 1 << 48
# Event time must be within this window around the gateway's clock (clock skew, replays).
MAX_FUTURE_SKEW_NS = 5 * 60 * 10**9
MAX_AGE_NS = 7 * 24 * 3600 * 10**9
# Plausible ranges of known gauges (inclusive). A value outside is a unit error or garbage:
# e.g. temperature sent in milli-degrees, power in W instead of mW, a percentage of 1e4.
GAUGE_RANGES: dict[str, tuple[float, float]] = {
    "utilization_gpu_pct": (0, 100),
    "temperature_c": (-40, 150),
    "power_mw": (0, 5_000_000),
    "sm_clock_mhz": (0, 10_000),
    "sm_clock_max_mhz": (0, 10_000),
    "clocks_event_reasons": (0, 2**32),
    "pcie_gen_current": (0, 8),
    "pcie_gen_max": (0, 8),
    "pcie_width_current": (0, 32),
    "pcie_width_max": (0, 32),
    "netdev_speed_mbps": (-1, 3_200_000),
    "port_speed_gbps": (0, 3_200),
    "oper_up": (0, 1),
    "admin_up": (0, 1),
}
MAX_STEP_SECONDS = 24 * 3600.0
_ANY_FINITE = (-1.7976931348623157e308, 1.7976931348623157e308)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
_VALID_ENTITY_KINDS = {pb.ENTITY_KIND_GPU, pb.ENTITY_KIND_NIC_PORT, pb.ENTITY_KIND_SWITCH_PORT}
_BOUNDS_CACHE: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
MAX_CACHED_BOUNDS = 4096
_GOOD_LAYOUTS: set[tuple] = set()
MAX_CACHED_LAYOUTS = 200_000
# Layout keys hold every entity id and column name: bound their bytes too (a fleet of
# 20k sources x ~2 KB of names fits; fresh ids from one sender cannot grow it past this).
MAX_CACHED_LAYOUT_BYTES = 64 * 1024 * 1024
_layout_cache_bytes = 0
_VALID_SOURCE_KINDS = {pb.SOURCE_KIND_NODE, pb.SOURCE_KIND_SWITCH}


@dataclass
class Verdict:
    accepted: bool
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, detail)

    def problem(self, reason: str, detail: str) -> None:
        self.problems.append((reason, detail))

    def reasons(self) -> Counter[str]:
        return Counter(r for r, _ in self.problems)


def _bad_name(name: str) -> bool:
    return not name or len(name) > MAX_NAME_LEN or not _NAME.match(name)


def validate_snapshot(snap: pb.Snapshot, now_ns: int, may_report: Callable[[str], bool] | None = None) -> Verdict:
    """Check `snap` in place: drop invalid parts, or refuse it (``accepted=False``).

    `may_report` says whether the sender may report for a node (its token's globs); a rank
    step for any other node is dropped (``rank_step_not_allowed``). None: no token, any name.
    """
    v = Verdict(accepted=False)
    if _bad_name(snap.source):
        v.problem("bad_source", f"source {snap.source[:64]!r} is empty or not a host/switch name")
        return v
    if snap.cluster and _bad_name(snap.cluster):
        v.problem("bad_cluster", f"cluster {snap.cluster[:64]!r} is not a valid name")
        return v
    if snap.source_kind not in _VALID_SOURCE_KINDS:
        v.problem("bad_source_kind", f"{snap.source}: source_kind {snap.source_kind} is not NODE or SWITCH")
        return v
    if not _in_clock_window(snap.time_unix_ns, now_ns):
        v.problem("timestamp_out_of_range",
                  f"{snap.source}: time {snap.time_unix_ns} ns is more than 5 min ahead of or 7 days behind the gateway")
        return v
    if len(snap.blocks) > MAX_BLOCKS or len(snap.rank_steps) > MAX_RANK_STEPS or len(snap.events) > MAX_EVENTS \
            or len(snap.rank_progress) > MAX_RANK_PROGRESS:
        v.problem("too_large", f"{snap.source}: {len(snap.blocks)} blocks, {len(snap.rank_steps)} rank steps, "
                               f"{len(snap.rank_progress)} progress reports, {len(snap.events)} events exceed the limits")
        return v
    v.accepted = True
    _validate_blocks(snap, v)
    _validate_rank_steps(snap, v, now_ns, may_report)
    _validate_rank_progress(snap, v, now_ns, may_report)
    _validate_events(snap, v, now_ns)
    return v


def _in_clock_window(t_ns: int, now_ns: int) -> bool:
    return now_ns - MAX_AGE_NS <= t_ns <= now_ns + MAX_FUTURE_SKEW_NS


def _validate_blocks(snap: pb.Snapshot, v: Verdict) -> None:
    keep_blocks = []
    seen_ids: set[tuple[int, str]] = set()
    for block in snap.blocks:
        ids = tuple(block.entity_ids)
        n, m, k = len(ids), len(block.counter_names), len(block.gauge_names)
        layout = (block.entity_kind, ids, tuple(block.counter_names), tuple(block.gauge_names))
        # A collector sends the same layout every tick: check names and ids once, then only counts.
        if layout not in _GOOD_LAYOUTS:
            if not _check_layout(snap, block, layout, v):
                continue
            n = len(block.entity_ids)   # bad ids may have been dropped
        # In a columnar block a wrong count cannot be pinned on one entity: the block goes.
        if len(block.counters) != n * m:
            v.problem("bad_counter_count", f"{snap.source}: {len(block.counters)} counter values for {n} entities "
                                           f"x {m} names; block dropped")
            continue
        if len(block.gauges) != n * k:
            v.problem("bad_gauge_count", f"{snap.source}: {len(block.gauges)} gauge values for {n} entities "
                                         f"x {k} names; block dropped")
            continue
        _validate_label_columns(snap, block, n, v)
        if not seen_ids.isdisjoint((block.entity_kind, eid) for eid in block.entity_ids):
            dup = {i for i, eid in enumerate(block.entity_ids) if (block.entity_kind, eid) in seen_ids}
            for i in sorted(dup):
                v.problem("bad_entity_id", f"{snap.source}: entity id {block.entity_ids[i][:64]!r} repeated")
            _drop_rows(block, [i for i in range(n) if i not in dup], snap, v)
        seen_ids.update((block.entity_kind, eid) for eid in block.entity_ids)
        if k and len(block.entity_ids):
            _clean_gauges(snap, block, v)
        keep_blocks.append(block)
    if len(keep_blocks) != len(snap.blocks):
        kept = [pb.CounterBlock() for _ in keep_blocks]
        for dst, src in zip(kept, keep_blocks):
            dst.CopyFrom(src)
        del snap.blocks[:]
        snap.blocks.extend(kept)


def _check_layout(snap: pb.Snapshot, block: pb.CounterBlock, layout: tuple, v: Verdict) -> bool:
    """Kind, sizes, column names and entity ids of a block not seen before; False = drop it.

    Bad entity ids are dropped from the block (True is returned for the rest).
    """
    kind, ids, counter_names, gauge_names = layout
    names = counter_names + gauge_names
    if kind not in _VALID_ENTITY_KINDS:
        v.problem("bad_entity_kind", f"{snap.source}: block of entity kind {kind} dropped")
        return False
    if len(names) > MAX_COLUMNS or len(ids) > MAX_ENTITIES_PER_BLOCK:
        v.problem("too_large", f"{snap.source}: block with {len(names)} columns, {len(ids)} entities dropped")
        return False
    if len(set(names)) != len(names) or any(not c or len(c) > MAX_NAME_LEN for c in names):
        v.problem("bad_column_names", f"{snap.source}: block with empty, overlong or repeated column names dropped")
        return False
    seen: set[str] = set()
    bad_rows: set[int] = set()
    for i, eid in enumerate(ids):
        if _bad_name(eid) or eid in seen:
            bad_rows.add(i)
            v.problem("bad_entity_id", f"{snap.source}: entity id {eid[:64]!r} empty, malformed or repeated")
        seen.add(eid)
    if bad_rows:
        if len(block.counters) == len(ids) * len(counter_names) and len(block.gauges) == len(ids) * len(gauge_names):
            _drop_rows(block, [i for i in range(len(ids)) if i not in bad_rows], snap, v)
        return True
    _remember_layout(layout)
    return True


def _remember_layout(layout: tuple) -> None:
    global _layout_cache_bytes
    size = sum(map(len, layout[1])) + sum(map(len, layout[2])) + sum(map(len, layout[3])) + 64
    if len(_GOOD_LAYOUTS) >= MAX_CACHED_LAYOUTS or _layout_cache_bytes + size > MAX_CACHED_LAYOUT_BYTES:
        _GOOD_LAYOUTS.clear()     # start over: the cache only saves time, never decides anything
        _layout_cache_bytes = 0
    _GOOD_LAYOUTS.add(layout)
    _layout_cache_bytes += size


def _validate_label_columns(snap: pb.Snapshot, block: pb.CounterBlock, n: int, v: Verdict) -> None:
    """Drop label columns that are malformed, repeated or past MAX_LABEL_COLUMNS; linear in their size."""
    excess = len(block.labels) - MAX_LABEL_COLUMNS
    if excess > 0:
        v.problem("too_many_label_columns", f"{snap.source}: {len(block.labels)} label columns in one block; "
                                            f"the {excess} past the limit of {MAX_LABEL_COLUMNS} dropped")
        del block.labels[MAX_LABEL_COLUMNS:]
    seen: set[str] = set()
    bad = []
    for j, col in enumerate(block.labels):
        if len(col.values) != n or not col.name or len(col.name) > MAX_NAME_LEN or col.name in seen \
                or max(map(len, col.values), default=0) > MAX_LABEL_LEN:
            bad.append(j)
        seen.add(col.name)
    if not bad:
        return
    for j in bad:
        v.problem("bad_label_column", f"{snap.source}: label column {block.labels[j].name[:64]!r} with "
                                      f"{len(block.labels[j].values)} values for {n} entities dropped")
    _keep_repeated(block.labels, set(bad), pb.LabelColumn)


def _drop_rows(block: pb.CounterBlock, keep: list[int], snap: pb.Snapshot, v: Verdict) -> None:
    """Keep only entities `keep` of a columnar block (a rare path: bad entity ids).

    A label column of the wrong length cannot be cut down row by row: it goes, counted.
    """
    n, m, k = len(block.entity_ids), len(block.counter_names), len(block.gauge_names)
    for col in block.labels:
        if len(col.values) != n:
            v.problem("bad_label_column", f"{snap.source}: label column {col.name[:64]!r} with "
                                          f"{len(col.values)} values for {n} entities dropped")
    counters = np.array(block.counters, dtype=np.uint64).reshape(n, m)[keep]
    gauges = np.array(block.gauges, dtype=np.float64).reshape(n, k)[keep]
    ids = [block.entity_ids[i] for i in keep]
    labels = [(col.name, [col.values[i] for i in keep]) for col in block.labels if len(col.values) == n]
    for field_name in ("entity_ids", "counters", "gauges", "labels"):
        block.ClearField(field_name)
    block.entity_ids.extend(ids)
    block.counters.extend(counters.ravel().tolist())
    block.gauges.extend(gauges.ravel().tolist())
    for name, values in labels:
        block.labels.add(name=name, values=values)


def _keep_repeated(field_value, drop: set[int], message_type) -> None:
    """Remove the items at positions `drop` from a repeated message field in one pass
    (``del field[i]`` one at a time is quadratic)."""
    kept = [message_type() for i in range(len(field_value)) if i not in drop]
    for dst, src in zip(kept, (item for i, item in enumerate(field_value) if i not in drop)):
        dst.CopyFrom(src)
    del field_value[:]
    field_value.extend(kept)


def _gauge_bounds(names) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([GAUGE_RANGES.get(n, _ANY_FINITE)[0] for n in names], dtype=np.float64)
    hi = np.array([GAUGE_RANGES.get(n, _ANY_FINITE)[1] for n in names], dtype=np.float64)
    return lo, hi


def _clean_gauges(snap: pb.Snapshot, block: pb.CounterBlock, v: Verdict) -> None:
    """Clear infinite and out-of-range gauges to NaN; vectorised over the whole block."""
    names = tuple(block.gauge_names)
    bounds = _BOUNDS_CACHE.get(names)
    if bounds is None:
        if len(_BOUNDS_CACHE) >= MAX_CACHED_BOUNDS:   # keys are the sender's column names
            _BOUNDS_CACHE.clear()
        bounds = _BOUNDS_CACHE[names] = _gauge_bounds(names)
    lo, hi = bounds
    values = np.array(block.gauges, dtype=np.float64).reshape(len(block.entity_ids), len(names))
    # NaN compares False both ways: "not read" passes; inf fails one of the bounds.
    bad = ~((values >= lo) & (values <= hi)) & ~np.isnan(values)
    if not bad.any():
        return
    for i, j in zip(*np.nonzero(bad)):
        value = values[i, j]
        block.gauges[int(i) * len(names) + int(j)] = math.nan
        where = f"{snap.source}/{block.entity_ids[i]}"
        if math.isinf(value):
            v.problem("non_finite_gauge", f"{where}: {names[j]} is infinite")
        else:
            v.problem("gauge_out_of_range", f"{where}: {names[j]}={value:g} outside [{lo[j]:g}, {hi[j]:g}] (wrong unit?)")


# Reason codes of the two rank records: (malformed, its node not the sender's to report).
_STEP_REASONS = ("bad_rank_step", "rank_step_not_allowed")
_PROGRESS_REASONS = ("bad_rank_progress", "rank_progress_not_allowed")


def _rank_identity_problem(reasons: tuple[str, str], r: pb.RankStep | pb.RankProgress) -> tuple[str, str]:
    """(reason, detail) when a rank step's or heartbeat's job, rank, step or GPU is unusable."""
    bad = reasons[0]
    if _bad_name(r.job_id):
        return bad, f"{bad.removeprefix('bad_').replace('_', ' ')} with job id {r.job_id[:64]!r} dropped"
    where = f"job {r.job_id} rank {r.rank}"
    if r.world_size == 0 or r.world_size > MAX_WORLD_SIZE or r.rank >= r.world_size:
        return bad, f"{where}: rank outside world size {r.world_size} (at most {MAX_WORLD_SIZE})"
    if r.step > MAX_STEP_NUMBER or r.local_gpu > MAX_LOCAL_GPU:
        return bad, f"{where}: step {r.step} or local GPU {r.local_gpu} is absurd"
    return "", ""


def _rank_node_problem(reasons: tuple[str, str], r: pb.RankStep | pb.RankProgress,
                       may_report: Callable[[str], bool] | None) -> tuple[str, str]:
    """(reason, detail) when the node a rank runs on is no host name or not the sender's to report."""
    where = f"job {r.job_id} rank {r.rank}"
    if _bad_name(r.node):
        return reasons[0], f"{where}: node {r.node[:64]!r} is empty or not a host name"
    if may_report is not None and not may_report(r.node):
        return reasons[1], f"{where}: the sender may not report for node {r.node[:64]!r}"
    return "", ""


def _rank_step_problem(rs: pb.RankStep, now_ns: int, may_report: Callable[[str], bool] | None) -> tuple[str, str]:
    """(reason, detail) for a rank step that must be dropped, or ("", "")."""
    reason, detail = _rank_identity_problem(_STEP_REASONS, rs)
    if reason:
        return reason, detail
    where = f"job {rs.job_id} rank {rs.rank}"
    timings = (rs.step_seconds, rs.busy_seconds, rs.collective_wait_seconds)
    if not all(math.isfinite(t) and 0 <= t <= MAX_STEP_SECONDS for t in timings):
        return "bad_rank_step", f"{where} step {rs.step}: timings {timings} not finite, negative or over a day"
    end_ns = rs.start_unix_ns + int(rs.step_seconds * 1e9)
    if not (_in_clock_window(rs.start_unix_ns, now_ns) and end_ns <= now_ns + MAX_FUTURE_SKEW_NS):
        return "rank_step_time_out_of_range", (f"{where} step {rs.step}: start {rs.start_unix_ns} ns is more than "
                                               f"5 min ahead of or 7 days behind the gateway")
    return _rank_node_problem(_STEP_REASONS, rs, may_report)


def _validate_rank_steps(snap: pb.Snapshot, v: Verdict, now_ns: int,
                         may_report: Callable[[str], bool] | None) -> None:
    drop = set()
    for i, rs in enumerate(snap.rank_steps):
        reason, detail = _rank_step_problem(rs, now_ns, may_report)
        if reason:
            v.problem(reason, f"{snap.source}: {detail}")
            drop.add(i)
    if drop:
        _keep_repeated(snap.rank_steps, drop, pb.RankStep)


def _rank_progress_problem(rp: pb.RankProgress, now_ns: int,
                           may_report: Callable[[str], bool] | None) -> tuple[str, str]:
    """(reason, detail) for a progress heartbeat that must be dropped, or ("", "")."""
    reason, detail = _rank_identity_problem(_PROGRESS_REASONS, rp)
    if reason:
        return reason, detail
    where = f"job {rp.job_id} rank {rp.rank}"
    if rp.collectives_entered > MAX_COLLECTIVES or rp.collectives_completed > rp.collectives_entered:
        return "bad_rank_progress", (f"{where}: {rp.collectives_completed} collectives completed of "
                                     f"{rp.collectives_entered} entered (completed > entered, or absurd)")
    if not _in_clock_window(rp.time_unix_ns, now_ns) or any(
            t and not (now_ns - MAX_AGE_NS <= t <= rp.time_unix_ns)
            for t in (rp.last_entered_unix_ns, rp.last_completed_unix_ns)):
        return "rank_progress_time_out_of_range", (
            f"{where}: sampled at {rp.time_unix_ns} ns, last entered {rp.last_entered_unix_ns}, last completed "
            f"{rp.last_completed_unix_ns}: outside the gateway's clock window or after the sampling time")
    if (rp.collectives_entered and not rp.last_entered_unix_ns) or \
            (rp.collectives_completed and not rp.last_completed_unix_ns):
        return "bad_rank_progress", f"{where}: collectives counted without the time of the last one"
    return _rank_node_problem(_PROGRESS_REASONS, rp, may_report)


def _validate_rank_progress(snap: pb.Snapshot, v: Verdict, now_ns: int,
                            may_report: Callable[[str], bool] | None) -> None:
    """Drop bad heartbeats; within one snapshot a rank's heartbeats must be monotone (in
    sampling time, counters never going back). Across snapshots a counter that goes back is
    a restarted process, which the hang model handles (`models.hang`)."""
    drop = set()
    newest: dict[tuple[str, int], pb.RankProgress] = {}
    order = sorted(range(len(snap.rank_progress)), key=lambda i: snap.rank_progress[i].time_unix_ns)
    for i in order:
        rp = snap.rank_progress[i]
        reason, detail = _rank_progress_problem(rp, now_ns, may_report)
        if not reason:
            prev = newest.get((rp.job_id, rp.rank))
            if prev is not None and (rp.collectives_entered < prev.collectives_entered
                                     or rp.collectives_completed < prev.collectives_completed):
                reason, detail = "rank_progress_not_monotone", (
                    f"job {rp.job_id} rank {rp.rank}: counters {rp.collectives_entered}/{rp.collectives_completed} "
                    f"went back from {prev.collectives_entered}/{prev.collectives_completed} within one snapshot")
            else:
                newest[(rp.job_id, rp.rank)] = rp
        if reason:
            v.problem(reason, f"{snap.source}: {detail}")
            drop.add(i)
    if drop:
        _keep_repeated(snap.rank_progress, drop, pb.RankProgress)


def _validate_events(snap: pb.Snapshot, v: Verdict, now_ns: int) -> None:
    drop = set()
    for i, event in enumerate(snap.events):
        if _bad_name(event.entity_id) or _bad_name(event.kind):
            v.problem("bad_event", f"{snap.source}: device event without a valid entity or kind dropped")
        elif event.time_unix_ns and not _in_clock_window(event.time_unix_ns, now_ns):
            v.problem("bad_event", f"{snap.source}: device event at {event.time_unix_ns} ns is outside the "
                                   "gateway's clock window")
        elif len(event.detail) > MAX_EVENT_DETAIL_LEN:
            v.problem("bad_event", f"{snap.source}: device event detail of {len(event.detail)} characters")
        else:
            continue
        drop.add(i)
    if drop:
        _keep_repeated(snap.events, drop, pb.DeviceEvent)
