"""Drops on a lossless priority without a link event: buffer or headroom misconfiguration.

PFC (IEEE 802.1Qbb) makes a priority lossless: an ingress priority group that fills to
XOFF pauses its upstream, and the *headroom* above XOFF absorbs what is still in flight
(cable delay + the peer's reaction time + an MTU each way: 802.1Qbb Annex N; SONiC's
``BUFFER_PG`` ``xoff`` size, computed by the buffer manager from cable length and speed).
With headroom and buffer profiles right, a lossless queue drops nothing, and sonic-mgmt's
PFC tests (``qos/test_qos_sai.py`` ``testQosSaiLossyQueue`` vs ``testQosSaiPfcXoffLimit``)
fail a lossless queue on a single drop. A drop on a lossless priority on a live link
therefore means the headroom is too small for the cable/speed, the buffer pool is
oversubscribed, a lossless priority lacks PFC on one side, or WRED drops (instead of
marks) on that queue. During a link event (a flap, a down, a burst of uncorrectable FEC
codewords) frames in flight are lost whatever the buffers: such drops are the link's.

Counters read (`fabricwatch.counters`), for each priority in the lossless set:

* switch queue ``queue<p>-dropped-pkts`` (SONiC ``SAI_QUEUE_STAT_DROPPED_PACKETS``,
  OpenConfig ``dropped-pkts``), ``queue<p>-no-buffer-dropped-pkts`` and
  ``queue<p>-wred-dropped-pkts`` (Cumulus ``no-buffer-uc-dropped-pkts`` /
  ``wred-dropped-pkts``); link events: ``interface-transitions``, ``oper_up`` == 0,
  ``in-fec-uncorrectable-frames``;
* NIC (mlx5 ``ethtool -S``) ``rx_prio<p>_buf_discard`` and ``rx_prio<p>_discards``; link
  events: ``link_down_events_phy`` / ``link_downed``, ``rx_pcs_symbol_err_phy``,
  ``netdev_speed_mbps`` < 0 (no carrier).

Drops are summed per port and priority over windows of `WINDOW_S`; a window with at least
`MIN_DROPPED_PKTS` drops on a lossless priority and no link event on that port in the window
or the `LINK_EVENT_GRACE_S` before it opens a ``lossless_drop``; `CLEAR_WINDOWS` clean
windows resolve it. Drops on a lossy priority are normal (that is what lossy means).

>>> import numpy as np
>>> from fabricwatch.models.frames import FrameStack, SourceBatch
>>> names = ("queue3-dropped-pkts", "queue0-dropped-pkts", "interface-transitions")
>>> def tick(t_s, lossless, lossy, transitions=0.0):
...     s = FrameStack("switch_port", ("Ethernet4",), names, (), np.array([0]),
...                    np.zeros((1, 1, 3), np.uint64), np.empty((1, 1, 0)))
...     s.rates, s.dt_s = np.array([[[lossless, lossy, transitions]]]), np.array([1.0])
...     return SourceBatch("c1", "leaf-1", "switch", np.array([int(t_s * 1e9)]), [s])
>>> det = LosslessDropDetector()
>>> [f for t in range(1, 40) for f in det.update_batch(tick(t, 0, 500))]     # lossy drops: normal
[]
>>> found = [f for t in range(40, 60) for f in det.update_batch(tick(t, 30, 0))]
>>> [(f.kind, f.state, f.entity.path(), f.evidence[0].value) for f in found]
[('lossless_drop', 'open', 'c1/leaf-1/queue3/Ethernet4', 300.0)]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector
from .findings import OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from .frames import NIC_PORT, SWITCH_PORT, FrameStack, SourceBatch
from .vocabulary import HEADROOM_MISCONFIG, LOSSLESS_DROP

DETECTOR = "lossless_drop/v1"
KIND = LOSSLESS_DROP
CAUSE = HEADROOM_MISCONFIG
# PFC-enabled priorities: SONiC's default lossless queues ("pfc_enable": "3,4").
LOSSLESS_PRIORITIES = (3, 4)
# Drops summed per port over this window: one judgement per port per window.
WINDOW_S = 10.0
# A lossless queue drops nothing when its headroom is right (sonic-mgmt fails on one):
# a single dropped packet is evidence.
MIN_DROPPED_PKTS = 1.0
# A link event this recently (or in the window) owns the drops: frames in flight are lost
# as a link goes down, and PFC state restarts with the retrained link.
LINK_EVENT_GRACE_S = 30.0
# Clean windows in a row (on a port that reports) that resolve an open finding.
CLEAR_WINDOWS = 6
# Ports tracked at most (bounded state).
MAX_PORTS = 200_000

_SWITCH_DROPS = {p: (f"queue{p}-dropped-pkts", f"queue{p}-no-buffer-dropped-pkts", f"queue{p}-wred-dropped-pkts")
                 for p in LOSSLESS_PRIORITIES}
_NIC_DROPS = {p: (f"rx_prio{p}_buf_discard", f"rx_prio{p}_discards") for p in LOSSLESS_PRIORITIES}
_LINK_COUNTERS = ("interface-transitions", "in-fec-uncorrectable-frames", "link_down_events_phy", "link_downed",
                  "rx_pcs_symbol_err_phy")


@dataclass
class _Port:
    start_ns: int = 0
    drops: np.ndarray = field(default_factory=lambda: np.zeros(len(LOSSLESS_PRIORITIES)))
    last_event_ns: int = -(2**62)
    clean: int = 0
    open: dict = field(default_factory=dict)     # prio index -> open Finding


def _layout(stack: FrameStack) -> tuple[list[list[int]], list[int], int | None, int | None]:
    table = _SWITCH_DROPS if stack.kind == SWITCH_PORT else _NIC_DROPS
    drops = [[c for c in (stack.column(n) for n in table[p]) if c is not None] for p in LOSSLESS_PRIORITIES]
    links = [c for c in (stack.column(n) for n in _LINK_COUNTERS) if c is not None]
    oper = stack.gauge_column("oper_up") if stack.kind == SWITCH_PORT else None
    speed = stack.gauge_column("netdev_speed_mbps") if stack.kind == NIC_PORT else None
    return drops, links, oper, speed


class LosslessDropDetector(Detector):
    """Stage-1 rule: drops on a PFC-protected priority of a live port (switch or NIC)."""

    def __init__(self) -> None:
        self._ports: dict[tuple[str, str], _Port] = {}
        self._tracked: dict[str, set[str]] = {}      # source -> its remembered ports
        self._layouts: dict[tuple, tuple] = {}

    def screen(self, group) -> None:
        """Nothing to share across records: a record costs a layout lookup and a few sums."""

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        out: list[Finding] = []
        for stack in batch.stacks:
            if stack.kind not in (SWITCH_PORT, NIC_PORT) or stack.rates is None or stack.dt_s is None:
                continue
            key = (stack.kind, stack.counter_names, stack.gauge_names)
            layout = self._layouts.get(key)
            if layout is None:
                if len(self._layouts) >= 4096:
                    self._layouts.clear()
                layout = self._layouts[key] = _layout(stack)
            if any(layout[0]):
                out += self._update(batch, stack, layout)
        return out

    def _update(self, batch: SourceBatch, stack: FrameStack, layout: tuple) -> list[Finding]:
        drop_cols, link_cols, oper, speed = layout
        dt = np.nan_to_num(np.asarray(stack.dt_s, float))
        times = stack.times_ns if stack.times_ns is not None else batch.times_ns
        shape = stack.rates.shape[:2]
        # [tick, port, prio]: the largest of the counters of each priority (they overlap on mlx5);
        # NaN (a reset, the first tick) is no evidence
        drops = np.stack([np.nan_to_num(stack.rates[:, :, c]).max(axis=2) if c else np.zeros(shape)
                          for c in drop_cols], axis=2) * dt[:, None, None]
        event = (np.nan_to_num(stack.rates[:, :, link_cols]).sum(axis=2) > 0) if link_cols else np.zeros(shape, bool)
        if oper is not None:
            event |= stack.gauges[:, :, oper] == 0
        if speed is not None:
            event |= stack.gauges[:, :, speed] < 0
        # ports that dropped or had a link event, and those already remembered; the rest is quiet
        active = set(np.flatnonzero((drops.sum(axis=(0, 2)) > 0) | event.any(axis=0)).tolist())
        tracked = self._tracked.get(batch.source)
        if tracked:
            active |= {i for i, eid in enumerate(stack.ids) if eid in tracked}
        out: list[Finding] = []
        for i in sorted(active):
            out += self._port(batch, stack.ids[i], times, dt, drops[:, i], event[:, i])
        return out

    def _port(self, batch: SourceBatch, eid: str, times: np.ndarray, dt: np.ndarray, drops: np.ndarray,
              event: np.ndarray) -> list[Finding]:
        key = (batch.source, eid)
        port = self._ports.get(key)
        if port is None:
            if len(self._ports) >= MAX_PORTS:
                self._forget(next(iter(self._ports)))
            self._tracked.setdefault(batch.source, set()).add(eid)
            port = self._ports[key] = _Port(start_ns=int(times[0] - dt[0] * 1e9))   # the first tick's interval
        out: list[Finding] = []
        for k in range(len(times)):
            t = int(times[k])
            if event[k]:
                port.last_event_ns = t
            port.drops += drops[k]
            if t - port.start_ns >= WINDOW_S * 1e9:
                out += self._judge(batch, eid, port, t)
                port.start_ns, port.drops = t, np.zeros(len(LOSSLESS_PRIORITIES))
        if not port.open and not port.drops.any() and t - port.last_event_ns > LINK_EVENT_GRACE_S * 1e9:
            self._forget(key)                         # nothing to remember: quiet ports cost nothing
        return out

    def _forget(self, key: tuple[str, str]) -> None:
        del self._ports[key]
        tracked = self._tracked.get(key[0])
        if tracked is not None:
            tracked.discard(key[1])
            if not tracked:
                del self._tracked[key[0]]

    def _judge(self, batch: SourceBatch, eid: str, port: _Port, now_ns: int) -> list[Finding]:
        out: list[Finding] = []
        linked = now_ns - port.last_event_ns <= (WINDOW_S + LINK_EVENT_GRACE_S) * 1e9
        dropped = (port.drops >= MIN_DROPPED_PKTS) & (not linked)
        for j, prio in enumerate(LOSSLESS_PRIORITIES):
            if dropped[j] and j not in port.open:
                f = port.open[j] = self._finding(batch, eid, prio, float(port.drops[j]), port.start_ns, now_ns)
                out.append(f)
        if dropped.any() or linked:
            port.clean = 0
        else:
            port.clean += 1
            if port.clean >= CLEAR_WINDOWS:
                for j in sorted(port.open):
                    f = port.open.pop(j)
                    out.append(Finding(**{**f.__dict__, "state": RESOLVED, "detected_ns": now_ns,
                                          "evidence": list(f.evidence), "related": list(f.related)}))
        return out

    @staticmethod
    def _finding(batch: SourceBatch, eid: str, prio: int, dropped: float, start_ns: int, now_ns: int) -> Finding:
        if batch.source_kind == "switch":
            entity = EntityRef(cluster=batch.cluster, switch=batch.source, device=f"queue{prio}", port=eid)
            where = f"port {eid} priority {prio} on switch {batch.source}"
            action = (f"headroom/buffer misconfiguration: check the PG headroom (xoff size) and the buffer profile "
                      f"of {where} (SONiC BUFFER_PG / BUFFER_PROFILE; the cable length it was computed for), that "
                      f"PFC is enabled for priority {prio} on both ends, and that WRED on queue {prio} marks "
                      "rather than drops")
        else:
            device, _, p = eid.partition("/")
            entity = EntityRef(cluster=batch.cluster, node=batch.source, device=device, port=p)
            where = f"NIC {eid} priority {prio} on {batch.source}"
            action = (f"check the NIC's PFC and buffer configuration (mlnx_qos -i <netdev> --pfc: priority {prio} "
                      "enabled; --buffer_size / --prio2buffer: a lossless buffer large enough for the cable), and "
                      "that the switch port sends PFC for it")
        return Finding(
            KIND, OPEN, entity, severity=WARNING, onset_ns=start_ns, detected_ns=now_ns,
            evidence=[Evidence("lossless_dropped_pkts", round(dropped, 1), MIN_DROPPED_PKTS, "packets",
                               f"packets dropped on lossless priority {prio} in {WINDOW_S:g} s"),
                      Evidence("link_event_free_s", LINK_EVENT_GRACE_S, LINK_EVENT_GRACE_S, "s",
                               "no flap, down or uncorrectable FEC on the port in the window or before it")],
            probable_cause=(f"drops on PFC-protected priority {prio} of a live link: the headroom above XOFF or the "
                            "lossless buffer pool is too small, PFC is off on one end, or WRED drops on the queue"),
            cause=CAUSE, suggested_action=action,
            summary=f"{dropped:.0f} packets dropped on lossless {where} without a link event",
            detector=DETECTOR)
