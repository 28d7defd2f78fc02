"""The node collector: one process per GPU node, streaming its NICs and GPUs to the gateway.

    fabricwatch collect --config /etc/fabricwatch/collector.yaml
    fabricwatch collect --config collector.yaml --once --print     # one snapshot as JSON, nothing sent

Sources, each on its own interval (seconds, ``intervals:`` in the config):

==================  =======  ==============================================================
source              default  what
==================  =======  ==============================================================
``ethtool_pfc``     0.1      PFC / pause-storm / per-priority counters of each RoCE port's
                             netdev (``ethtool_stats``, the ioctl), plus that port's last
                             ``netdev_speed_mbps`` (line rate for the storm rule)
``ethtool``         1.0      phy / buffer / PCIe health counters of the same netdevs
``sysfs``           1.0      every RDMA port: PMA + hw counters, state/rate labels, netdev
                             speed, NIC PCIe link (``sysfs_nic``)
``nvml``            1.0      every GPU (``nvml_gpu``); XID events are queued by a thread and
                             go out with the next snapshot, whatever source it carries. The
                             slow NVML fields (ECC, remapped rows, PCIe replays, NVLink error
                             totals) only every ``nvml.slow_fields_s`` (10 s)
==================  =======  ==============================================================

Each tick sends one ``Snapshot`` (source = node name, ``seq`` + 1, ``time_unix_ns`` = the
tick's wall clock) holding the blocks of the sources due then. The gateway allows an entity
once per snapshot, so sources due together are merged into one row per port; to keep the
fast PFC layout identical on every tick, the slower sources run half a fast interval out of
phase (ticks at 0, 0.1, 0.2 s ... for PFC; 0.05, 1.05 ... for the others), and a port's PFC
columns always arrive in the same block layout 100 ms apart. A tick with nothing to send
(no RoCE port, no GPU) sends nothing and takes no ``seq``.

Snapshots go through `GatewaySender`: ``submit()`` never blocks, unacked batches are kept
and resent after an outage, up to ``gateway.max_buffered`` snapshots (oldest dropped after).
Reads run on one sampling thread, which also keeps the schedule, so a slow NVML call never
stalls the sender; a tick that falls behind is skipped and counted (``overruns``), never
queued.

Metrics (``--metrics-listen``): samples and overruns per source, counted per tick, and
the readers' field errors by kind, mirrored from their problem counters once a second.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import select
import threading
import time
from collections import Counter
from dataclasses import dataclass

from fabricwatch import metrics

from .ethtool_stats import EthtoolReader, picker
from .node_config import NodeConfig
from .nvml_gpu import GpuReader
from .sysfs_nic import NAN, EntityRow, NicReader, rows_to_blocks

log = logging.getLogger("fabricwatch.collect")

# Two sources whose due times are this close share a tick.
_SAME_TICK_S = 0.002
SOURCES = ("ethtool_pfc", "ethtool", "sysfs", "nvml")
_SAMPLES = {s: metrics.COLLECTOR_SAMPLES.labels(s) for s in SOURCES}
FIELD_ERRORS_SYNC_S = 1.0


# --------------------------------------------------------------------------- the collector
class _Halt:
    """The sampling thread's stop flag, which it also sleeps on between ticks.

    A timed ``poll()`` on a pipe: ``threading.Event.wait(t)`` costs about twice the CPU per
    wake-up (~150 µs against ~85 µs on the 2-vCPU VM, measured at 100 ms waits), and the PFC
    source wakes the thread ten times a second. ``poll`` rounds its timeout up to whole
    milliseconds, so a tick is at most ~1 ms late, never early.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        self._poller = select.poll()
        self._poller.register(self._read_fd, select.POLLIN)
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            os.write(self._write_fd, b"x")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True once the flag is set."""
        return bool(self._poller.poll(timeout_s * 1000.0)) or self._set

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


@dataclass
class _Schedule:
    source: str
    interval_s: float
    next_s: float


# A PFC tick is handed over at once, not after `gateway.linger_s`, when a port paused or was
# paused for at least this share of the tick on some priority: a storm's onset (the
# watchdog counts only ticks paused >= 80 %, for 200 ms) must not wait, while incast pauses
# (intermittent, well under half of a tick) cost no extra gRPC batch or Kafka record. A
# tick under half is never one the watchdog counts; the first that is goes at once, with
# the ticks held before it.
URGENT_PAUSE_DUTY = 0.5
# The same for a port that exports pause frame counts but no durations: frames per second.
URGENT_PAUSE_FRAMES_PER_S = 1000.0
# sysfs labels whose change (a link down or up, retrained to another speed or width) hands
# the tick over at once, as a pause does.
LINK_STATE_LABELS = ("state", "phys_state", "rate")


class PauseWatch:
    """Which of a PFC layout's columns tell that a port is pausing, and whether it is.

    >>> w = PauseWatch(("rx_prio3_bytes", "rx_prio3_pause", "rx_prio3_pause_duration"), interval_s=0.1)
    >>> w.pick((5, 7, 100))                     # durations say it best; frame counts only without them
    (100,)
    >>> w.pausing((100,), (300,)), w.pausing((100,), (60_100,))    # 200 us of 100 ms: incast; 60 ms: a storm
    (False, True)
    """

    def __init__(self, names: tuple[str, ...], interval_s: float) -> None:
        durations = [i for i, n in enumerate(names) if n.endswith("_pause_duration")]
        frames = [] if durations else [i for i, n in enumerate(names) if n.endswith("_pause")]
        storms = [i for i, n in enumerate(names) if n.startswith("tx_pause_storm_")]
        columns = durations + frames + storms
        self.pick = picker(columns)
        # per picked column: the increase per tick that means "pausing" (a storm event: any)
        self._limits = ([URGENT_PAUSE_DUTY * interval_s * 1e6] * len(durations)
                        + [URGENT_PAUSE_FRAMES_PER_S * interval_s] * len(frames) + [1] * len(storms))

    def pausing(self, before: tuple, now: tuple) -> bool:
        """Whether any column rose by its limit since ``before`` (a reset, going down, is not)."""
        return any(a - b >= limit for b, a, limit in zip(before, now, self._limits))


@dataclass
class _PfcTick:
    """One PFC tick's readings, before they become a Snapshot."""

    time_unix_ns: int
    seq: int
    readings: list[tuple]             # (entity id, netdev, counter names, counters, netdev_speed_mbps) per port
    events: list
    with_speed: bool
    urgent: bool = False              # a port paused (`PauseWatch`) or an XID arrived: do not linger


class NodeCollector:
    """Samples this node's sources and builds one ``Snapshot`` per tick.

    Parameters
    ----------
    config : the validated `NodeConfig`.
    nic_reader, ethtool_reader, gpu_reader : injected readers (tests); by default built from
        the config. ``gpu_reader=False`` disables NVML whatever the config says.
    """

    def __init__(self, config: NodeConfig, *, nic_reader: NicReader | None = None,
                 ethtool_reader: EthtoolReader | None = None, gpu_reader: GpuReader | None | bool = None) -> None:
        from fabricwatch.protos.v1 import telemetry_pb2 as pb

        self._pb = pb
        self.config = config
        self.source = config.source_name
        self.stats: Counter[str] = Counter()
        self.seq = 0
        self.nic = nic_reader or NicReader(config.sysfs_root, config.rediscover_s)
        self.ethtool: EthtoolReader | None = None
        if config.sources.ethtool:
            self.ethtool = ethtool_reader or EthtoolReader(config.ethtool.allow, config.ethtool.allow_fast,
                                                           source=config.ethtool.recorded_dir or "auto")
        self.gpu: GpuReader | None = None
        self.nvml_unavailable = ""                 # why there is no GPU source, in one line
        if config.sources.nvml and gpu_reader is not False:
            reader = gpu_reader or GpuReader(nvlink=config.nvml.nvlink, xid_events=config.nvml.xid_events,
                                             energy=config.nvml.energy, slow_every=config.nvml_slow_every)
            if reader.gpus or reader.open():
                self.gpu = reader
            else:
                self.nvml_unavailable = reader.unavailable
                self.stats["nvml_unavailable"] = 1
        self._speed: dict[str, float] = {}        # entity id -> last netdev_speed_mbps from sysfs
        self._pfc_ports_of: list | None = None     # the nic.ports list that _pfc_ports was made from
        self._pfc_ports: list[tuple[str, str]] = []   # (entity id, netdev) of the RoCE ports
        self._pfc_last: dict[str, tuple] = {}         # entity id -> its pause columns at the last tick
        self._pause_watches: dict[tuple, PauseWatch] = {}   # counter names -> which columns are pauses
        self._link_last: dict[str, tuple] | None = None    # entity id -> its LINK_STATE_LABELS at the last sysfs read
        self._link_changed = False

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
        if self.ethtool is not None:
            self.ethtool.close()
        self.nic.close()

    def _note_link_changes(self, rows: dict[str, EntityRow]) -> None:
        """A port whose state, physical state or rate changed since the last sysfs read makes
        this tick urgent: a link going down or training low must not wait for the linger."""
        now = {e: tuple(r.labels.get(k, "") for k in LINK_STATE_LABELS) for e, r in rows.items()}
        if self._link_last is not None and self.config.gateway.flush_on_pause and any(
                self._link_last.get(e, v) != v for e, v in now.items()):
            self._link_changed = True
            self.stats["link_change_ticks"] += 1
        self._link_last = now

    def take_link_change(self) -> bool:
        """Whether a link changed since the last call (and forget it)."""
        changed, self._link_changed = self._link_changed, False
        return changed

    # -- which sources run ----------------------------------------------------------------------
    def enabled_sources(self) -> list[str]:
        out = []
        if self.ethtool is not None:
            out += ["ethtool_pfc", "ethtool"]
        if self.config.sources.sysfs:
            out.append("sysfs")
        if self.gpu is not None:
            out.append("nvml")
        return out

    def schedule(self, start_s: float) -> list[_Schedule]:
        """First due time of each source: the fastest at 0, the others half its interval later."""
        iv = self.config.intervals
        enabled = self.enabled_sources()
        fastest = min(getattr(iv, s) for s in enabled)
        return [_Schedule(s, getattr(iv, s), start_s + (0.0 if getattr(iv, s) == fastest else fastest / 2))
                for s in enabled]

    # -- one tick -------------------------------------------------------------------------------
    def collect(self, due: set[str] | frozenset[str] | None = None):
        """Read the sources in ``due`` (default: all enabled) into one Snapshot; None if empty."""
        pb = self._pb
        due = set(self.enabled_sources()) if due is None else set(due)
        if due == {"ethtool_pfc"} and self.ethtool is not None:
            return self._collect_pfc()
        t_ns = time.time_ns()
        rows: dict[str, EntityRow] = {}
        ports = self.nic.ports
        if "sysfs" in due:
            for row in self.nic.sample():
                rows[row.entity_id] = row
                self._speed[row.entity_id] = row.gauges.get("netdev_speed_mbps", NAN)
            self._note_link_changes(rows)
        if self.ethtool is not None and ("ethtool" in due or "ethtool_pfc" in due):
            groups = [g for g, s in (("slow", "ethtool"), ("fast", "ethtool_pfc")) if s in due]
            group = groups[0] if len(groups) == 1 else "all"
            for port in ports:
                if port.link_layer != "Ethernet" or not port.netdev:
                    continue                          # IB ports have no PFC; no netdev, no ethtool
                values = self.ethtool.read(port.netdev, group)
                if not values:
                    continue
                extra = EntityRow(port.entity_id, dict(values), {}, {"netdev": port.netdev})
                row = rows.get(port.entity_id)
                if row is None:
                    if "ethtool_pfc" in due and self.config.sources.sysfs:
                        # the line rate for the storm rule: the last sysfs reading (<= one sysfs
                        # interval old; NaN before the first), so the PFC layout never changes
                        extra.gauges["netdev_speed_mbps"] = self._speed.get(port.entity_id, NAN)
                    rows[port.entity_id] = extra
                else:
                    row.merge(extra)
        gpu_rows = self.gpu.sample() if (self.gpu is not None and "nvml" in due) else []
        events = self.gpu.drain_events() if self.gpu is not None else []
        if not rows and not gpu_rows and not events:
            self.stats["empty_ticks"] += 1
            return None
        self.seq += 1
        snap = pb.Snapshot(cluster=self.config.cluster, source=self.source, source_kind=pb.SOURCE_KIND_NODE,
                           time_unix_ns=t_ns, seq=self.seq)
        rows_to_blocks(pb.ENTITY_KIND_NIC_PORT, rows.values(), into=snap.blocks)
        rows_to_blocks(pb.ENTITY_KIND_GPU, gpu_rows, into=snap.blocks)
        for e in events:
            snap.events.add(entity_id=e.entity_id, kind=e.kind, code=e.code, time_unix_ns=e.time_unix_ns,
                            detail=e.detail)
        self.stats["snapshots"] += 1
        self.stats["xid_events"] += len(events)
        return snap

    def _collect_pfc(self):
        """A PFC-only tick, built column-wise (the 10 Hz hot path; the same layout as `collect`)."""
        tick = self._read_pfc()
        return None if tick is None else self._build_pfc(tick)

    def _read_pfc(self) -> _PfcTick | None:
        """The PFC tick's readings (takes the ``seq``); `_build_pfc` makes them a Snapshot.

        The run loop builds the snapshots of a group together at hand-over: built right after
        each read, 100 ms apart, the protobuf work ran on cold caches and cost ~5x more. For
        the same reason a tick only reads; the ports are grouped into blocks at hand-over.
        """
        t_ns = time.time_ns()
        ports = self.nic.ports
        if ports is not self._pfc_ports_of:          # a new discovery: list the RoCE ports once
            self._pfc_ports_of = ports
            self._pfc_ports = [(p.entity_id, p.netdev) for p in ports if p.link_layer == "Ethernet" and p.netdev]
        read, speed, last, watches = self.ethtool.read_columns, self._speed, self._pfc_last, self._pause_watches
        readings = []
        moved = False
        for entity_id, netdev in self._pfc_ports:
            got = read(netdev, "fast")
            if got and got[0]:
                names, values = got
                watch = watches.get(names)
                if watch is None:
                    watch = watches[names] = PauseWatch(names, self.config.intervals.ethtool_pfc)
                pauses = watch.pick(values)
                before = last.get(entity_id)
                if before is not None and before != pauses and not moved:   # the common case is equal
                    moved = watch.pausing(before, pauses)
                last[entity_id] = pauses
                readings.append((entity_id, netdev, names, values, speed.get(entity_id, NAN)))
        events = self.gpu.drain_events() if self.gpu is not None else []
        if not readings and not events:
            self.stats["empty_ticks"] += 1
            return None
        self.seq += 1
        self.stats["snapshots"] += 1
        self.stats["xid_events"] += len(events)
        urgent = self.config.gateway.flush_on_pause and (moved or bool(events))
        self.stats["urgent_ticks"] += urgent
        return _PfcTick(t_ns, self.seq, readings, events, self.config.sources.sysfs, urgent)

    def _build_pfc(self, tick: _PfcTick):
        pb = self._pb
        snap = pb.Snapshot(cluster=self.config.cluster, source=self.source, source_kind=pb.SOURCE_KIND_NODE,
                           time_unix_ns=tick.time_unix_ns, seq=tick.seq)
        groups: dict[tuple, list] = {}               # counter names -> ids, counters, speeds, netdevs
        for entity_id, netdev, names, values, speed in tick.readings:
            g = groups.get(names)
            if g is None:
                g = groups[names] = [[], [], [], []]
            g[0].append(entity_id)
            g[1].extend(values)
            g[2].append(speed)
            g[3].append(netdev)
        with_speed = tick.with_speed
        for names, (ids, counters, speeds, netdevs) in groups.items():
            snap.blocks.add(entity_kind=pb.ENTITY_KIND_NIC_PORT, entity_ids=ids, counter_names=names,
                            counters=counters, gauge_names=("netdev_speed_mbps",) if with_speed else (),
                            gauges=speeds if with_speed else (), labels=[pb.LabelColumn(name="netdev", values=netdevs)])
        for e in tick.events:
            snap.events.add(entity_id=e.entity_id, kind=e.kind, code=e.code, time_unix_ns=e.time_unix_ns,
                            detail=e.detail)
        return snap

    # -- the loop -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, sender=None, on_snapshot=None, max_snapshots: int | None = None,
                  linger_s: float | None = None) -> Counter:
        """Tick until ``stop`` is set; snapshots go to ``on_snapshot`` and ``sender.submit``
        in groups, ``linger_s`` (default ``gateway.linger_s``) after the first of a group.

        One sampling thread keeps the schedule and reads every due source (`_sample_loop`);
        the event loop only receives the groups. Two measured reasons, on the 2-vCPU VM:

        * a thread's timed wait costs less than half of an asyncio timer wake-up (~0.1 %
          against ~0.26 % of a core at the 10 Hz of the PFC source), and the 1 s tick no
          longer needs a hand-off to an executor thread and back;
        * handing several snapshots over at once lets the sender put them in one gRPC batch:
          one write and one ack instead of one per tick (~1.7 ms per batch round trip).

        The price is up to ``linger_s`` more delivery latency; event times are not affected.
        An exception raised by a reader stops the loop and is raised here.
        """
        loop = asyncio.get_running_loop()
        linger = self.config.gateway.linger_s if linger_s is None else linger_s
        halt = _Halt()
        finished = asyncio.Event()
        failure: list[BaseException] = []

        def deliver(group: list) -> None:
            for snap in group:
                if on_snapshot is not None:
                    on_snapshot(snap)
                if sender is not None:
                    sender.submit(snap)

        def sample() -> None:
            try:
                leftover = self._sample_loop(halt, lambda g: loop.call_soon_threadsafe(deliver, g), linger,
                                             max_snapshots, sender)
                loop.call_soon_threadsafe(deliver, leftover)     # nothing collected is left behind
            except BaseException as exc:   # noqa: BLE001 - handed to the caller of run()
                failure.append(exc)
            finally:
                try:
                    loop.call_soon_threadsafe(finished.set)
                except RuntimeError:       # the loop is gone: nobody is waiting
                    pass

        thread = threading.Thread(target=sample, name="fabricwatch-collect", daemon=True)
        thread.start()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(finished.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            halt.set()
            for w in waits:
                w.cancel()
            try:
                await finished.wait()              # the thread's last groups are delivered before this
            finally:
                if finished.is_set():              # the thread is done with it (a cancelled wait: not yet)
                    halt.close()
        if failure:
            raise failure[0]
        return self.stats

    def _sample_loop(self, halt: _Halt, hand_over, linger: float, max_snapshots: int | None,
                     sender) -> list:
        """The sampling thread: wait for the next due source, read, build, group; returns the
        group not yet handed over when ``halt`` is set or ``max_snapshots`` is reached."""
        plan = self.schedule(time.monotonic())
        held: list = []
        held_since = 0.0
        last_report = last_sync = time.monotonic()
        field_errors = metrics.CounterMirror(metrics.COLLECTOR_FIELD_ERRORS)
        while not halt.is_set():
            wake = min(s.next_s for s in plan)
            if held:
                wake = min(wake, held_since + linger)
            delay = wake - time.monotonic()
            if delay > 0:
                if halt.wait(min(delay, 1.0)):
                    break
                if time.monotonic() < wake - _SAME_TICK_S:
                    continue
            now = time.monotonic()
            due = set()
            for s in plan:
                if s.next_s <= now + _SAME_TICK_S:
                    due.add(s.source)
                    s.next_s += s.interval_s
                    if s.next_s <= now:     # fell behind: skip the missed ticks, never queue them
                        missed = math.floor((now - s.next_s) / s.interval_s) + 1
                        s.next_s += missed * s.interval_s
                        self.stats[f"overruns_{s.source}"] += missed
                        metrics.COLLECTOR_OVERRUNS.labels(s.source).inc(missed)
            for source in due:
                _SAMPLES[source].inc()
            if due == {"ethtool_pfc"} and self.ethtool is not None:
                item = self._read_pfc()            # built with its group, below
            else:
                item = self.collect(due) if due else None
            if item is not None:
                if not held:
                    held_since = now
                held.append(item)
            urgent = (isinstance(item, _PfcTick) and item.urgent) or self.take_link_change()
            if held and (urgent or time.monotonic() - held_since >= linger - _SAME_TICK_S):
                hand_over(self._built(held))
                held = []
            if max_snapshots is not None and self.stats["snapshots"] >= max_snapshots:
                break
            if now - last_sync >= FIELD_ERRORS_SYNC_S:
                last_sync = now
                try:
                    field_errors.sync(self.problems())
                except RuntimeError:   # the NVML XID thread added a kind mid-merge: next second
                    pass
            if now - last_report >= 60:
                last_report = now
                self.log_stats(sender)
        return self._built(held)

    def _built(self, held: list) -> list:
        return [self._build_pfc(x) if isinstance(x, _PfcTick) else x for x in held]

    def problems(self) -> Counter:
        out: Counter[str] = Counter()
        out.update(self.nic.problems.counts)
        if self.ethtool is not None:
            out.update(self.ethtool.problems.counts)
        if self.gpu is not None:
            out.update(self.gpu.problems.counts)
        return out

    def log_stats(self, sender) -> None:
        parts = dict(self.stats)
        parts.update({f"problem_{k}": v for k, v in self.problems().items()})
        if sender is not None:
            parts.update({f"sender_{k}": v for k, v in sender.stats.items()})
            parts["buffered"] = sender.buffered
        log.info("collector: %s", " ".join(f"{k}={v}" for k, v in sorted(parts.items())))
