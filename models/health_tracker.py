"""Stage 1 of node health: a node's ticks become episodes, published as `NodeHealth` digests.

Reads, per record of one node (vectorised over its ticks, `frames.SourceBatch`):

* GPU blocks with NVML gauges (``clocks_event_reasons``, ``utilization_gpu_pct``,
  ``sm_clock_mhz``, ``sm_clock_max_mhz``, ``temperature_c``, ``power_mw``): a busy GPU
  (not idle, utilisation >= `node_health.GPU_BUSY_UTILIZATION_PCT`) is *thermal* when a
  thermal reason bit is set (or HwSlowdown at or above `HW_SLOWDOWN_HOT_C`), *power* when a
  power reason bit is (or HwSlowdown below it); the measure is its SM clock / max. An idle
  GPU's sample says nothing either way;
* NIC blocks with the sysfs ``rate`` and ``state`` labels: an active port below its
  nominal rate (`nominal.NominalRates`) is *nic_downgrade*; these blocks also give the
  node's vote for the fleet's nominal rate (`nominal.node_vote`);
* NIC blocks with ``rx_prio<p>_pause_duration``: a port whose received pause duty (max
  over priorities) reaches ``storm_victim_pause_duty`` is *storm_victim*;
* XID events, and increases of ``ecc_uncorrected_volatile_total`` (ECC events).

A tick only speaks for the columns it carries (a PFC-only tick says nothing of a GPU). An
episode opens on the first sample that shows its condition and stays open through gaps
shorter than `GAP_S` of samples that do not (so an intermittent power cap is one episode
holding half of its samples, not dozens); it is published once it held in
`MIN_PUBLISHED_SAMPLES` samples (a single sample of incast is nobody's cause). A digest
goes out when an episode opens or closes, an event arrives, the node is first seen, goes
silent (`sweep`) or comes back, and every `REFRESH_S` while episodes are open. Healthy
nodes cost a few array operations per record and publish nothing after their first.

>>> import numpy as np
>>> from fabricwatch.models.frames import FrameStack, SourceBatch
>>> names = ("utilization_gpu_pct", "sm_clock_mhz", "sm_clock_max_mhz", "clocks_event_reasons",
...          "power_mw", "temperature_c")
>>> def batch(t0_s, reasons):
...     g = np.array([[[95, 1410, 1980, reasons, 690e3, 84]] for _ in range(3)], dtype=float)
...     stack = FrameStack("gpu", ("gpu0",), (), names, np.arange(3), np.empty((3, 1, 0), np.uint64), g)
...     return SourceBatch("c1", "node-1", "node", (t0_s + np.arange(3)) * 10**9, [stack])
>>> tracker = HealthTracker()
>>> [len(d.episodes) for d in tracker.update_batch(batch(0, 0))]      # first sight: a digest, healthy
[0]
>>> [(e.condition, e.samples_on, e.open) for d in tracker.update_batch(batch(3, 0x40)) for e in d.episodes]
[('thermal', 3, True)]
>>> tracker.update_batch(batch(6, 0x40))                                # nothing new to say
[]
>>> [(e.condition, e.open, e.end_ns) for d in tracker.update_batch(batch(20, 0)) for e in d.episodes]
[('thermal', False, 8000000000)]
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from fabricwatch.counters import PFC_PRIORITIES

from .detector import Feeder
from .frames import GPU, NIC_PORT, FrameStack, LayoutGroup, SourceBatch
from .linkrate import parse_ib_rate
from .findings import OPEN, RESOLVED, Finding
from .node_health import (CAUSE_MIN_FRACTION, ECC, GPU_BUSY_UTILIZATION_PCT, GPU_PCIE, HISTORY_S, HW_SLOWDOWN, HW_SLOWDOWN_HOT_C, NIC_DOWN,
                          NIC_DOWNGRADE, NIC_PCIE, PARTIAL_PAUSE, PARTIAL_PAUSE_DUTY, POWER, POWER_REASONS,
                          REASON_GPU_IDLE, RELATED_KINDS, STORM_VICTIM, STORM_VICTIM_PAUSE_DUTY, THERMAL,
                          THERMAL_REASONS, XID, Episode, HealthEvent, NodeHealth, gpu_entity)
from .nominal import NominalRates
from .topology import Topology

GAP_S = 5.0                  # an episode closes after this long of samples without its condition
# An open episode whose condition is missing from this many samples in a row is republished as
# not holding (readers stop extending it), and again if it comes back within the gap.
BREAK_SAMPLES = 2
MIN_PUBLISHED_SAMPLES = 2    # an episode is published once it held in this many samples
# ... and a partial pause once it has lasted this long: incast comes in bursts of a few
# seconds on every port of a leaf and is ordinary; a pause that slows a job's steps for the
# straggler detector's 3 steps lasts longer (and 5 s is its cause look-back window).
PARTIAL_PAUSE_MIN_S = 5.0
# (held in at least half of that time's samples: what `node_health.CAUSE_MIN_FRACTION` asks of a cause)
_PARTIAL_PAUSE_MIN_ON_NS = PARTIAL_PAUSE_MIN_S * 1e9 * CAUSE_MIN_FRACTION
REFRESH_S = 30.0             # open episodes are republished this often (their counts move)
SILENT_AFTER_S = 10.0        # a node with no tick while its partition advanced this much is silent
FORGET_AFTER_S = 3600.0      # a silent node is forgotten after this long (id churn stays bounded)
EVENT_HISTORY_S = 300.0      # events kept this long (straggler causes look back 300 s)
MAX_EVENTS_PER_NODE = 256
MAX_CLOSED_PER_NODE = 64
MAX_FINDINGS_PER_NODE = 64   # open anomalies kept per node (a node has ~24 NICs and GPUs)
MAX_NODES = 200_000          # nodes tracked per tracker; more is id churn (counted, refused)
DEFAULT_INTERVAL_NS = 1_000_000_000

_GPU_ID = re.compile(r"(\d+)$")
_RX_PAUSE = tuple(f"rx_prio{p}_pause_duration" for p in PFC_PRIORITIES)
_ECC_UNC = "ecc_uncorrected_volatile_total"
_GPU_GAUGES = ("clocks_event_reasons", "utilization_gpu_pct", "sm_clock_mhz", "sm_clock_max_mhz",
               "temperature_c", "power_mw")
_PCIE_GAUGES = ("pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max")


@dataclass
class _Run:
    entity_id: str
    condition: str
    start_ns: int
    end_ns: int
    interval_ns: int
    on: int = 0
    total: int = 0
    trailing: int = 0          # observed samples since the last one it held in
    value_sum: float = 0.0
    reference: float = math.nan
    temp_sum: float = 0.0
    power_sum: float = 0.0
    reasons: int = 0
    detail: str = ""
    published: bool = False

    def add(self, t_ns: int, value: float, temp: float = math.nan, power: float = math.nan,
            reasons: int = 0) -> None:
        self.on += 1
        self.total += 1
        self.trailing = 0
        self.end_ns = t_ns
        self.value_sum += value
        self.temp_sum += temp
        self.power_sum += power
        self.reasons |= reasons

    def episode(self, open_: bool) -> Episode:
        total = self.total - self.trailing               # the samples from start to end
        n = self.on or 1
        return Episode(self.entity_id, self.condition, self.start_ns, self.end_ns, open_, self.on, max(total, self.on),
                       self.value_sum / n, self.reference, self.temp_sum / n, self.power_sum / n, self.reasons,
                       self.detail, self.interval_ns, open_ and self.trailing < BREAK_SAMPLES)


@dataclass
class _Node:
    cluster: str
    since_ns: int
    last_ns: int
    runs: dict[tuple[str, str], _Run] = field(default_factory=dict)
    closed: deque = field(default_factory=lambda: deque(maxlen=MAX_CLOSED_PER_NODE))
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS_PER_NODE))
    last_digest_ns: int = -(2**62)
    dirty: bool = True
    silent: bool = False
    gpu_index: dict = field(default_factory=dict)   # entity ids -> their GPU entity names
    nic_labels: tuple = ()      # (rates, states, nominal version) of the last NIC tick judged healthy
    seen_active: set = field(default_factory=set)    # NIC ports seen ACTIVE (a port never up serves nobody)
    findings: dict = field(default_factory=dict)     # (entity id, kind) -> Episode of an open anomaly


def _gpu_masks(gauge_names: tuple[str, ...], gauges: np.ndarray):
    """(busy, thermal, power) bool arrays [ticks, gpus] from NVML gauges; None without them."""
    col = {n: (gauge_names.index(n) if n in gauge_names else None) for n in _GPU_GAUGES}
    if col["clocks_event_reasons"] is None or col["sm_clock_mhz"] is None:
        return None
    raw = gauges[:, :, col["clocks_event_reasons"]]
    reasons = np.where(np.isfinite(raw), raw, 0).astype(np.int64)
    nan = np.full(raw.shape, np.nan)
    util = gauges[:, :, col["utilization_gpu_pct"]] if col["utilization_gpu_pct"] is not None else nan
    busy = ((reasons & REASON_GPU_IDLE) == 0) & (util >= GPU_BUSY_UTILIZATION_PCT) & np.isfinite(
        gauges[:, :, col["sm_clock_mhz"]])
    temp = gauges[:, :, col["temperature_c"]] if col["temperature_c"] is not None else nan
    hot = temp >= HW_SLOWDOWN_HOT_C
    hw = (reasons & HW_SLOWDOWN) != 0
    thermal = busy & (((reasons & THERMAL_REASONS) != 0) | (hw & hot))
    power = busy & (((reasons & POWER_REASONS) != 0) | (hw & ~hot))
    return busy, thermal, power


def _pcie_low(gauge_names: tuple[str, ...], gauges: np.ndarray):
    """(read, low) bool arrays [ticks, entities]: PCIe width or gen read, and below its max; None without."""
    col = [gauge_names.index(n) if n in gauge_names else None for n in _PCIE_GAUGES]
    if (col[0] is None or col[1] is None) and (col[2] is None or col[3] is None):
        return None
    nan = np.full(gauges.shape[:2], np.nan)
    width, width_max, gen, gen_max = (gauges[:, :, c] if c is not None else nan for c in col)
    read = (np.isfinite(width) & np.isfinite(width_max)) | (np.isfinite(gen) & np.isfinite(gen_max))
    return read, (width < width_max) | (gen < gen_max)            # NaN compares False


def _pcie_detail(stack: FrameStack, k: int, i: int) -> tuple[float, float, str]:
    """(width, max width, "gen4 x8 (max gen5 x16)") of one sample."""
    w, wm, g, gm = (stack.gauges[k, i, c] if c is not None else math.nan
                    for c in map(stack.gauge_column, _PCIE_GAUGES))
    return float(w), float(wm), f"gen{g:g} x{w:g} (max gen{gm:g} x{wm:g})"


def _interval_ns(stack: FrameStack) -> int:
    """The stack's sampling interval: its ticks' mean spacing (its first tick's gap alone)."""
    times = stack.times_ns
    if len(times) > 1:
        return int((times[-1] - times[0]) // (len(times) - 1))
    dt = stack.dt_s[0] if stack.dt_s is not None else math.nan
    return int(dt * 1e9) if dt == dt else DEFAULT_INTERVAL_NS


class HealthTracker(Feeder):
    """Episodes and events per node of one stage-1 partition; see the module docstring.

    Parameters
    ----------
    topology : nominal NIC rates (and nothing else here).
    nominal_nic_rate : configured nominal rate ("" = topology, fleet vote, default).
    nominal : a shared `NominalRates` (the worker's, fed by every node's vote); default own.
    history_s : closed episodes are kept this long.
    storm_victim_pause_duty : received pause duty (0..1) that marks a port held by PFC.
    partial_pause_duty : received pause duty that marks a port partly held (`PARTIAL_PAUSE_DUTY`).
    """

    def __init__(self, topology: Topology | None = None, nominal_nic_rate: str = "",
                 nominal: NominalRates | None = None, history_s: float = HISTORY_S,
                 storm_victim_pause_duty: float = STORM_VICTIM_PAUSE_DUTY,
                 partial_pause_duty: float = PARTIAL_PAUSE_DUTY) -> None:
        if not history_s > 0:
            raise ValueError(f"history_s must be > 0, got {history_s!r}")
        if not 0 < storm_victim_pause_duty <= 1:
            raise ValueError(f"storm_victim_pause_duty must be in (0, 1], got {storm_victim_pause_duty!r}")
        if not 0 < partial_pause_duty <= storm_victim_pause_duty:
            raise ValueError(f"partial_pause_duty must be in (0, storm_victim_pause_duty], got {partial_pause_duty!r}")
        if nominal_nic_rate and parse_ib_rate(nominal_nic_rate) is None:
            raise ValueError(f"nominal_nic_rate: not a sysfs rate string: {nominal_nic_rate!r}")
        self.nominal = nominal if nominal is not None else NominalRates(topology, nominal_nic_rate)
        self.history_s = history_s
        self.storm_victim_pause_duty = storm_victim_pause_duty
        self.partial_pause_duty = partial_pause_duty
        self._nodes: dict[str, _Node] = {}
        self.stats = {"nodes_refused": 0, "nodes_forgotten": 0}

    # -- public ---------------------------------------------------------------------------
    def update_batch(self, batch: SourceBatch, findings: list[Finding] = ()) -> list[NodeHealth]:
        """Fold one record of a node in; the digests to publish (0 or 1).

        ``findings``: what stage 1's detectors made of the same record; those of
        `RELATED_KINDS` on the node's NICs and GPUs travel in the digest with their id.
        """
        if batch.source_kind != "node" or not len(batch.times_ns):
            return []
        node = self._nodes.get(batch.source)
        first_ns, last_ns = int(batch.times_ns[0]), int(batch.times_ns[-1])
        if node is None:
            if len(self._nodes) >= MAX_NODES:
                self.stats["nodes_refused"] += 1
                return []
            node = self._nodes[batch.source] = _Node(batch.cluster, first_ns, last_ns)
        elif last_ns <= node.last_ns:
            return []
        if node.silent:
            node.silent, node.since_ns, node.dirty = False, first_ns, True
        node.last_ns = last_ns
        for stack in batch.stacks:
            if stack.kind == GPU:
                self._gpus(node, stack)
            elif stack.kind == NIC_PORT:
                if "rate" in stack.labels and "state" in stack.labels:
                    self._nic_rates(batch.source, node, stack)
                if any(n in _RX_PAUSE for n in stack.counter_names) and stack.rates is not None:
                    self._pauses(node, stack)
                pcie = _pcie_low(stack.gauge_names, stack.gauges)
                if pcie is not None:
                    self._pcie(node, stack, list(stack.ids), NIC_PCIE, *pcie)
        for _tick, events in batch.events.items():
            for e in events:
                if e.kind == "xid":
                    node.events.append(HealthEvent(self._gpu_name(node, e.entity_id, -1), XID, e.code, e.time_ns,
                                                   e.detail))
                    node.dirty = True
        for f in findings:
            self._note_finding(batch.source, node, f)
        return self._digest_if_due(batch.source, node, last_ns)

    def screen(self, group: LayoutGroup) -> None:
        """Per stack of a layout group: could any of its samples start or extend an episode?
        (a port held by pauses, a throttled busy GPU, a new ECC error). The per-record path
        skips the others unless the node already has an open episode there."""
        kind, _, counter_names, gauge_names = group.key
        if group.rates is None:
            return
        if kind == NIC_PORT:
            cols = [j for j, n in enumerate(counter_names) if n in _RX_PAUSE]
            if cols:
                duty = np.fmax.reduce(group.rates[:, :, cols], axis=2)
                held = group.segment_any((duty >= self.partial_pause_duty).any(axis=1))
                for i, stack in enumerate(group.stacks):
                    stack.screens["pauses"] = bool(held[i])
        elif kind == GPU:
            j = counter_names.index(_ECC_UNC) if _ECC_UNC in counter_names else None
            ecc = None
            if j is not None:
                ecc = group.segment_any((group.rates[:, :, j] * group.dt_s[:, None] > 0.5).any(axis=1))
            hits = None
            masks = _gpu_masks(gauge_names, group.gauges)
            if masks is not None:
                busy, thermal, power = masks
                pcie = _pcie_low(gauge_names, group.gauges)
                slow_link = busy & pcie[1] if pcie is not None else False
                hits = group.segment_any((thermal | power | slow_link).any(axis=1))
            for i, stack in enumerate(group.stacks):
                stack.screens["gpus"] = (None if hits is None else bool(hits[i]), None if ecc is None else bool(ecc[i]))

    def sweep(self, now_ns: int) -> list[NodeHealth]:
        """Digests of nodes that stopped reporting while their partition moved on to ``now_ns``."""
        out = []
        for name, node in list(self._nodes.items()):
            if node.silent:
                if now_ns - node.last_ns > FORGET_AFTER_S * 1e9:
                    del self._nodes[name]
                    self.stats["nodes_forgotten"] += 1
                continue
            if now_ns - node.last_ns > SILENT_AFTER_S * 1e9:
                node.silent, node.dirty = True, True
                out += self._digest_if_due(name, node, now_ns)
        return out

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def nodes(self) -> list[str]:
        return list(self._nodes)

    # -- conditions -----------------------------------------------------------------------
    def _gpu_name(self, node: _Node, entity_id: str, position: int) -> str:
        name = node.gpu_index.get(entity_id)
        if name is None:
            m = _GPU_ID.search(entity_id)
            name = gpu_entity(int(m.group(1))) if m else gpu_entity(position) if position >= 0 else entity_id
            if len(node.gpu_index) < 64:
                node.gpu_index[entity_id] = name
        return name

    def _gpus(self, node: _Node, stack: FrameStack) -> None:
        screened = stack.screens.get("gpus")
        if screened is not None and screened[0] is not None and not screened[0] and not screened[1] \
                and not any(c in (THERMAL, POWER, GPU_PCIE) for _, c in node.runs):
            return                                        # screened: nothing throttled, no ECC error
        col = {n: stack.gauge_column(n) for n in _GPU_GAUGES}
        if stack.rates is not None:
            j = stack.column(_ECC_UNC)
            if j is not None:
                new = stack.rates[:, :, j] * stack.dt_s[:, None]
                for k, i in zip(*np.nonzero(new > 0.5)):   # NaN (reset, first sample) is not
                    count = int(round(float(new[k, i])))
                    node.events.append(HealthEvent(self._gpu_name(node, stack.ids[i], int(i)), ECC, count,
                                                   int(stack.times_ns[k]),
                                                   f"{count} uncorrectable ECC error(s) on {stack.ids[i]}"))
                    node.dirty = True
        masks = _gpu_masks(stack.gauge_names, stack.gauges)
        if masks is None:
            return
        busy, thermal, power = masks
        names = [self._gpu_name(node, eid, i) for i, eid in enumerate(stack.ids)]
        pcie = _pcie_low(stack.gauge_names, stack.gauges)
        if pcie is not None:      # an idle GPU lowers its PCIe gen to save power (NVML): busy samples only
            self._pcie(node, stack, names, GPU_PCIE, pcie[0] & busy, pcie[1] & busy)
        g = stack.gauges
        raw = g[:, :, col["clocks_event_reasons"]]
        reasons = np.where(np.isfinite(raw), raw, 0).astype(np.int64) & ~REASON_GPU_IDLE
        sm = g[:, :, col["sm_clock_mhz"]]
        temp = g[:, :, col["temperature_c"]] if col["temperature_c"] is not None else np.full(raw.shape, np.nan)
        open_gpu = any(c in (THERMAL, POWER) for _, c in node.runs)
        if not (open_gpu or thermal.any() or power.any()):
            return                                       # the healthy fast path
        sm_max = g[:, :, col["sm_clock_max_mhz"]] if col["sm_clock_max_mhz"] is not None else np.full(raw.shape, np.nan)
        power_w = g[:, :, col["power_mw"]] / 1000.0 if col["power_mw"] is not None else np.full(raw.shape, np.nan)
        ratio = np.where(sm_max > 0, sm / np.where(sm_max > 0, sm_max, 1.0), np.nan)
        interval = _interval_ns(stack)
        for condition, hit in ((THERMAL, thermal), (POWER, power)):
            for i in range(len(stack.ids)):
                key = (names[i], condition)
                if not hit[:, i].any():
                    if key in node.runs:
                        self._advance_quiet(node, key, stack.times_ns[busy[:, i]])
                    continue
                for k in range(len(stack.ticks)):
                    if not busy[k, i]:
                        continue
                    run = self._step(node, key, int(stack.times_ns[k]), bool(hit[k, i]), interval)
                    if run is not None and hit[k, i]:
                        run.add(int(stack.times_ns[k]), float(ratio[k, i]), float(temp[k, i]), float(power_w[k, i]),
                                int(reasons[k, i]))
                        run.detail = f"{sm[k, i]:.0f}/{sm_max[k, i]:.0f}"
                        self._maybe_publish(node, run)

    def _nic_rates(self, source: str, node: _Node, stack: FrameStack) -> None:
        interval = _interval_ns(stack)
        for k in range(len(stack.ticks)):
            rates, states = stack.labels["rate"][k], stack.labels["state"][k]
            labels = (rates, states, self.nominal.version)
            if labels == node.nic_labels:
                continue                                 # the same healthy picture as last tick
            t_ns = int(stack.times_ns[k])
            any_run = False
            for i, eid in enumerate(stack.ids):
                if not rates[i] or not states[i]:
                    continue                             # not read this tick: no evidence
                current = parse_ib_rate(rates[i])
                active = states[i].startswith("4")
                if active and len(node.seen_active) < 64:
                    node.seen_active.add(eid)
                # down: a port that was up (NCCL used it) and is not ACTIVE now
                for condition, hit in ((NIC_DOWN, not active and eid in node.seen_active),
                                       (NIC_DOWNGRADE, active and current is not None
                                        and current.gbps < self.nominal.for_port(node.cluster, source, eid).gbps)):
                    key = (eid, condition)
                    if not hit and key not in node.runs:
                        continue
                    run = self._step(node, key, t_ns, hit, interval)
                    if run is None:
                        continue
                    any_run = True
                    if not hit:
                        continue
                    if condition == NIC_DOWN:
                        run.add(t_ns, 0.0)
                        run.reference, run.detail = 4.0, f"state {states[i].strip()}"
                    else:
                        run.add(t_ns, current.gbps)
                        run.reference = self.nominal.for_port(node.cluster, source, eid).gbps
                        run.detail = rates[i].strip()
                    self._maybe_publish(node, run)
            node.nic_labels = () if any_run or any(c in (NIC_DOWNGRADE, NIC_DOWN) for _, c in node.runs) else labels

    def _pauses(self, node: _Node, stack: FrameStack) -> None:
        if stack.screens.get("pauses") is False and not any(c in (STORM_VICTIM, PARTIAL_PAUSE) for _, c in node.runs):
            return                                        # screened: no port held
        cols = [j for j, n in enumerate(stack.counter_names) if n in _RX_PAUSE]
        duty = stack.rates[:, :, cols]
        duty = np.clip(np.fmax.reduce(duty, axis=2), 0.0, 1.0)   # NaN only where every priority is NaN
        observed = np.isfinite(duty)
        for condition, threshold in ((STORM_VICTIM, self.storm_victim_pause_duty),
                                     (PARTIAL_PAUSE, self.partial_pause_duty)):
            held = duty >= threshold                              # NaN compares False
            if not (held.any() or any(c == condition for _, c in node.runs)):
                continue

            def add(run: _Run, k: int, i: int, threshold=threshold) -> None:
                run.add(int(stack.times_ns[k]), float(duty[k, i]))
                run.reference = threshold

            self._fold(node, stack, list(stack.ids), condition, observed, held, add)

    def _pcie(self, node: _Node, stack: FrameStack, names: list[str], condition: str,
              read: np.ndarray, low: np.ndarray) -> None:
        """NIC or GPU PCIe links trained below their maximum (width or gen), per sample read."""
        if not (low.any() or any(c == condition for _, c in node.runs)):
            return                                        # the healthy fast path

        def add(run: _Run, k: int, i: int) -> None:
            width, width_max, run.detail = _pcie_detail(stack, k, i)
            run.add(int(stack.times_ns[k]), width)
            run.reference = width_max

        self._fold(node, stack, names, condition, read, low & read, add)

    def _fold(self, node: _Node, stack: FrameStack, names: list[str], condition: str,
              observed: np.ndarray, hit: np.ndarray, add) -> None:
        """Advance one condition's episodes over a stack: ``observed``/``hit`` [tick, entity];
        ``add(run, k, i)`` records a sample that showed it."""
        interval = _interval_ns(stack)
        hit_any = hit.any(axis=0).tolist()              # one reduction for every entity, not one each
        for i, name in enumerate(names):
            key = (name, condition)
            if not hit_any[i]:
                if key in node.runs:
                    self._advance_quiet(node, key, stack.times_ns[observed[:, i]])
                continue
            for k in np.flatnonzero(observed[:, i]):
                run = self._step(node, key, int(stack.times_ns[k]), bool(hit[k, i]), interval)
                if run is not None and hit[k, i]:
                    add(run, int(k), i)
                    self._maybe_publish(node, run)

    def _note_finding(self, source: str, node: _Node, f: Finding) -> None:
        """Keep an anomaly on one of the node's NICs or GPUs, under its open event's id."""
        e = f.entity
        if f.kind not in RELATED_KINDS or e.node != source or not e.device or e.switch:
            return
        entity_id = f"{e.device}/{e.port}" if e.port else self._gpu_name(node, e.device, -1)
        key = (entity_id, f.kind)
        held = node.findings.get(key)
        if f.state == OPEN:
            if held is None and len(node.findings) >= MAX_FINDINGS_PER_NODE:
                return
            node.findings[key] = Episode(entity_id, f.kind, f.onset_ns, f.detected_ns, True, 1, 1,
                                         detail=f.event_id, holding=True)
        elif held is None:
            return                                        # opened before this tracker knew the node
        elif f.state == RESOLVED:
            del node.findings[key]
            node.closed.append(replace(held, end_ns=f.detected_ns, open=False, holding=False))
        else:
            return                                        # an update: same anomaly, same id
        node.dirty = True

    # -- episodes -------------------------------------------------------------------------
    def _step(self, node: _Node, key: tuple[str, str], t_ns: int, hit: bool, interval_ns: int) -> _Run | None:
        """Advance one episode by one observed sample; the run it belongs to (None: none)."""
        run = node.runs.get(key)
        if run is None:
            if not hit:
                return None
            run = node.runs[key] = _Run(key[0], key[1], t_ns, t_ns, interval_ns)
            return run
        if hit:
            if run.published and run.trailing >= BREAK_SAMPLES:
                node.dirty = True                        # it holds again
            return run
        run.total += 1
        run.trailing += 1
        if run.published and run.trailing == BREAK_SAMPLES:
            node.dirty = True                            # it stopped holding, maybe for good
        if t_ns - run.end_ns >= GAP_S * 1e9:
            del node.runs[key]
            if run.published:
                node.closed.append(run.episode(False))
                node.dirty = True
            return None
        return run

    def _advance_quiet(self, node: _Node, key: tuple[str, str], times_ns: np.ndarray) -> None:
        """`_step` over observed samples that all lack the condition, at once."""
        run = node.runs.get(key)
        if run is None or not len(times_ns):
            return
        before = run.trailing
        run.total += len(times_ns)
        run.trailing += len(times_ns)
        if run.published and before < BREAK_SAMPLES <= run.trailing:
            node.dirty = True                            # it stopped holding, maybe for good
        if int(times_ns[-1]) - run.end_ns >= GAP_S * 1e9:
            del node.runs[key]
            if run.published:
                node.closed.append(run.episode(False))
                node.dirty = True

    @staticmethod
    def _maybe_publish(node: _Node, run: _Run) -> None:
        if not run.published and run.on >= MIN_PUBLISHED_SAMPLES and (
                run.condition != PARTIAL_PAUSE or (run.end_ns - run.start_ns >= PARTIAL_PAUSE_MIN_S * 1e9 and
                                                   run.on * run.interval_ns >= _PARTIAL_PAUSE_MIN_ON_NS)):
            run.published, node.dirty = True, True

    def _digest_if_due(self, name: str, node: _Node, as_of_ns: int) -> list[NodeHealth]:
        published = [r for r in node.runs.values() if r.published]
        if not node.dirty and not (published and as_of_ns - node.last_digest_ns >= REFRESH_S * 1e9):
            return []
        node.dirty, node.last_digest_ns = False, as_of_ns
        horizon = as_of_ns - int(self.history_s * 1e9)
        while node.closed and node.closed[0].end_ns < horizon:
            node.closed.popleft()
        event_horizon = as_of_ns - int(max(EVENT_HISTORY_S, self.history_s) * 1e9)
        while node.events and node.events[0].time_ns < event_horizon:
            node.events.popleft()
        episodes = tuple(node.closed) + tuple(r.episode(True) for r in published) + tuple(node.findings.values())
        return [NodeHealth(node.cluster, name, as_of_ns, node.since_ns, node.last_ns, node.silent, episodes,
                           tuple(node.events))]
