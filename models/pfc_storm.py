"""PFC watchdog: per-source countdowns that confirm when a port is held by PFC, or holds its peer.

Reads, per tick of one node or switch (rates from `rates.RateTracker`, in s/s for pause
durations, i.e. the pause duty):

* NIC ports (``ethtool -S`` on mlx5): ``rx_prio<p>_pause_duration``,
  ``tx_prio<p>_pause_duration``, ``tx_prio<p>_bytes`` / ``rx_prio<p>_bytes`` (else
  ``*_packets``), ``port_xmit_wait``, gauge ``netdev_speed_mbps``; evidence only:
  ``tx_pause_storm_warning_events`` / ``tx_pause_storm_error_events``.
* Switch ports: ``pfc<p>-rx-pause-duration-us``, ``queue<p>-transmit-octets`` (else
  ``-pkts``), gauges ``queue<p>-occupancy-bytes``, ``port_speed_gbps``, ``oper_up``.

Every lossless priority that has a pause-duration column is watched. Emits
`PauseStateChange` records, only on a confirmed onset and on a restoration: it detects,
it never acts (the storm's source is named by `storm_locator.StormLocator`).

Rules, per (port, priority), each a single condition over one sampling interval, and
each needs something to be stuck behind the pause (SONiC sonic-mgmt ``test_pfcwd_no_traffic``:
pause frames with nothing queued are not a storm):

* **paused** (the port's egress on p is held; SONiC's Mellanox rule, PR sonic-swss#3036):
  received-pause duty >= ``paused_duty_min`` **and** it transmits on p at most
  ``1 - paused_duty_min`` of line rate (a port paused d of the time can carry no more,
  so more means the counters disagree) **and** it has something to send: a switch queue
  with ``queue<p>-occupancy-bytes > 0`` (where the gauge was read: an empty queue is not
  held); a NIC whose ``port_xmit_wait`` rose ("ticks with data to send but nothing sent";
  port-wide, not per priority) **or** that sent on p within the last ``DEMAND_LOOKBACK_S``.
  ``port_xmit_wait`` is a saturating 32-bit PortCounter: pinned at all-ones its rate is
  NaN (unknown), never zero, and the traffic decides; so it does without the column or
  the gauge.
* **pausing** (the port keeps its peer silent): transmitted-pause duty >=
  ``pausing_duty_min`` **and** it receives on p at most ``1 - pausing_duty_min`` of line
  rate **and** it received on p within the last ``DEMAND_LOOKBACK_S`` (the peer had data
  for it). A NIC that pauses continuously while receiving ~nothing is the classic
  stuck-host storm source; one on an idle node, with nothing sent to it, holds nothing.
  A switch port is *pausing* from SAI ``PFC_x_TX_PAUSE_DURATION_US``
  (``pfc<p>-tx-pause-duration-us``, SONiC) and its port-wide ``in-octets`` (a switch counts
  ingress per port, which bounds p's); switches that export no transmit duration (EOS,
  Cumulus: frame counts only, which healthy XOFF/XON episodes inflate more than a steady
  XOFF refreshed at half-quanta does) leave it to the locator, which reads a switch port's
  pausing from its peer being *paused*. A tick without the column says nothing about it.

Timers (SONiC pfcwd, with the real-elapsed-time charging of PR sonic-swss#4881): each
agreeing sample charges the detection countdown with the real elapsed time since the
previous sample of that source (``frame.dt_s``), capped at ``detection_time - 1 ns``, so
at least two agreeing samples are needed; any other sample resets it. NaN (first sample,
counter reset after a reboot) is no evidence: it resets the countdown, never confirms;
so does a switch port that is admin or oper down. While active, samples below the duty
threshold charge the restoration countdown the same way; a sample still at the threshold
resets it; a NaN sample holds it. A countdown within ``TIMER_TOLERANCE_FRACTION`` of zero
has run out (sample timestamps jitter by ~0.3 ms, which would otherwise turn SONiC's own
poll = detect / 2 into three polls half the time).

Thresholds. ``paused_duty_min`` is 0.8, not SONiC's 0.99: SONiC acts (drops) on the held
queue itself, which is paused ~100 % of the time; here *paused* also names the victims
upstream of it, which the propagation pauses 85-99 % of the time (short gaps as the
leaf's buffers drain). Healthy incast pauses stay well below (< 0.6 per interval in the
simulator's noisy cluster, intermittently). ``pausing_duty_min`` is 0.95: only a receiver
that has stopped draining pauses its peer 95 % of two consecutive intervals.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> from fabricwatch.models.rates import RateTracker
>>> names = ("rx_prio3_pause_duration", "tx_prio3_pause_duration", "rx_prio3_bytes", "tx_prio3_bytes")
>>> tracker, wd = RateTracker(), PfcWatchdog()
>>> def tick(k, tx_pause_us, rx_bytes):        # one NIC port, sampled every 100 ms
...     f = EntityFrame("nic_port", ("mlx5_2/1",), names, np.array([[0, tx_pause_us, rx_bytes, 0]], np.uint64),
...                     (), np.empty((1, 0)), [{}])
...     tracker.update("node-0003", f, k * 100_000_000)
...     return wd.update(SourceView("c1", "node-0003", "node", k * 100_000_000, k, [f]))
>>> tick(0, 0, 0), tick(1, 99_900, 10**8)     # 1 GB/s came in while it paused: 100 ms charged
([], [])
>>> [(c.entity.path(), c.priority, c.role, c.active, c.onset_ns) for c in tick(2, 199_800, 10**8)]
[('c1/node-0003/mlx5_2/1', 3, 'pausing', True, 0)]
>>> [(c.role, c.active, c.at_ns) for k in range(3, 8) for c in tick(k, 199_800, 10**8)]   # quiet 400 ms
[('pausing', False, 600000000)]
>>> wd, tracker = PfcWatchdog(), RateTracker()          # the same pauses with nothing sent to it
>>> [c for k in range(6) for c in tick(k, k * 99_900, 0)]
[]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fabricwatch.counters import PFC_PRIORITIES

from .detector import Feeder
from .findings import EntityRef, Evidence
from .frames import NIC_PORT, SWITCH_PORT, EntityFrame, LayoutGroup, SourceBatch, SourceView

DETECTOR = "pfc_watchdog/v1"
PAUSED, PAUSING = "paused", "pausing"

# Timer ranges and defaults of SONiC's pfcwd CLI (sonic-utilities pfcwd/main.py).
DETECTION_TIME_MIN_MS, DETECTION_TIME_MAX_MS = 100, 5000
RESTORATION_TIME_MIN_MS, RESTORATION_TIME_MAX_MS = 100, 60000
DEFAULT_DETECTION_TIME_MS = 200
# Restoration = 2 x detection when not given (pfcwd CLI).
RESTORATION_PER_DETECTION = 2
# Received-pause duty at which a port counts as held (victims included; see module doc).
PAUSED_DUTY_MIN = 0.8
# Transmitted-pause duty at which a NIC counts as holding its peer silent.
PAUSING_DUTY_MIN = 0.95
# Every storm needs this many agreeing samples, whatever the elapsed time (PR #4881).
MIN_AGREEING_SAMPLES = 2
# A countdown within this fraction of its length has run out (timestamp jitter).
TIMER_TOLERANCE_FRACTION = 0.01
# Something is stuck behind a pause when traffic flowed on p this recently (sent, for the
# paused role where neither a rising port_xmit_wait nor a queue occupancy gauge says so;
# received, for the pausing role): a storm stops the traffic it holds, so the evidence is
# the traffic just before the onset. SONiC test_pfcwd_no_traffic: pauses with nothing
# queued are not a storm.
# "Recently" is counted back from the start of the agreeing run (the interval being judged,
# or the first of the run), plus one sampling interval (the interval before the run holds
# the onset, and timestamps jitter), so a long sampling interval or a gap does not age it out.
DEMAND_LOOKBACK_S = 1.0
# Traffic that counts as demand: 100 kB/s, ~3 orders above control-plane chatter (LLDP, ARP:
# a few hundred B/s) and ~5 below one busy RDMA flow; an idle port sends nothing on p.
DEMAND_MIN_BYTES_PER_S = 1e5
# Line rate assumed when a port exports no speed gauge, or it reads NaN (not read) or <= 0.
DEFAULT_LINE_RATE_GBPS = 400.0
# Bytes per packet when only packet counters exist: a jumbo frame, so traffic is
# over- rather than under-estimated (errs towards "traffic flows", i.e. no storm).
MAX_WIRE_PACKET_BYTES = 9216.0

# Distinct block layouts remembered (a fleet has a handful; more is id churn).
MAX_LAYOUTS = 4096
_ROLES = (PAUSED, PAUSING)       # axis 1 of every state array; switch ports are never "pausing"
_KINDS = (NIC_PORT, SWITCH_PORT)
_NEVER = np.iinfo(np.int64).min // 2


@dataclass
class PauseStateChange:
    """A confirmed onset (``active``) or restoration of one port's pause state on one priority.

    ``role`` is "paused" (its egress on ``priority`` is held by its peer) or "pausing" (it
    keeps its peer silent). ``onset_ns`` is the start of the first agreeing interval;
    ``at_ns`` the event time of the sample that confirmed the onset or the restoration.
    """

    entity: EntityRef
    priority: int
    role: str
    active: bool
    onset_ns: int
    at_ns: int
    evidence: list[Evidence] = field(default_factory=list)

    def value(self, name: str, default: float = float("nan")) -> float:
        """The value of the named evidence (NaN if absent)."""
        for e in self.evidence:
            if e.name == name:
                return e.value
        return default


@dataclass(frozen=True)
class _Layout:
    """Where the rule's inputs live in one block's columns, gathered in one fancy index.

    Gathered row layout: [rx duty (P), tx duty (P), tx traffic (P), rx traffic (P), xmit_wait].
    A missing duty column reads NaN (no evidence); a missing traffic column reads 0 (the
    traffic check is skipped: the duty already bounds it physically; and it is never
    evidence of demand).
    """

    prios: tuple[int, ...]
    gather: np.ndarray         # [4P + 1] column indices into `frame.rates`
    nan_pos: np.ndarray        # positions of the gathered row to overwrite with NaN
    zero_pos: np.ndarray       # ... with 0
    scale: np.ndarray          # [2, P] traffic to bytes/s: row 0 tx (checked when paused), row 1 rx (pausing)
    has_xmit_wait: bool
    occupancy: np.ndarray      # [P] gauge columns (valid where has_occupancy)
    has_occupancy: np.ndarray  # [P] bool
    speed: int | None          # gauge column of the line rate
    speed_to_bytes: float      # gauge unit -> bytes/s
    default_speed: float       # DEFAULT_LINE_RATE_GBPS in the gauge's unit
    oper_up: int | None
    storm_events: tuple[int | None, int | None]

    scale_is_one: bool         # all traffic in bytes (no packet-count fallback)
    demand_raw: np.ndarray     # [2P] DEMAND_MIN_BYTES_PER_S in each traffic column's raw rate unit


def _layout(kind: str, counters: tuple[str, ...], gauges: tuple[str, ...]) -> _Layout | None:
    col = {n: j for j, n in enumerate(counters)}
    gcol = {n: j for j, n in enumerate(gauges)}
    if kind == NIC_PORT:
        prios = tuple(p for p in PFC_PRIORITIES
                      if f"rx_prio{p}_pause_duration" in col or f"tx_prio{p}_pause_duration" in col)
        duty = [f"{d}_prio{p}_pause_duration" for d in ("rx", "tx") for p in prios]
        traffic = [(f"{d}_prio{p}_bytes", f"{d}_prio{p}_packets") for d in ("tx", "rx") for p in prios]
        wait = "port_xmit_wait"
        speed, to_bytes, oper_up = gcol.get("netdev_speed_mbps"), 1e6 / 8, None
        events = (col.get("tx_pause_storm_warning_events"), col.get("tx_pause_storm_error_events"))
        occ_names = [""] * len(prios)
    elif kind == SWITCH_PORT:
        prios = tuple(p for p in PFC_PRIORITIES
                      if f"pfc{p}-rx-pause-duration-us" in col or f"pfc{p}-tx-pause-duration-us" in col)
        duty = [f"pfc{p}-{d}-pause-duration-us" for d in ("rx", "tx") for p in prios]
        # a switch counts ingress per port, not per priority: the port's total bounds p's
        traffic = ([(f"queue{p}-transmit-octets", f"queue{p}-transmit-pkts") for p in prios]
                   + [("in-octets", "in-pkts")] * len(prios))
        wait = ""
        speed, to_bytes, oper_up = gcol.get("port_speed_gbps"), 1e9 / 8, gcol.get("oper_up")
        events = (None, None)
        occ_names = [f"queue{p}-occupancy-bytes" for p in prios]
    else:
        return None
    if not prios:
        return None
    gather, nan_pos, zero_pos, scale = [], [], [], []
    for name in duty:
        gather.append(col.get(name, 0))
        if name not in col:
            nan_pos.append(len(gather) - 1)
    for by_bytes, by_packets in traffic:
        if by_bytes in col:
            gather.append(col[by_bytes])
            scale.append(1.0)
        else:
            gather.append(col.get(by_packets, 0))
            scale.append(MAX_WIRE_PACKET_BYTES)
            if by_packets not in col:
                zero_pos.append(len(gather) - 1)
    gather.append(col.get(wait, 0))
    P = len(prios)
    has_occupancy = np.array([n in gcol for n in occ_names], dtype=bool)
    demand_raw = DEMAND_MIN_BYTES_PER_S / np.array(scale)
    demand_raw[np.array(zero_pos, dtype=np.intp) - 2 * P] = np.inf      # a missing column is never demand
    return _Layout(
        scale_is_one=set(scale) == {1.0}, demand_raw=demand_raw,
        prios=prios, gather=np.array(gather, dtype=np.intp), nan_pos=np.array(nan_pos, dtype=np.intp),
        zero_pos=np.array(zero_pos, dtype=np.intp), scale=np.array(scale).reshape(2, P),
        has_xmit_wait=wait in col, occupancy=np.array([gcol.get(n, 0) for n in occ_names], dtype=np.intp),
        has_occupancy=has_occupancy, speed=speed, speed_to_bytes=to_bytes,
        default_speed=DEFAULT_LINE_RATE_GBPS * 1e9 / 8 / to_bytes, oper_up=oper_up, storm_events=events)


def _last_traffic(rates: np.ndarray, lay: _Layout, times_ns: np.ndarray) -> np.ndarray:
    """[t, n, 2P] the sample time where each port carried traffic on p (tx, then rx), else _NEVER.

    Traffic below `DEMAND_MIN_BYTES_PER_S` (control-plane chatter) and NaN (no rate) do not count.
    """
    P = len(lay.prios)
    traffic = rates[:, :, lay.gather[2 * P:4 * P]]
    return np.where(traffic >= lay.demand_raw, times_ns[:, None, None], _NEVER)      # NaN compares False


class _Cells:
    """Countdown state of one block of one source: arrays [entity, role, priority].

    One timer per cell serves both countdowns: while inactive it counts the time the
    condition has held (detection), while active the quiet time (restoration).
    """

    _ARRAYS = ("elapsed_ns", "count", "active", "onset_ns", "last_traffic_ns")

    def __init__(self, ids: tuple[str, ...], n_prios: int) -> None:
        shape = (len(ids), len(_ROLES), n_prios)
        self.ids = ids
        self.elapsed_ns = np.zeros(shape)
        self.count = np.zeros(shape, dtype=np.int32)        # agreeing samples so far
        self.active = np.zeros(shape, dtype=bool)
        self.onset_ns = np.zeros(shape, dtype=np.int64)
        # when each port last carried traffic on each priority: [:, 0] sent, [:, 1] received
        self.last_traffic_ns = np.full((len(ids), 2, n_prios), _NEVER, dtype=np.int64)
        self.counting = False                               # some timer is running
        self.n_active = 0

    def __setstate__(self, state: dict) -> None:
        # checkpoints written before received traffic was tracked: sent only
        old = state.pop("last_tx_ns", None)
        if old is not None and "last_traffic_ns" not in state:
            state["last_traffic_ns"] = np.stack([old, np.full_like(old, _NEVER)], axis=1)
        self.__dict__.update(state)

    def stamp(self, last: np.ndarray) -> None:
        """Merge [n, 2P] sample times of traffic (`_last_traffic`, reduced over ticks)."""
        n, _, P = self.last_traffic_ns.shape
        self.last_traffic_ns = np.maximum(self.last_traffic_ns, last.reshape(n, 2, P))

    def remap(self, ids: tuple[str, ...]) -> _Cells:
        """The same state for a new entity list (rows of vanished entities are dropped)."""
        new = _Cells(ids, self.active.shape[2])
        old = {e: i for i, e in enumerate(self.ids)}
        pairs = [(i, old[e]) for i, e in enumerate(ids) if e in old]
        if pairs:
            dst, src = (np.array(x, dtype=np.intp) for x in zip(*pairs))
            for name in self._ARRAYS:
                getattr(new, name)[dst] = getattr(self, name)[src]
        new.counting = bool(new.count.any())
        new.n_active = int(new.active.sum())
        return new


class PfcWatchdog(Feeder):
    """SONiC-style PFC watchdog over one stream of `SourceView` ticks (any number of sources).

    Parameters
    ----------
    detection_time_ms : the pause condition must hold this long (real elapsed time, and at
        least two samples) before an onset is confirmed; 100..5000 as in pfcwd.
    restoration_time_ms : quiet time before a restoration; 100..60000, default 2 x detection.
    paused_duty_min : received-pause duty (s/s) at which a port counts as held.
    pausing_duty_min : transmitted-pause duty at which a NIC counts as holding its peer.

    Cost: a handful of numpy operations per block, independent of the number of counters;
    a Python loop runs only over the cells that change state.
    """

    def __init__(self, detection_time_ms: int = DEFAULT_DETECTION_TIME_MS, restoration_time_ms: int | None = None,
                 paused_duty_min: float = PAUSED_DUTY_MIN, pausing_duty_min: float = PAUSING_DUTY_MIN) -> None:
        self.detection_time_ms = detection_time_ms
        self.restoration_time_ms = restoration_time_ms
        self.paused_duty_min = paused_duty_min
        self.pausing_duty_min = pausing_duty_min
        if not DETECTION_TIME_MIN_MS <= detection_time_ms <= DETECTION_TIME_MAX_MS:
            raise ValueError(f"detection_time_ms must be within {DETECTION_TIME_MIN_MS}..{DETECTION_TIME_MAX_MS}, "
                             f"got {detection_time_ms!r}")
        restore = RESTORATION_PER_DETECTION * detection_time_ms if restoration_time_ms is None else restoration_time_ms
        if not RESTORATION_TIME_MIN_MS <= restore <= RESTORATION_TIME_MAX_MS:
            raise ValueError(f"restoration_time_ms must be within {RESTORATION_TIME_MIN_MS}.."
                             f"{RESTORATION_TIME_MAX_MS}, got {restore!r}")
        for name in ("paused_duty_min", "pausing_duty_min"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within (0, 1], got {getattr(self, name)!r}")
        self._det_ns = float(detection_time_ms) * 1e6
        self._rest_ns = float(restore) * 1e6
        self._det_target_ns = self._det_ns * (1 - TIMER_TOLERANCE_FRACTION)
        self._rest_target_ns = self._rest_ns * (1 - TIMER_TOLERANCE_FRACTION)
        # [role, 1] thresholds, broadcast against [entity, role, priority]
        self._duty_min = np.array([[paused_duty_min], [pausing_duty_min]])
        self._traffic_max = 1.0 - self._duty_min
        self._reset()

    def _reset(self) -> None:
        self._cells: dict[tuple[str, str], tuple[_Cells, _Layout]] = {}
        self._layouts: dict[tuple, _Layout | None] = {}

    # -- public ---------------------------------------------------------------------------
    def update(self, view: SourceView) -> list[PauseStateChange]:
        """Onsets and restorations confirmed by this tick of one source."""
        out: list[PauseStateChange] = []
        for frame in view.frames:
            layout = self._layout_of(frame.kind, frame.counter_names, frame.gauge_names)
            if layout is not None:
                self._frame(view, frame, layout, out)
        return out

    def screen(self, group: LayoutGroup) -> None:
        """For each stack of a layout group: is any port near a pause (and when did each port
        last sent or received on each priority)? `update_batch` then skips the quiet stacks at once."""
        kind, _, counter_names, gauge_names = group.key
        layout = self._layout_of(kind, counter_names, gauge_names)
        if layout is None or group.rates is None:
            return
        P = len(layout.prios)
        duty = group.rates[:, :, layout.gather[:2 * P]]
        if layout.nan_pos.size:
            duty[:, :, layout.nan_pos[layout.nan_pos < 2 * P]] = np.nan
        rows = len(group.times_ns)
        still = (duty.reshape(rows, -1, 2, P) >= self._duty_min).reshape(rows, -1).any(axis=1)
        still_any = group.segment_any(still)
        last = np.maximum.reduceat(_last_traffic(group.rates, layout, group.times_ns), group.starts, axis=0)
        for i, stack in enumerate(group.stacks):
            stack.screens["pfc"] = (bool(still_any[i]), last[i])

    def update_batch(self, batch: SourceBatch) -> list[PauseStateChange]:
        """Onsets and restorations confirmed by the ticks of one record, in event-time order.

        The same as `update` tick by tick; while no port of a block is near a pause (the
        healthy fabric), the whole block is judged with a few array operations over all
        its ticks at once.
        """
        out: list[PauseStateChange] = []
        for stack in batch.stacks:
            layout = self._layout_of(stack.kind, stack.counter_names, stack.gauge_names)
            if layout is None:
                continue
            cells = self._cells_for(batch.source, stack.kind, stack.ids, layout)
            if stack.rates is not None and self._quiet(cells, layout, stack):
                continue
            for k in range(len(stack.ticks)):
                view = SourceView(batch.cluster, batch.source, batch.source_kind, int(stack.times_ns[k]), 0)
                self._frame(view, stack.frame(k), layout, out)
        out.sort(key=lambda c: c.at_ns)
        return out

    def active(self) -> list[tuple[str, str, int, str]]:
        """(source, entity id, priority, role) of every cell currently in a confirmed state."""
        out = []
        for (source, _kind), (cells, lay) in self._cells.items():
            for i, r, p in zip(*np.nonzero(cells.active)):
                out.append((source, cells.ids[i], lay.prios[p], _ROLES[r]))
        return out

    def forget(self, source: str) -> None:
        """Drop the state of a source (decommissioned node or switch)."""
        for key in [k for k in self._cells if k[0] == source]:
            del self._cells[key]

    # -- the rule -------------------------------------------------------------------------
    def _layout_of(self, kind: str, counter_names: tuple[str, ...], gauge_names: tuple[str, ...]) -> _Layout | None:
        if kind not in _KINDS:
            return None
        key = (kind, counter_names, gauge_names)
        layout = self._layouts.get(key, False)
        if layout is False:
            if len(self._layouts) >= MAX_LAYOUTS:      # id churn must not grow this
                self._layouts.clear()
            layout = self._layouts[key] = _layout(*key)
        return layout

    def _cells_for(self, source: str, kind: str, ids: tuple[str, ...], lay: _Layout) -> _Cells:
        held = self._cells.get((source, kind))
        if held is not None and held[0].ids == ids and held[1].prios == lay.prios:
            return held[0]
        if held is not None and held[1].prios == lay.prios:
            cells = held[0].remap(ids)
        else:
            cells = _Cells(ids, len(lay.prios))
        self._cells[(source, kind)] = (cells, lay)
        return cells

    def _quiet(self, cells: _Cells, lay: _Layout, stack) -> bool:
        """Whether a whole stack of ticks leaves every timer as it is (no port near a pause).

        Then only the recent-traffic times move; the stack need not be judged tick by tick.
        """
        if cells.n_active or cells.counting:
            return False
        screened = stack.screens.get("pfc")
        if screened is not None:
            still, last = screened
            if still:
                return False
            cells.stamp(last)
            return True
        P = len(lay.prios)
        duty = stack.rates[:, :, lay.gather[:2 * P]]
        if lay.nan_pos.size:
            duty[:, :, lay.nan_pos[lay.nan_pos < 2 * P]] = np.nan
        if (duty.reshape(duty.shape[0], duty.shape[1], 2, P) >= self._duty_min).any():   # NaN compares False
            return False
        cells.stamp(_last_traffic(stack.rates, lay, stack.times_ns).max(axis=0))
        return True

    def _frame(self, view: SourceView, frame: EntityFrame, lay: _Layout, out: list) -> None:
        cells = self._cells_for(view.source, frame.kind, frame.ids, lay)
        dt_s = frame.dt_s
        if frame.rates is None or not dt_s > 0:          # first sample, refused sample: no evidence
            if cells.counting:                           # detection restarts; restoration holds
                cells.elapsed_ns *= cells.active
                cells.count *= cells.active
                cells.counting = bool(cells.n_active)
            return
        n, P = len(frame.ids), len(lay.prios)
        x = frame.rates[:, lay.gather]                   # one gather: [n, 4P + 1]
        if lay.nan_pos.size:
            x[:, lay.nan_pos] = np.nan
        if lay.zero_pos.size:
            x[:, lay.zero_pos] = 0.0
        duty = x[:, :2 * P].reshape(n, 2, P)             # [:, 0] received pause, [:, 1] sent pause
        traffic = x[:, 2 * P:4 * P].reshape(n, 2, P)     # [:, 0] sent on p, [:, 1] received on p
        if not lay.scale_is_one:
            traffic = traffic * lay.scale
        t_ns = view.time_ns
        cells.last_traffic_ns[traffic >= DEMAND_MIN_BYTES_PER_S] = t_ns       # NaN compares False
        still = duty >= self._duty_min                   # [n, 2, P]; NaN compares False
        if not cells.n_active and not cells.counting and not still.any():
            return                                        # the healthy fast path: nobody near a pause
        if lay.speed is not None:                        # -1 (no carrier) or NaN (not read): default
            g = frame.gauges[:, lay.speed]
            line = np.where(g > 0, g, lay.default_speed) * lay.speed_to_bytes
        else:
            line = np.full(n, DEFAULT_LINE_RATE_GBPS * 1e9 / 8)
        if lay.oper_up is not None:
            line[frame.gauges[:, lay.oper_up] == 0] = np.nan   # admin/oper down: no PFC evidence
        cond = still & (traffic <= self._traffic_max * line[:, None, None])
        # One condition per role: held (or holding) >= d of the interval, carrying no more
        # than the (1 - d) of line rate the pause leaves, and something is stuck behind it.
        cond &= self._demand(lay, frame, x, cells, t_ns, dt_s)
        # quiet (restoration) only matters for active cells; NaN is neither still nor quiet
        quiet = duty < self._duty_min if cells.n_active else None
        fired, cleared = self._countdown(cells, cond, still, quiet, dt_s * 1e9, t_ns)
        if fired is None:
            return
        inputs = {"duty": duty, "traffic": traffic, "line": line, "x": x, "frame": frame}
        for i, r, p in zip(*np.nonzero(fired | cleared)):
            out.append(self._change(view, lay, int(i), int(r), int(p), bool(fired[i, r, p]),
                                    int(cells.onset_ns[i, r, p]), inputs))

    @staticmethod
    def _demand(lay: _Layout, frame: EntityFrame, x: np.ndarray, cells: _Cells, t_ns: int, dt_s: float) -> np.ndarray:
        """[n, 2, P] whether something is stuck behind each role (SONiC test_pfcwd_no_traffic).

        Paused: data waits to be sent. A switch queue's occupancy says so where the gauge was
        read (an empty queue is not held); a NIC's ``port_xmit_wait`` rising says so (NaN,
        i.e. saturated or reset: unknown); otherwise traffic sent on p lately. Pausing: the
        peer had data for the port, i.e. traffic received on p lately. Lately: within
        `DEMAND_LOOKBACK_S` (+ one interval) before the agreeing run started, or during it.
        """
        P = len(lay.prios)
        since_ns = np.where(cells.count > 0, cells.onset_ns, t_ns - int(dt_s * 1e9))   # the run's start
        recent = cells.last_traffic_ns >= since_ns - (DEMAND_LOOKBACK_S + dt_s) * 1e9  # [n, 2, P]
        if lay.has_xmit_wait:                            # NIC: data waited for a paused wire
            recent[:, 0] |= (x[:, 4 * P] > 0)[:, None]    # NaN compares False: the traffic decides
        elif lay.has_occupancy.any():                    # switch: queue occupancy (SONiC)
            occupancy = frame.gauges[:, lay.occupancy]
            read = lay.has_occupancy & (occupancy == occupancy)
            recent[:, 0] = np.where(read, occupancy > 0, recent[:, 0])
        return recent

    def _countdown(self, cells: _Cells, cond, still, quiet, dt_ns: float, t_ns: int):
        """Advance every timer by one sample; the cells that fired (onset) and cleared."""
        active = cells.active
        # A timer advances on an agreeing sample (inactive: the condition; active: quiet)
        # and survives a sample that neither advances nor contradicts it (active and NaN);
        # anything else restarts it. Charges are the real elapsed time, capped one ns
        # short of the target so that every change needs two samples.
        step = np.where(active, quiet, cond) if cells.n_active else cond
        if not cells.counting and not step.any():
            return None, None                            # steady state: no timer runs or starts
        survive = np.where(active, ~still, cond) if cells.n_active else cond
        if dt_ns < min(self._det_ns, self._rest_ns) - 1:
            charge = dt_ns                               # the usual case: below both caps
        else:
            charge = np.where(active, min(dt_ns, self._rest_ns - 1), min(dt_ns, self._det_ns - 1))
        cells.elapsed_ns = (cells.elapsed_ns + charge * step) * survive
        cells.count = (cells.count + step) * survive
        cells.onset_ns[(cells.count == 1) & step & ~active] = t_ns - int(dt_ns)
        target = np.where(active, self._rest_target_ns, self._det_target_ns)
        done = step & (cells.elapsed_ns >= target) & (cells.count >= MIN_AGREEING_SAMPLES)
        cells.counting = bool(cells.count.any())
        if not done.any():
            return None, None
        cells.elapsed_ns[done] = 0.0
        cells.count[done] = 0
        cells.active = active ^ done
        cells.n_active = int(cells.active.sum())
        cells.counting = bool(cells.count.any())
        return done & ~active, done & active

    # -- records --------------------------------------------------------------------------
    def _change(self, view: SourceView, lay: _Layout, i: int, r: int, p: int, active: bool, onset_ns: int,
                x: dict) -> PauseStateChange:
        frame = x["frame"]
        eid = frame.ids[i]
        if frame.kind == NIC_PORT:
            device, _, port = eid.partition("/")
            entity = EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)
        else:
            entity = EntityRef(cluster=view.cluster, switch=view.source, port=eid)
        prio, role = lay.prios[p], _ROLES[r]
        d_min = float(self._duty_min[r, 0])
        limit = float(self._traffic_max[r, 0] * x["line"][i])
        duty, traffic = float(x["duty"][i, r, p]), float(x["traffic"][i, r, p])
        if role == PAUSED:
            ev = [Evidence("rx_pause_duty", duty, d_min, "s/s", f"received pause on prio {prio}")]
            if active:
                ev.append(Evidence("tx_bytes_per_s", traffic, limit, "bytes/s",
                                   "sent on the priority (at most 1 - duty of line rate)"))
                wait = float(x["x"][i, -1])
                if lay.has_xmit_wait and wait > 0:
                    ev.append(Evidence("port_xmit_wait_per_s", wait, 0.0, "ticks/s",
                                       "data waiting to be sent"))
                elif lay.has_occupancy[p] and frame.gauges[i, lay.occupancy[p]] == frame.gauges[i, lay.occupancy[p]]:
                    ev.append(Evidence("queue_occupancy_bytes", float(frame.gauges[i, lay.occupancy[p]]), 0.0,
                                       "bytes", "queued for the paused egress"))
                else:
                    unknown = " (port_xmit_wait unknown: saturated or reset)" if lay.has_xmit_wait else ""
                    ev.append(Evidence("recent_traffic", 1.0, 1.0, "bool",
                                       f"sent on the priority within the last {DEMAND_LOOKBACK_S:g} s{unknown}"))
        else:
            ev = [Evidence("tx_pause_duty", duty, d_min, "s/s", f"sent pause on prio {prio}")]
            if active:
                ev.append(Evidence("rx_bytes_per_s", traffic, limit, "bytes/s",
                                   "received on the priority (a stuck receiver takes ~nothing)"
                                   if frame.kind == NIC_PORT else "received on the port (all priorities)"))
                ev.append(Evidence("recent_rx_traffic", 1.0, 1.0, "bool",
                                   f"the peer sent on the priority within the last {DEMAND_LOOKBACK_S:g} s"))
                for name, j in zip(("tx_pause_storm_warning_events", "tx_pause_storm_error_events"),
                                   lay.storm_events):
                    if j is not None and frame.rates[i, j] > 0:
                        ev.append(Evidence(name, float(frame.rates[i, j]), 0.0, "events/s",
                                           "the NIC's own storm prevention (pfc-prevention-tout) fired"))
        return PauseStateChange(entity, prio, role, active, onset_ns, view.time_ns, ev)
