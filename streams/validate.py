"""Validate one `Snapshot` at the gateway: refuse what is broken, keep what is valid.

A snapshot is refused whole only when nothing in it can be trusted (no source, an absurd
timestamp, too big). Otherwise the broken parts are dropped and the rest is kept: an
entity whose value count does not match its block, an out-of-range or infinite gauge
(set to NaN, i.e. "not read"), a rank step with impossible timings. Every problem has a
reason code, counted by the gateway and returned to the sender.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.protos.v1 import telemetry_pb2 as pb

# Limits on one snapshot; a node has ~8 GPUs and ~8-16 NIC ports, a switch up to ~512 ports.
MAX_BLOCKS = 32
MAX_ENTITIES_PER_BLOCK = 4096
MAX_COLUMNS = 2048
MAX_RANK_STEPS = 4096
MAX_EVENTS = 4096
MAX_NAME_LEN = 253
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
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
_VALID_ENTITY_KINDS = {pb.ENTITY_KIND_GPU, pb.ENTITY_KIND_NIC_PORT, pb.ENTITY_KIND_SWITCH_PORT}
_BOUNDS_CACHE: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
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


def validate_snapshot(snap: pb.Snapshot, now_ns: int) -> Verdict:
    """Check `snap` in place: drop invalid parts, or refuse it (``accepted=False``)."""
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
    if not (now_ns - MAX_AGE_NS <= snap.time_unix_ns <= now_ns + MAX_FUTURE_SKEW_NS):
        v.problem("timestamp_out_of_range",
                  f"{snap.source}: time {snap.time_unix_ns} ns is more than 5 min ahead of or 7 days behind the gateway")
        return v
    if len(snap.blocks) > MAX_BLOCKS or len(snap.rank_steps) > MAX_RANK_STEPS or len(snap.events) > MAX_EVENTS:
        v.problem("too_large", f"{snap.source}: {len(snap.blocks)} blocks, {len(snap.rank_steps)} rank steps, "
                               f"{len(snap.events)} events exceed the limits")
        return v
    v.accepted = True
    _validate_blocks(snap, v)
    _validate_rank_steps(snap, v)
    _validate_events(snap, v)
    return v


def _validate_blocks(snap: pb.Snapshot, v: Verdict) -> None:
    keep_blocks = []
    seen_ids: set[tuple[int, str]] = set()
    for block in snap.blocks:
        names = list(block.counter_names) + list(block.gauge_names)
        if block.entity_kind not in _VALID_ENTITY_KINDS:
            v.problem("bad_entity_kind", f"{snap.source}: block of entity kind {block.entity_kind} dropped")
            continue
        if len(names) > MAX_COLUMNS or len(block.entities) > MAX_ENTITIES_PER_BLOCK:
            v.problem("too_large", f"{snap.source}: block with {len(names)} columns, {len(block.entities)} entities dropped")
            continue
        if len(set(names)) != len(names) or any(not n or len(n) > MAX_NAME_LEN for n in names):
            v.problem("bad_column_names", f"{snap.source}: block with empty, overlong or repeated column names dropped")
            continue
        n_counters, n_gauges = len(block.counter_names), len(block.gauge_names)
        keep_entities = []
        for entity in block.entities:
            key = (block.entity_kind, entity.id)
            if _bad_name(entity.id) or key in seen_ids:
                v.problem("bad_entity_id", f"{snap.source}: entity id {entity.id[:64]!r} empty, malformed or repeated")
                continue
            if len(entity.counters) != n_counters:
                v.problem("bad_counter_count", f"{snap.source}/{entity.id}: {len(entity.counters)} counters "
                                               f"for {n_counters} names")
                continue
            if len(entity.gauges) != n_gauges:
                v.problem("bad_gauge_count", f"{snap.source}/{entity.id}: {len(entity.gauges)} gauges "
                                             f"for {n_gauges} names")
                continue
            seen_ids.add(key)
            keep_entities.append(entity)
        if n_gauges and keep_entities:
            _clean_gauges(snap, block, keep_entities, v)
        if len(keep_entities) != len(block.entities):
            del block.entities[:]
            block.entities.extend(keep_entities)
        keep_blocks.append(block)
    if len(keep_blocks) != len(snap.blocks):
        kept = [pb.CounterBlock() for _ in keep_blocks]
        for dst, src in zip(kept, keep_blocks):
            dst.CopyFrom(src)
        del snap.blocks[:]
        snap.blocks.extend(kept)


def _gauge_bounds(names) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([GAUGE_RANGES.get(n, (-np.inf, np.inf))[0] for n in names], dtype=np.float64)
    hi = np.array([GAUGE_RANGES.get(n, (-np.inf, np.inf))[1] for n in names], dtype=np.float64)
    return lo, hi


def _clean_gauges(snap, block, entities, v: Verdict) -> None:
    """Clear infinite and out-of-range gauges to NaN; vectorised over the whole block."""
    names = tuple(block.gauge_names)
    bounds = _BOUNDS_CACHE.get(names)
    if bounds is None:
        bounds = _BOUNDS_CACHE[names] = _gauge_bounds(names)
    lo, hi = bounds
    values = np.array([e.gauges for e in entities], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.isinf(values) | (values < lo) | (values > hi)
    if not bad.any():
        return
    for i, j in zip(*np.nonzero(bad)):
        value = values[i, j]
        entities[i].gauges[j] = math.nan
        if math.isinf(value):
            v.problem("non_finite_gauge", f"{snap.source}/{entities[i].id}: {names[j]} is infinite")
        else:
            v.problem("gauge_out_of_range", f"{snap.source}/{entities[i].id}: {names[j]}={value:g} "
                                            f"outside [{lo[j]:g}, {hi[j]:g}] (wrong unit?)")


def _validate_rank_steps(snap: pb.Snapshot, v: Verdict) -> None:
    keep = []
    for rs in snap.rank_steps:
        timings = (rs.step_seconds, rs.busy_seconds, rs.collective_wait_seconds)
        if _bad_name(rs.job_id):
            v.problem("bad_rank_step", f"{snap.source}: rank step with job id {rs.job_id[:64]!r} dropped")
        elif rs.world_size == 0 or rs.rank >= rs.world_size:
            v.problem("bad_rank_step", f"{snap.source}: rank {rs.rank} outside world size {rs.world_size}")
        elif not all(math.isfinite(t) and 0 <= t <= MAX_STEP_SECONDS for t in timings):
            v.problem("bad_rank_step", f"{snap.source}: job {rs.job_id} rank {rs.rank} step {rs.step}: "
                                       f"timings {timings} not finite, negative or over a day")
        else:
            keep.append(rs)
    if len(keep) != len(snap.rank_steps):
        kept = [pb.RankStep() for _ in keep]
        for dst, src in zip(kept, keep):
            dst.CopyFrom(src)
        del snap.rank_steps[:]
        snap.rank_steps.extend(kept)


def _validate_events(snap: pb.Snapshot, v: Verdict) -> None:
    bad = [i for i, ev in enumerate(snap.events) if _bad_name(ev.entity_id) or not ev.kind]
    for i in reversed(bad):
        v.problem("bad_event", f"{snap.source}: device event without entity or kind dropped")
        del snap.events[i]
