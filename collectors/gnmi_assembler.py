"""One switch's port table, merged from its gNMI notifications, and its ticks as `Snapshot`s.

Pure: no I/O; `gnmi_switch.SwitchCollector` feeds it the notifications of its streams and
the clocks (the tick rules are in `gnmi_switch`'s module docstring).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter

from fabricwatch.counters import PFC_PRIORITIES, SWITCH_GAUGES
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .gnmi_decode import NO_VALUE, canonical, decode_value, flatten, gnmi_pb2, natural_key, path_elems
from .gnmi_profiles import CONVERTERS, COUNTER, GAUGE, PORT_NAME_MAP, SAMPLE, CompiledProfile, Match, compile_profile

log = logging.getLogger("fabricwatch.switch")

_COUNTER_ORDER = ["in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors", "out-errors", "in-discards",
                  "out-discards", "interface-transitions"]
for _p in PFC_PRIORITIES:
    _COUNTER_ORDER += [f"pfc{_p}-rx-pkts", f"pfc{_p}-tx-pkts", f"pfc{_p}-rx-pause-duration-us",
                       f"queue{_p}-transmit-pkts", f"queue{_p}-transmit-octets"]
_GAUGE_ORDER = list(SWITCH_GAUGES) + [f"queue{_p}-occupancy-bytes" for _p in PFC_PRIORITIES]
_RANK = {n: i for i, n in enumerate(_COUNTER_ORDER + _GAUGE_ORDER)}


def _column_key(name: str):
    return (_RANK.get(name, len(_RANK)), name)


# --------------------------------------------------------------------------- assembly
class SwitchAssembler:
    """The current port table of one switch, and its ticks (see the module doc).

    Pure: no I/O, the caller passes the clocks, so snapshot assembly is unit-tested with
    hand-built notifications.
    """

    def __init__(self, switch: str, profile: CompiledProfile | str, *, interval_s: float = 1.0,
                 priorities=PFC_PRIORITIES, cluster: str = "", tick_quiet_s: float | None = None,
                 sync_timeout_s: float | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.switch = switch
        self.profile = compile_profile(profile) if isinstance(profile, str) else profile
        self.interval_s = interval_s
        self.priorities = frozenset(int(p) for p in priorities)
        self.cluster = cluster
        self.tick_quiet_s = tick_quiet_s if tick_quiet_s else max(0.02, min(interval_s / 2, 2.0))
        self.sync_timeout_s = sync_timeout_s if sync_timeout_s else max(10.0, 5 * interval_s)
        self.seq = 0
        self.last_time_ns = 0
        self.stats: Counter[str] = Counter()
        self.unmapped_examples: list[str] = []
        self.oid_names: dict[str, str] = {}
        self.reset()

    # -- state ------------------------------------------------------------------------------
    def reset(self, now_mono: float | None = None) -> None:
        """Forget the table (a new stream's initial dump refills it); drop a half tick."""
        if getattr(self, "_pending", None):
            self.stats["partial_ticks_dropped"] += 1
        self.counters: dict[str, dict[str, int]] = {}
        self.gauges: dict[str, dict[str, float]] = {}
        self.ranks: dict[tuple[str, str], int] = {}
        self.synced = False
        self.stream_start_mono = now_mono
        self._pending: set[tuple[int, str, str]] = set()   # SAMPLE leaves (group, port, name) this tick
        self._expected: set[tuple[int, str, str]] = set()  # ... that a complete tick carries (learnt)
        self._expected_seen = 0                             # |pending & expected|
        self._incomplete_run = 0
        self._tick_mono: float | None = None
        self._tick_ns: int | None = None
        self._last_sample_mono: float | None = None

    # -- input ------------------------------------------------------------------------------
    def apply(self, notification: gnmi_pb2.Notification, now_mono: float, now_ns: int,
              group: int = 0) -> list[pb.Snapshot]:
        """Merge one notification of subscription `group`; returns the snapshot of a tick it
        completed, if any."""
        out: list[pb.Snapshot] = []
        if self.stream_start_mono is None:
            self.stream_start_mono = now_mono
        strip = self.profile.strip_module_prefixes
        prefix = path_elems(notification.prefix) if notification.HasField("prefix") else []
        for deleted in notification.delete:
            self._delete(canonical(prefix + path_elems(deleted), strip))
        for update in notification.update:
            self.stats["updates"] += 1
            if update.HasField("val"):
                value = decode_value(update.val)
            elif update.HasField("value"):       # gNMI < 0.4 `Value` (JSON bytes)
                try:
                    value = json.loads(update.value.value)
                except ValueError:
                    value = NO_VALUE
            else:
                value = NO_VALUE
            for leaf, scalar in flatten(prefix + path_elems(update.path), value):
                path = canonical(leaf, strip)
                match = self.profile.match(path)
                if match is None:
                    self.stats["unmapped_leaves"] += 1
                    if len(self.unmapped_examples) < 20 and path not in self.unmapped_examples:
                        self.unmapped_examples.append(path)
                        log.debug("%s: no %s rule for %s", self.switch, self.profile.name, path)
                    continue
                out += self._apply_leaf(match, scalar, now_mono, now_ns, group)
        return out

    def _port(self, match: Match) -> str | None:
        port = match.binds.get("port", "")
        if port.startswith("oid:"):          # SONiC raw COUNTERS:oid paths
            name = self.oid_names.get(port)
            if name is None:
                self.stats["unknown_oid"] += 1
            return name
        return port or None

    def _apply_leaf(self, match: Match, scalar, now_mono: float, now_ns: int, group: int) -> list[pb.Snapshot]:
        rule = match.rule
        if rule.kind == PORT_NAME_MAP:
            if isinstance(scalar, str) and scalar.startswith("oid:"):
                self.oid_names[scalar] = match.binds["port"]
            return []
        for ph in ("prio", "queue"):
            if ph in match.binds and int(match.binds[ph]) not in self.priorities:
                self.stats["other_priorities"] += 1
                return []
        port = self._port(match)
        if port is None:
            return []
        value = CONVERTERS[rule.convert](scalar)
        if value is None:
            self.stats["bad_values"] += 1
            return []
        name = rule.output_name(match.binds)
        key = (port, name)
        seen_rank = self.ranks.get(key)
        if seen_rank is not None and rule.rank < seen_rank:
            return []                         # a better source for this column exists
        self.ranks[key] = rule.rank
        out: list[pb.Snapshot] = []
        seen = (group, port, name)
        if rule.mode == SAMPLE and self.synced and seen in self._pending:
            # the same leaf again from one subscription: the next sample has begun (the new
            # value belongs to it), and what the closed tick lacked did not come in a whole sample
            out += self._flush("repeat")
        if rule.kind == COUNTER:
            self.counters.setdefault(port, {})[name] = value
        elif rule.kind == GAUGE:
            self.gauges.setdefault(port, {})[name] = value
        if rule.mode == SAMPLE:
            if self._tick_ns is None:
                self._tick_mono, self._tick_ns = now_mono, now_ns
            self._last_sample_mono = now_mono
            if seen not in self._pending:
                self._pending.add(seen)
                if seen in self._expected:
                    self._expected_seen += 1
            if self.synced and self._expected and self._expected_seen == len(self._expected):
                out += self._flush("complete")      # every leaf of a sample is in: send it now
        return out

    def _delete(self, path: str) -> None:
        port = self.profile.port_root(path)
        if port is not None:
            self.counters.pop(port, None)
            self.gauges.pop(port, None)
            self.ranks = {k: v for k, v in self.ranks.items() if k[0] != port}
            self._pending = {k for k in self._pending if k[1] != port}
            self._expected = {k for k in self._expected if k[1] != port}
            self._expected_seen = len(self._pending & self._expected)
            self.stats["deleted_ports"] += 1
            return
        match = self.profile.match(path)
        if match is None or match.rule.kind not in (COUNTER, GAUGE):
            return
        port = self._port(match)
        if port is None:
            return
        name = match.rule.output_name(match.binds)
        (self.counters if match.rule.kind == COUNTER else self.gauges).get(port, {}).pop(name, None)
        self.ranks.pop((port, name), None)
        self._expected = {k for k in self._expected if k[1:] != (port, name)}
        self._expected_seen = len(self._pending & self._expected)

    def sync(self, now_mono: float, now_ns: int) -> list[pb.Snapshot]:
        """The initial dump is complete (every subscription group sent ``sync_response``)."""
        self.synced = True
        if self._tick_ns is None:
            self._tick_mono, self._tick_ns = now_mono, now_ns
        return self._flush("sync")

    # -- time -------------------------------------------------------------------------------
    def due_in(self, now_mono: float) -> float | None:
        """Seconds until `poll` may flush something (None: nothing pending)."""
        if not self.synced:
            if self.stream_start_mono is None:
                return None
            return max(0.0, self.stream_start_mono + self.sync_timeout_s - now_mono)
        if not self._pending:
            return None
        return max(0.0, min(self._last_sample_mono + self.tick_quiet_s, self._tick_mono + self.interval_s) - now_mono)

    def poll(self, now_mono: float) -> list[pb.Snapshot]:
        if not self.synced:
            if self.stream_start_mono is not None and now_mono - self.stream_start_mono >= self.sync_timeout_s:
                log.warning("%s: no sync_response within %.0f s; emitting what arrived", self.switch,
                            self.sync_timeout_s)
                self.stats["sync_timeouts"] += 1
                return self.sync(now_mono, time.time_ns())
            return []
        if self._pending and now_mono - self._last_sample_mono >= self.tick_quiet_s:
            return self._flush("quiet")
        if self._pending and now_mono - self._tick_mono >= self.interval_s:
            return self._flush("age")
        return []

    # -- output -----------------------------------------------------------------------------
    def _flush(self, reason: str) -> list[pb.Snapshot]:
        """Close the tick: emit the table, and learn which SAMPLE leaves make a tick complete.

        The expected set comes from the initial dump (sync) and grows with complete ticks.
        It shrinks to what arrived only when a whole sample passed without the missing
        leaves ("repeat"), or after 3 ticks in a row closed by the quiet/age fallback, so a
        one-off stall in mid-burst does not teach it a partial set.
        """
        pending, t_ns = self._pending, self._tick_ns
        self.stats[f"ticks_closed_by_{reason}"] += 1
        if reason in ("sync", "complete"):
            self._expected |= pending
            self._incomplete_run = 0
        elif reason == "repeat" or not self._expected:
            self._expected = set(pending)
            self._incomplete_run = 0
        else:
            self._incomplete_run += 1
            if self._incomplete_run >= 3:
                self._expected = set(pending)
                self._incomplete_run = 0
        self._pending = set()
        self._expected_seen = 0
        self._tick_mono = self._tick_ns = self._last_sample_mono = None
        if t_ns is None:
            return []
        t_ns = max(t_ns, self.last_time_ns + 1)     # strictly increasing per source
        snap = self.build(t_ns)
        if snap is None:
            return []
        self.last_time_ns = t_ns
        self.stats["ticks"] += 1
        return [snap]

    def build(self, time_ns: int) -> pb.Snapshot | None:
        """The current table as a `Snapshot`; None when no port is known yet.

        Ports that report the same counter columns share one SWITCH_PORT block (normally
        all of them); a port whose leaves differ gets its own block rather than an invented
        value, since a uint64 counter has no "not read". Gauges never read are NaN.
        """
        rows = []
        derived = self.profile.derived
        for port in sorted(set(self.counters) | set(self.gauges), key=natural_key):
            counters = self.counters.get(port, {})
            values = {n: v for n, v in counters.items() if not n.startswith("~")}
            for out, parts in derived.items():
                if out not in values and all(p in counters for p in parts):
                    values[out] = sum(counters[p] for p in parts) & 0xFFFFFFFFFFFFFFFF
            gauges = self.gauges.get(port, {})
            if values or gauges:
                rows.append((port, values, gauges))
        if not rows:
            return None
        gauge_names = sorted({g for _, _, gs in rows for g in gs}, key=_column_key)
        blocks: dict[tuple[str, ...], pb.CounterBlock] = {}
        snap = pb.Snapshot(cluster=self.cluster, source=self.switch, source_kind=pb.SOURCE_KIND_SWITCH,
                           time_unix_ns=time_ns, seq=self.seq + 1)
        for port, values, gauges in rows:
            names = tuple(sorted(values, key=_column_key))
            block = blocks.get(names)
            if block is None:
                block = blocks[names] = snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT,
                                                        counter_names=names, gauge_names=gauge_names)
            block.entity_ids.append(port)
            block.counters.extend(values[n] for n in names)
            block.gauges.extend(gauges.get(g, math.nan) for g in gauge_names)
        if len(blocks) > 1:
            self.stats["split_blocks"] += 1
        self.seq += 1
        return snap
