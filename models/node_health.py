"""Node health book: a compact, recent, per-node summary to explain a slow rank.

`NodeHealthBook.update(view)` reads one node tick (vectorised per frame) and keeps, per
node, a bounded ring of samples plus recent hardware events:

* per GPU: the NVML clocks-event reasons decoded by name (``GpuIdle`` excluded), the SM
  clock against its maximum, temperature and power;
* per NIC port: its sysfs ``rate`` against nominal (the topology's, else a configured
  rate, else the most common rate of the fleet) and its received PFC pause duty (the
  increase of ``rx_prio<p>_pause_duration`` per second: near 1 means the switch keeps the
  port paused, i.e. the port is a storm victim);
* recent XIDs (``view.events`` of kind ``"xid"``) and uncorrectable-ECC increments.

`cause_for(node, gpu_index, at_ns)` answers with the most likely *local* cause of a slow
rank on that GPU and the evidence for it, as ``(cause, evidence)``; ``cause`` is one of
`CAUSES`, and `describe_cause` turns the answer into a sentence. A cause is taken only if
it shows in at least ``cause_min_fraction`` of the samples around ``at_ns`` (a single
sample of incast or of a power-capped GPU is ordinary), and a clock throttle only if its
clock deficit can explain the slowdown. The NIC ``mlx5_<r>/1`` (rail r) serves GPU r
unless a `Topology` says otherwise (`NicPort.gpu_index`).

The book only describes; `straggler.StragglerDetector` decides who is slow.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def gpus(reasons, sm_mhz):
...     g = np.array([[95, sm_mhz, 1980, reasons, 690e3, 84], [95, 1975, 1980, 0, 650e3, 61]])
...     return EntityFrame("gpu", ("gpu0", "gpu1"), (), np.empty((2, 0), np.uint64),
...                        ("utilization_gpu_pct", "sm_clock_mhz", "sm_clock_max_mhz",
...                         "clocks_event_reasons", "power_mw", "temperature_c"), g, [{}, {}])
>>> book = NodeHealthBook()
>>> for t in range(4):
...     book.update(SourceView("c1", "node-1", "node", t * 10**9, t, [gpus(0x40, 1410)]))
>>> cause, evidence = book.cause_for("node-1", 0, 3 * 10**9, slowdown=1.4)
>>> cause, describe_cause(cause, evidence)
('thermal', 'thermal throttling (HwThermalSlowdown, SM clock 1410/1980 MHz)')
>>> book.cause_for("node-1", 1, 3 * 10**9)[0]
'none'
"""
from __future__ import annotations

import math
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import median

import numpy as np

from fabricwatch.counters import PFC_PRIORITIES

from .findings import Evidence
from .frames import GPU, NIC_PORT, EntityFrame, SourceView
from .linkrate import IbRate, parse_ib_rate
from .topology import DEFAULT_NIC_RATE, Topology

# -- causes ---------------------------------------------------------------------------------
THERMAL, POWER, NIC_DOWNGRADE, STORM_VICTIM, XID, ECC, NONE, UNKNOWN = (
    "thermal", "power", "nic_downgrade", "storm_victim", "xid", "ecc", "none", "unknown")
# Priority order: a throttle that explains the slowdown beats a network cause, which beats
# a recent hardware error (XIDs and ECC errors more often crash a job than slow it).
GPU_CAUSES = (THERMAL, POWER, XID, ECC)          # can slow a rank's own compute
NETWORK_CAUSES = (NIC_DOWNGRADE, STORM_VICTIM)   # can slow the collectives of its job
CAUSES = (THERMAL, POWER, NIC_DOWNGRADE, STORM_VICTIM, XID, ECC)
CAUSE_TEXT = {
    THERMAL: "thermal throttling",
    POWER: "power capping",
    NIC_DOWNGRADE: "NIC link downgrade",
    STORM_VICTIM: "PFC storm victim",
    XID: "recent GPU XID error",
    ECC: "uncorrectable ECC errors",
    NONE: "no local cause visible (data loader, host CPU?)",
    UNKNOWN: "no telemetry from the node around that time",
}
CAUSE_ACTION = {
    THERMAL: "check the node's cooling (fans, inlet temperature, airflow); drain it after the next checkpoint",
    POWER: "check the GPU power limit and the node's PSUs/power-brake signal; drain it after the next checkpoint",
    NIC_DOWNGRADE: "reseat or replace the NIC cable/transceiver; drain the node after the next checkpoint",
    STORM_VICTIM: "find and isolate the PFC storm source on the same leaf (pfc_storm finding)",
    XID: "look up the XID in NVIDIA's catalog; reset or drain the GPU",
    ECC: "drain the node; the GPU needs a row remap/reset",
    NONE: "profile the rank (data loader, host CPU, stragglers in input pipeline)",
    UNKNOWN: "check the node's collector",
}

# -- NVML clocks-event reasons (nvmlClocksEventReason*) ---------------------------------------
REASON_GPU_IDLE = 0x1
REASON_BITS = {
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}
THERMAL_REASONS = 0x20 | 0x40
POWER_REASONS = 0x4 | 0x80
HW_SLOWDOWN = 0x8   # thermal or power brake; told apart by temperature
# HwSlowdown counts as thermal at or above this GPU temperature, as a power event below.
HW_SLOWDOWN_HOT_C = 85.0
# A GPU below this utilisation (or with the GpuIdle bit) is idle: its clocks say nothing.
GPU_BUSY_UTILIZATION_PCT = 5.0

# -- defaults -------------------------------------------------------------------------------
HISTORY_S = 120.0            # samples older than this (per node) are dropped
MAX_SAMPLES_PER_NODE = 512   # hard bound on the ring, whatever the tick rate
MAX_EVENTS_PER_NODE = 256
LOOKBACK_S = 5.0             # cause_for looks at [at - LOOKBACK_S, at + LOOKAHEAD_S]
LOOKAHEAD_S = 2.0
MAX_SAMPLE_AGE_S = 60.0      # with no sample in that window, the last one if this recent
EVENT_LOOKBACK_S = 300.0     # XIDs / ECC errors this recent count as a cause
CAUSE_MIN_FRACTION = 0.5     # a condition must hold in at least this share of the samples
STORM_VICTIM_PAUSE_DUTY = 0.5  # received pause duty; healthy incast stays below it
THROTTLE_CLOCK_RATIO = 0.9   # without a slowdown to explain: SM clock / max at or below this
# With a slowdown s to explain, the clock deficit (max/clock - 1) must reach this share of
# s - 1: a GPU at 0.93 of its clock (ordinary power capping) does not explain 1.3x.
THROTTLE_EXPLAINS_FRACTION = 0.5
MIN_PORTS_FOR_CONSENSUS = 8  # NIC ports seen before the fleet's most common rate is nominal

_GPU_ID = re.compile(r"(\d+)$")
_RAIL_NIC = re.compile(r"^mlx5_(\d+)/")
_RX_PAUSE = tuple(f"rx_prio{p}_pause_duration" for p in PFC_PRIORITIES)
_ECC_UNC = "ecc_uncorrected_volatile_total"


def reason_names(mask: int) -> list[str]:
    """NVML clocks-event reason bits by name, ``GpuIdle`` excluded.

    >>> reason_names(0x44 | 0x1)
    ['SwPowerCap', 'HwThermalSlowdown']
    """
    return [name for bit, name in REASON_BITS.items() if mask & bit]


def rail_nic(gpu_index: int) -> str:
    """The NIC port that serves a GPU on a rail-optimised node without a topology file."""
    return f"mlx5_{gpu_index}/1"


def describe_cause(cause: str, evidence: list[Evidence]) -> str:
    """One line for a finding: the cause's text, then the first evidence's detail.

    >>> describe_cause(NONE, [Evidence("samples", 5, 1, "samples", "nothing seen")])
    'no local cause visible (data loader, host CPU?)'
    """
    text = CAUSE_TEXT.get(cause, cause)
    if cause not in (NONE, UNKNOWN) and evidence and evidence[0].detail:
        return f"{text} ({evidence[0].detail})"
    return text


@lru_cache(maxsize=256)
def _parse(rate: str) -> IbRate | None:
    return parse_ib_rate(rate)


def _index_of(entity_id: str, position: int) -> int:
    m = _GPU_ID.search(entity_id)
    return int(m.group(1)) if m else position


@dataclass
class _Sample:
    """One tick of one node, reduced to what explains a slow rank (arrays per entity)."""
    time_ns: int
    gpu_row: dict[int, int]    # the GPU's local index -> its row in the arrays below
    reasons: np.ndarray        # int64 mask, GpuIdle cleared
    busy: np.ndarray           # bool
    sm_mhz: np.ndarray
    sm_max_mhz: np.ndarray
    temperature_c: np.ndarray
    power_w: np.ndarray
    nic_ids: tuple[str, ...]
    nic_row: dict[int, int]    # GPU index -> row of the NIC port that serves it
    nic_rate: list[str]
    nic_gbps: np.ndarray
    nic_nominal_gbps: np.ndarray
    nic_active: np.ndarray     # bool
    pause_duty: np.ndarray     # received pause seconds per second, max over priorities


@dataclass
class _Event:
    time_ns: int
    gpu_index: int
    kind: str                  # "xid" | "ecc"
    code: int
    detail: str


@dataclass
class _NodeRecord:
    samples: deque = field(default_factory=deque)
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS_PER_NODE))
    last_ns: int | None = None
    last_pause_us: np.ndarray | None = None   # [ports, priorities] raw totals
    last_pause_ids: tuple[str, ...] = ()
    last_ecc: np.ndarray | None = None
    last_ecc_ids: tuple[str, ...] = ()


@dataclass
class NodeHealthBook:
    """Recent GPU/NIC health per node, for the probable cause of a slow rank.

    Parameters
    ----------
    topology : maps each NIC port to the GPU it serves and gives its nominal rate;
        without it NIC ``mlx5_<r>/1`` serves GPU r and the nominal rate is below.
    nominal_nic_rate : sysfs rate string of a healthy port; "" = the fleet's most common
        rate once `MIN_PORTS_FOR_CONSENSUS` ports were seen (`DEFAULT_NIC_RATE` before).
    history_s, max_samples_per_node : how much is kept per node.
    lookback_s, lookahead_s : the window around ``at_ns`` that `cause_for` reads.
    event_lookback_s : how recent an XID or ECC error must be to count.
    cause_min_fraction : share of the window's samples a condition must hold in.
    storm_victim_pause_duty : received PFC pause duty (0..1) that marks a storm victim.
    throttle_clock_ratio : SM clock / max at or below which a throttle is a cause when
        no slowdown is given to explain.
    """

    topology: Topology | None = None
    nominal_nic_rate: str = ""
    history_s: float = HISTORY_S
    max_samples_per_node: int = MAX_SAMPLES_PER_NODE
    lookback_s: float = LOOKBACK_S
    lookahead_s: float = LOOKAHEAD_S
    event_lookback_s: float = EVENT_LOOKBACK_S
    cause_min_fraction: float = CAUSE_MIN_FRACTION
    storm_victim_pause_duty: float = STORM_VICTIM_PAUSE_DUTY
    throttle_clock_ratio: float = THROTTLE_CLOCK_RATIO
    _nodes: dict[str, _NodeRecord] = field(default_factory=dict, repr=False)
    _fleet_rates: Counter = field(default_factory=Counter, repr=False)
    _row_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.nominal_nic_rate and _parse(self.nominal_nic_rate) is None:
            raise ValueError(f"nominal_nic_rate: not a sysfs rate string: {self.nominal_nic_rate!r}")
        for name in ("history_s", "lookback_s", "event_lookback_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.lookahead_s >= 0:
            raise ValueError(f"lookahead_s must be >= 0, got {self.lookahead_s!r}")
        if self.lookback_s > self.history_s:
            raise ValueError(f"lookback_s ({self.lookback_s}) must not exceed history_s ({self.history_s})")
        if not (isinstance(self.max_samples_per_node, int) and self.max_samples_per_node >= 1):
            raise ValueError(f"max_samples_per_node must be an int >= 1, got {self.max_samples_per_node!r}")
        for name in ("cause_min_fraction", "storm_victim_pause_duty", "throttle_clock_ratio"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")

    # -- public ---------------------------------------------------------------------------
    def update(self, view: SourceView) -> None:
        """Add one tick of a node (switch views and out-of-order ticks are ignored)."""
        if view.source_kind != "node":
            return
        rec = self._nodes.setdefault(view.source, _NodeRecord())
        if rec.last_ns is not None and view.time_ns <= rec.last_ns:
            return
        dt_s = (view.time_ns - rec.last_ns) / 1e9 if rec.last_ns is not None else float("nan")
        rec.last_ns = view.time_ns
        gpu = next(iter(view.frames_of(GPU)), None)
        nic = next(iter(view.frames_of(NIC_PORT)), None)
        sample = _Sample(view.time_ns, *self._gpu_columns(view, rec, gpu),
                         *self._nic_columns(view.source, rec, nic, dt_s))
        for event in view.events:
            if event.kind == "xid":
                rec.events.append(_Event(event.time_ns, _index_of(event.entity_id, -1), XID, event.code,
                                         event.detail))
        rec.samples.append(sample)
        horizon = view.time_ns - int(self.history_s * 1e9)
        while rec.samples and (rec.samples[0].time_ns < horizon or len(rec.samples) > self.max_samples_per_node):
            rec.samples.popleft()
        event_horizon = view.time_ns - int(max(self.event_lookback_s, self.history_s) * 1e9)
        while rec.events and rec.events[0].time_ns < event_horizon:
            rec.events.popleft()

    def forget(self, node: str) -> None:
        """Drop everything known about a node (decommissioned, renamed)."""
        self._nodes.pop(node, None)

    def nic_for(self, node: str, gpu_index: int) -> str:
        """The NIC port id that serves a GPU (topology first, then the rail convention)."""
        if self.topology is not None:
            for nic in self.topology.nics_of(node):
                if nic.gpu_index == gpu_index:
                    return nic.entity_id
        return rail_nic(gpu_index)

    def cause_for(self, node: str, gpu_index: int, at_ns: int, *, since_ns: int | None = None,
                  slowdown: float | None = None,
                  candidates: tuple[str, ...] = CAUSES) -> tuple[str, list[Evidence]]:
        """Most likely local cause of a slow rank on ``node``/``gpu_index`` around ``at_ns``.

        The samples read are those from ``lookback_s`` before ``at_ns`` (or from
        ``since_ns``, the start of the slow step, if later) to ``lookahead_s`` after it.
        ``slowdown`` (the rank's time over its peers') lets a clock throttle count only if
        it explains that much; ``candidates`` restricts and orders the causes tried (e.g.
        `GPU_CAUSES` for a rank whose own compute is slow). Returns ``NONE`` when the node
        was seen but shows none of them, ``UNKNOWN`` when there is no telemetry around then.
        """
        rec = self._nodes.get(node)
        lo = at_ns - int(self.lookback_s * 1e9)
        if since_ns is not None:
            lo = max(lo, min(since_ns, at_ns))
        hi = at_ns + int(self.lookahead_s * 1e9)
        window = []
        for sample in reversed(rec.samples if rec else ()):   # newest first; stop past the window
            if sample.time_ns < lo:
                break
            if sample.time_ns <= hi:
                window.append(sample)
        window.reverse()
        if not window and rec:   # sparse sampling (e.g. every 30 s): the last sample, if fresh enough
            stale = at_ns - int(MAX_SAMPLE_AGE_S * 1e9)
            window = [x for x in reversed(rec.samples) if stale <= x.time_ns <= hi][:1]
        if not window:
            return UNKNOWN, [Evidence("samples", 0, 1, "samples",
                                      f"no telemetry from {node} within {MAX_SAMPLE_AGE_S:g} s before the step")]
        for cause in candidates:
            evidence = self._check(cause, rec, window, gpu_index, at_ns, slowdown)
            if evidence:
                return cause, evidence
        return NONE, [Evidence("samples", len(window), 1, "samples",
                               f"GPU{gpu_index} unthrottled, its NIC at nominal rate and unpaused, no XID/ECC")]

    def nodes(self) -> list[str]:
        return list(self._nodes)

    # -- ingest ---------------------------------------------------------------------------
    def _gpu_columns(self, view: SourceView, rec: _NodeRecord, frame: EntityFrame | None):
        if frame is None:
            empty = np.empty(0)
            return {}, np.empty(0, np.int64), np.empty(0, bool), empty, empty, empty, empty
        rows = self._gpu_rows(frame.ids)
        index = {row: gpu for gpu, row in rows.items()}
        raw = frame.gauge("clocks_event_reasons")
        reasons = np.where(np.isfinite(raw), raw, 0).astype(np.int64)
        util = frame.gauge("utilization_gpu_pct")
        sm = frame.gauge("sm_clock_mhz")
        busy = ((reasons & REASON_GPU_IDLE) == 0) & (util >= GPU_BUSY_UTILIZATION_PCT) & np.isfinite(sm)
        reasons &= ~REASON_GPU_IDLE
        j = frame.column(_ECC_UNC)
        if j is not None:
            totals = frame.counters[:, j].astype(np.float64)
            if rec.last_ecc is not None and rec.last_ecc_ids == frame.ids:
                inc = totals - rec.last_ecc          # a decrease is a reset: no increment
                for i in np.flatnonzero(inc > 0):
                    rec.events.append(_Event(view.time_ns, index.get(int(i), int(i)), ECC, int(inc[i]),
                                             f"{int(inc[i])} uncorrectable ECC error(s) on {frame.ids[i]}"))
            rec.last_ecc, rec.last_ecc_ids = totals, frame.ids
        return (rows, reasons, busy, sm, frame.gauge("sm_clock_max_mhz"), frame.gauge("temperature_c"),
                frame.gauge("power_mw") / 1000.0)

    def _nic_columns(self, node: str, rec: _NodeRecord, frame: EntityFrame | None, dt_s: float):
        if frame is None:
            empty = np.empty(0)
            return (), {}, [], empty, empty, np.empty(0, bool), empty
        rates = frame.label("rate")
        active = np.array([s.startswith("4") for s in frame.label("state")], dtype=bool)
        parsed = [_parse(r) for r in rates]
        self._fleet_rates.update(r for r, p, a in zip(rates, parsed, active) if p is not None and a)
        gbps = np.array([p.gbps if p else np.nan for p in parsed])
        nominal = np.array([self._nominal_gbps(node, e) for e in frame.ids])
        cols = [frame.column(n) for n in _RX_PAUSE]
        present = [j for j in cols if j is not None]
        duty = np.full(len(frame.ids), np.nan)
        if present:
            totals = frame.counters[:, present].astype(np.float64)
            if rec.last_pause_us is not None and rec.last_pause_ids == frame.ids and \
                    rec.last_pause_us.shape == totals.shape and dt_s > 0:
                inc = totals - rec.last_pause_us
                inc[inc < 0] = np.nan                 # counter reset (reboot): no honest duty
                duty = np.clip(np.max(inc, axis=1) / 1e6 / dt_s, 0.0, 1.0)
            rec.last_pause_us, rec.last_pause_ids = totals, frame.ids
        return frame.ids, self._nic_rows(node, frame.ids), rates, gbps, nominal, active, duty

    def _gpu_rows(self, ids: tuple[str, ...]) -> dict[int, int]:
        key = ("gpu", ids)
        cached = self._row_cache.get(key)
        if cached is None:
            cached = self._row_cache[key] = {_index_of(e, i): i for i, e in enumerate(ids)}
        return cached

    def _nic_rows(self, node: str, ids: tuple[str, ...]) -> dict[int, int]:
        key = ("nic", node if self.topology is not None else "", ids)
        cached = self._row_cache.get(key)
        if cached is None:
            cached = {}
            for i, eid in enumerate(ids):
                nic = self.topology.nic(node, eid) if self.topology is not None else None
                m = _RAIL_NIC.match(eid)
                gpu = nic.gpu_index if nic is not None else int(m.group(1)) if m else None
                if gpu is not None:
                    cached.setdefault(gpu, i)
            self._row_cache[key] = cached
        return cached

    def _nominal_gbps(self, node: str, entity_id: str) -> float:
        if self.topology is not None:
            nic = self.topology.nic(node, entity_id)
            if nic is not None:
                return nic.nominal_gbps
        if self.nominal_nic_rate:
            return _parse(self.nominal_nic_rate).gbps
        if sum(self._fleet_rates.values()) >= MIN_PORTS_FOR_CONSENSUS:
            return _parse(self._fleet_rates.most_common(1)[0][0]).gbps
        return _parse(DEFAULT_NIC_RATE).gbps

    # -- rules ----------------------------------------------------------------------------
    def _check(self, cause, rec, window, gpu, at_ns, slowdown) -> list[Evidence]:
        if cause in (THERMAL, POWER):
            return self._throttle(cause, window, gpu, slowdown)
        if cause in (NIC_DOWNGRADE, STORM_VICTIM):
            return self._network(cause, window, gpu)
        if cause in (XID, ECC):
            return self._events(cause, rec, gpu, at_ns)
        raise ValueError(f"candidates: unknown cause {cause!r}; known: {CAUSES}")

    def _throttle(self, cause, window, gpu, slowdown) -> list[Evidence]:
        rows = [(s, s.gpu_row[gpu]) for s in window if gpu in s.gpu_row]
        rows = [(s, i) for s, i in rows if s.busy[i]]
        if not rows:
            return []
        reasons = [int(s.reasons[i]) for s, i in rows]
        temps = [t for t in (float(s.temperature_c[i]) for s, i in rows) if math.isfinite(t)]
        temp = median(temps) if temps else math.nan
        hot = temp >= HW_SLOWDOWN_HOT_C
        mask = (THERMAL_REASONS | (HW_SLOWDOWN if hot else 0)) if cause == THERMAL else \
            (POWER_REASONS | (0 if hot else HW_SLOWDOWN))
        hit = [(s, i) for (s, i), r in zip(rows, reasons) if r & mask]
        fraction = len(hit) / len(rows)
        if fraction < self.cause_min_fraction:
            return []
        clocks = [(float(s.sm_mhz[i]), float(s.sm_max_mhz[i])) for s, i in hit]
        clocks = [(c, m) for c, m in clocks if math.isfinite(c) and m > 0]
        if not clocks:
            return []
        ratio = median(c / m for c, m in clocks)
        if slowdown is not None and slowdown > 1:
            needed = 1.0 / (1.0 + THROTTLE_EXPLAINS_FRACTION * (slowdown - 1.0))
        else:
            needed = self.throttle_clock_ratio
        if ratio > needed:
            return []
        seen = 0
        for r in reasons:
            seen |= r & mask
        powers = [p for p in (float(s.power_w[i]) for s, i in rows) if math.isfinite(p)]
        return [
            Evidence("sm_clock_ratio", ratio, needed, "ratio",
                     f"{', '.join(reason_names(seen))}, SM clock "
                     f"{median(c for c, _ in clocks):.0f}/{median(m for _, m in clocks):.0f} MHz"),
            Evidence("throttled_sample_fraction", fraction, self.cause_min_fraction, "fraction",
                     f"{len(hit)} of {len(rows)} busy samples"),
            Evidence("temperature_c", temp, math.nan, "degC"),
            Evidence("power_w", median(powers) if powers else math.nan, math.nan, "W"),
        ]

    def _network(self, cause, window, gpu) -> list[Evidence]:
        rows = [(s, s.nic_row[gpu]) for s in window if gpu in s.nic_row]
        if not rows:
            return []
        if cause == NIC_DOWNGRADE:
            hit = [(s, i) for s, i in rows if s.nic_active[i] and s.nic_gbps[i] < s.nic_nominal_gbps[i]]
            fraction = len(hit) / len(rows)
            if fraction < self.cause_min_fraction:
                return []
            s, i = hit[-1]
            gbps, nominal = float(s.nic_gbps[i]), float(s.nic_nominal_gbps[i])
            return [
                Evidence("nic_rate_gbps", gbps, nominal, "Gb/s",
                         f"{s.nic_ids[i]} at {s.nic_rate[i].strip()}, nominal {nominal:g} Gb/s"),
                Evidence("downgraded_sample_fraction", fraction, self.cause_min_fraction, "fraction",
                         f"{len(hit)} of {len(rows)} samples"),
            ]
        duty = [float(s.pause_duty[i]) for s, i in rows]
        known = [d for d in duty if math.isfinite(d)]   # NaN: first sample or counter reset
        if not known:
            return []
        paused = sum(d >= self.storm_victim_pause_duty for d in known)
        fraction = paused / len(known)
        if fraction < self.cause_min_fraction:
            return []
        s, i = rows[-1]
        level = median(known)
        return [
            Evidence("rx_pause_duty", level, self.storm_victim_pause_duty, "s/s",
                     f"{s.nic_ids[i]} paused by its switch {level:.0%} of the time"),
            Evidence("paused_sample_fraction", fraction, self.cause_min_fraction, "fraction",
                     f"{paused} of {len(known)} samples"),
        ]

    def _events(self, cause, rec, gpu, at_ns) -> list[Evidence]:
        lo = at_ns - int(self.event_lookback_s * 1e9)
        hi = at_ns + int(self.lookahead_s * 1e9)
        hits = [e for e in rec.events if e.kind == cause and e.gpu_index == gpu and lo <= e.time_ns <= hi]
        if not hits:
            return []
        last = hits[-1]
        if cause == XID:
            codes = sorted({e.code for e in hits})
            return [Evidence("xid", float(last.code), float("nan"), "code",
                             f"XID {', '.join(map(str, codes))} within {self.event_lookback_s:g} s: {last.detail}"),
                    Evidence("xid_count", float(len(hits)), 1, "events")]
        total = sum(e.code for e in hits)
        return [Evidence("ecc_uncorrectable", float(total), 1, "errors",
                         f"{total} uncorrectable ECC error(s) within {self.event_lookback_s:g} s")]
