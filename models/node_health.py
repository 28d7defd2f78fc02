"""Node health: what may explain a slow rank, as facts that any worker can read.

Two halves, so that the straggler stage needs no telemetry of its own:

* `health_tracker.HealthTracker` (stage 1, next to each node's telemetry) turns ticks into
  *episodes*: runs of samples in which one GPU or NIC port showed one condition (thermal or
  power throttling, a NIC link below its nominal rate, a NIC port held by PFC pauses), plus
  recent XID and ECC events, and publishes them as one `NodeHealth` digest per node when
  they change. Digests are small (a healthy node has none after its first) and travel on
  the facts topic that every worker reads.
* `HealthBook` (wherever stragglers are judged) keeps the recent digests of each node and
  answers `cause_for(node, gpu, at_ns)`: the most likely *local* cause of a slow rank on
  that GPU around ``at_ns``, with its evidence, as ``(cause, evidence)``; ``cause`` is one
  of `CAUSES`, or `NONE` (seen, nothing wrong) or `UNKNOWN` (no telemetry then).

Answers are given *as of* the window's end: from the newest digest that describes the node
at or before it (`NodeHealth.as_of_ns`), so a reader that has read further (a backlog, a
fast partition) answers exactly as one that has not. A cause counts only if its episodes
cover at least ``cause_min_fraction`` of the observed time in the window (one sample of
incast or of a power-capped GPU is ordinary), and a clock throttle only if its clock
deficit can explain the slowdown. The NIC ``mlx5_<r>/1`` (rail r) serves GPU r unless a
`Topology` says otherwise (`NicPort.gpu_index`).

`NodeHealthBook` is both halves in one object, for one process that sees the telemetry
itself (tests, examples).

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
>>> book.cause_for("node-2", 1, 3 * 10**9)[0]
'unknown'
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field

from fabricwatch.xid import is_gpu_fault

from .findings import Evidence
from .frames import SourceView
from .topology import Topology
from .vocabulary import (ECC, GPU_ECC_UNCORRECTABLE, GPU_PCIE, GPU_XID, LINK_DOWN, LINK_DOWNGRADE, LINK_FLAP,
                         NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, NODE_CAUSES, NONE, PARTIAL_PAUSE, PCIE_DOWNGRADE, POWER,
                         STORM_VICTIM, THERMAL, UNKNOWN, XID)

# -- causes ---------------------------------------------------------------------------------
# A rank's whole path: its GPU (clocks, PCIe, hardware errors), its rail NIC (link state and
# rate, the NIC's own PCIe link, pauses received from its switch). Priority within a side: a
# throttle that explains the slowdown beats a recent hardware error (XIDs and ECC errors
# more often crash a job than slow it); a NIC that is down beats one that is slow, a
# hardware state beats congestion (pauses).
# GPU PCIe is on both sides: the GPU's own link carries host<->device copies (in the rank's
# busy time) and, with GPUDirect RDMA, every byte the NIC reads from or writes to GPU memory
# (the job's collectives). On a rail-optimised node the collectives are what it slows most
# (the NIC's traffic crosses it, the kernels do not), so the network side tries it last.
GPU_CAUSES = (THERMAL, POWER, GPU_PCIE, XID, ECC)                    # can slow a rank's own compute
NETWORK_CAUSES = (NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, STORM_VICTIM, PARTIAL_PAUSE, GPU_PCIE)  # its collectives
CAUSES = NODE_CAUSES
CAUSE_TEXT = {
    THERMAL: "thermal throttling",
    POWER: "power capping",
    NIC_DOWN: "NIC link down (NCCL on a sibling NIC)",
    NIC_DOWNGRADE: "NIC link downgrade",
    NIC_PCIE: "NIC PCIe link below its maximum",
    STORM_VICTIM: "PFC storm victim",
    PARTIAL_PAUSE: "NIC partly paused by PFC",
    GPU_PCIE: "GPU PCIe link below its maximum",
    XID: "recent GPU XID error",
    ECC: "uncorrectable ECC errors",
    NONE: "no local cause visible (data loader, host CPU?)",
    UNKNOWN: "no telemetry from the node around that time",
}
CAUSE_ACTION = {
    THERMAL: "check the node's cooling (fans, inlet temperature, airflow); drain it after the next checkpoint",
    POWER: "check the GPU power limit and the node's PSUs/power-brake signal; drain it after the next checkpoint",
    NIC_DOWN: "check the NIC's cable/transceiver and its switch port (link_down finding); drain the node after "
              "the next checkpoint",
    NIC_DOWNGRADE: "reseat or replace the NIC cable/transceiver; drain the node after the next checkpoint",
    NIC_PCIE: "check the NIC's slot/riser (lspci LnkSta vs LnkCap); drain the node after the next checkpoint",
    STORM_VICTIM: "find and isolate the PFC storm source on the same leaf (pfc_storm finding)",
    PARTIAL_PAUSE: "find what congests the NIC's switch port (a slow receiver, a misconfigured PFC/ECN "
                   "profile); check the leaf's queue counters",
    GPU_PCIE: "check the GPU's slot/riser/PCIe switch (nvidia-smi -q PCIe link); drain the node after the "
              "next checkpoint",
    XID: "look up the XID in NVIDIA's catalog; reset or drain the GPU",
    ECC: "drain the node; the GPU needs a row remap/reset",
    NONE: "profile the rank (data loader, host CPU, stragglers in input pipeline)",
    UNKNOWN: "check the node's collector",
}
# Conditions an episode can record: the causes that are states of a GPU or NIC port.
CONDITIONS = (THERMAL, POWER, NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, STORM_VICTIM, PARTIAL_PAUSE, GPU_PCIE)
# Anomalies that stage 1 opens on a node's NIC or GPU, which a straggler on that NIC or GPU
# cites by id (the digest carries them as episodes whose condition is the kind and whose
# detail is the id of the open event; `HealthBook.related_for`).
RELATED_KINDS = (LINK_DOWN, LINK_DOWNGRADE, PCIE_DOWNGRADE, LINK_FLAP, GPU_XID, GPU_ECC_UNCORRECTABLE)

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
HISTORY_S = 120.0            # episodes that ended longer ago than this are forgotten
LOOKBACK_S = 5.0             # cause_for looks at [at - LOOKBACK_S, at + LOOKAHEAD_S]
LOOKAHEAD_S = 2.0
MAX_SAMPLE_AGE_S = 60.0      # with no observation in the window, the last one if this recent
EVENT_LOOKBACK_S = 300.0     # XIDs / ECC errors this recent count as a cause
CAUSE_MIN_FRACTION = 0.5     # a condition must cover at least this share of the observed window
STORM_VICTIM_PAUSE_DUTY = 0.5  # received pause duty; healthy incast stays below it
# Received pause duty d leaves a port 1 - d of its time to send: at 0.2 the NIC's collectives
# run 1 / (1 - 0.2) = 1.25x longer, the job-level slowdown the straggler detector calls a
# slowed collective (`straggler.COMM_SLOWDOWN`); below it a pause cannot explain one.
PARTIAL_PAUSE_DUTY = 0.2
THROTTLE_CLOCK_RATIO = 0.9   # without a slowdown to explain: SM clock / max at or below this
# With a slowdown s to explain, the clock deficit (max/clock - 1) must reach this share of
# s - 1: a GPU at 0.93 of its clock (ordinary power capping) does not explain 1.3x.
THROTTLE_EXPLAINS_FRACTION = 0.5
# The same for a partial pause and the job's comm slowdown s: a port paused d of the window
# sends 1 / (1 - d) slower, and 1 / (1 - d) - 1 must reach this share of s - 1 (a rank whose
# NIC sees a few seconds of incast does not explain a collective twice as slow).
PAUSE_EXPLAINS_FRACTION = THROTTLE_EXPLAINS_FRACTION
MAX_DIGESTS_PER_NODE = 64    # digests kept per node for as-of answers (a few per minute)
MAX_NODES = 200_000          # nodes remembered; more is id churn (the oldest are dropped)

_RAIL_NIC = re.compile(r"^mlx5_(\d+)/")


def reason_names(mask: int) -> list[str]:
    """NVML clocks-event reason bits by name, ``GpuIdle`` excluded.

    >>> reason_names(0x44 | 0x1)
    ['SwPowerCap', 'HwThermalSlowdown']
    """
    return [name for bit, name in REASON_BITS.items() if mask & bit]


def rail_nic(gpu_index: int) -> str:
    """The NIC port that serves a GPU on a rail-optimised node without a topology file."""
    return f"mlx5_{gpu_index}/1"


def gpu_entity(gpu_index: int) -> str:
    return f"gpu{gpu_index}"


def describe_cause(cause: str, evidence: list[Evidence]) -> str:
    """One line for a finding: the cause's text, then the first evidence's detail.

    >>> describe_cause(NONE, [Evidence("samples", 5, 1, "samples", "nothing seen")])
    'no local cause visible (data loader, host CPU?)'
    """
    text = CAUSE_TEXT.get(cause, cause)
    if cause not in (NONE, UNKNOWN) and evidence and evidence[0].detail:
        return f"{text} ({evidence[0].detail})"
    return text


# -- the facts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Episode:
    """A run of samples in which one GPU or NIC port showed one condition."""

    entity_id: str             # "gpu3", "mlx5_2/1"
    condition: str             # one of CONDITIONS
    start_ns: int              # first sample it held in
    end_ns: int                # last sample it held in
    open: bool                 # still holding at the newest sample
    samples_on: int
    samples_total: int         # samples from start to the newest one that could show it
    value: float = math.nan    # mean measure while on: SM clock ratio, pause duty, Gb/s
    reference: float = math.nan
    temperature_c: float = math.nan
    power_w: float = math.nan
    reasons: int = 0           # NVML reason bits seen while on
    detail: str = ""           # NIC: the rate string; GPU: "<sm>/<max>" MHz
    sample_interval_ns: int = 1_000_000_000
    holding: bool = False      # open and holding at the newest sample (an open episode in a gap is not)

    @property
    def on_fraction(self) -> float:
        """Share of its samples from start to end that showed the condition."""
        return self.samples_on / self.samples_total if self.samples_total else 0.0


@dataclass(frozen=True)
class HealthEvent:
    entity_id: str
    kind: str                  # XID | ECC
    code: int                  # XID number; ECC: errors in this increment
    time_ns: int
    detail: str = ""


@dataclass(frozen=True)
class NodeHealth:
    """One node's recent health as of ``as_of_ns``; each digest replaces the last."""

    cluster: str
    node: str
    as_of_ns: int
    observed_since_ns: int     # first tick of the current run of ticks
    observed_until_ns: int     # newest tick seen
    silent: bool = False       # stopped reporting after observed_until_ns
    episodes: tuple[Episode, ...] = ()
    events: tuple[HealthEvent, ...] = ()


# -- the reader -----------------------------------------------------------------------------
def _samples(a: int, b: int, anchor: int, interval: int) -> int:
    """How many samples ``anchor + k * interval`` (k >= 0) fall in [a, b]."""
    a = max(a, anchor)
    if b < a or interval <= 0:
        return 0
    first = -((anchor - a) // interval)            # ceil((a - anchor) / interval)
    last = (b - anchor) // interval
    return max(0, last - first + 1)


@dataclass(frozen=True)
class _Window:
    lo: int
    hi: int
    seen_until: int            # the node's telemetry is known up to here (<= hi)
    since: int                 # ... and from here (its first tick of the current run)


@dataclass
class HealthBook:
    """Recent `NodeHealth` digests per node, and the probable cause of a slow rank.

    Parameters
    ----------
    topology : maps each NIC port to the GPU it serves; without it NIC ``mlx5_<r>/1``
        serves GPU r.
    lookback_s, lookahead_s : the window around ``at_ns`` that `cause_for` reads.
    event_lookback_s : how recent an XID or ECC error must be to count.
    cause_min_fraction : share of the window's observed time a condition must cover.
    throttle_clock_ratio : SM clock / max at or below which a throttle is a cause when
        no slowdown is given to explain.
    """

    topology: Topology | None = None
    lookback_s: float = LOOKBACK_S
    lookahead_s: float = LOOKAHEAD_S
    event_lookback_s: float = EVENT_LOOKBACK_S
    cause_min_fraction: float = CAUSE_MIN_FRACTION
    throttle_clock_ratio: float = THROTTLE_CLOCK_RATIO
    max_nodes: int = MAX_NODES
    _digests: dict[str, deque] = field(default_factory=dict, repr=False)
    _nic_of: dict[tuple[str, int], str] = field(default_factory=dict, repr=False)
    # Through when every node's telemetry has been processed (stage 1's low watermark): a
    # node that is not silent is observed up to here, even if its last digest is older.
    watermark_ns: int = 0
    stats: dict = field(default_factory=lambda: {"digests": 0, "nodes_dropped": 0}, repr=False)

    def __post_init__(self) -> None:
        for name in ("lookback_s", "event_lookback_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.lookahead_s >= 0:
            raise ValueError(f"lookahead_s must be >= 0, got {self.lookahead_s!r}")
        for name in ("cause_min_fraction", "throttle_clock_ratio"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")

    # -- facts in -------------------------------------------------------------------------
    def apply(self, digest: NodeHealth) -> None:
        """Add a digest; digests of a node arrive in ``as_of`` order (older ones are dropped)."""
        history = self._digests.get(digest.node)
        if history is None:
            if len(self._digests) >= self.max_nodes:
                self._digests.pop(next(iter(self._digests)))
                self.stats["nodes_dropped"] += 1
            history = self._digests[digest.node] = deque(maxlen=MAX_DIGESTS_PER_NODE)
        if history and digest.as_of_ns < history[-1].as_of_ns:
            return
        history.append(digest)
        self.stats["digests"] += 1
        # keep digests only as far back as any answer can reach
        horizon = digest.as_of_ns - int(max(HISTORY_S, self.event_lookback_s) * 1e9)
        while len(history) > 1 and history[1].as_of_ns <= horizon:
            history.popleft()

    def advance(self, watermark_ns: int) -> None:
        self.watermark_ns = max(self.watermark_ns, watermark_ns)

    def forget(self, node: str) -> None:
        self._digests.pop(node, None)

    def nodes(self) -> list[str]:
        return list(self._digests)

    def digest_as_of(self, node: str, at_ns: int) -> NodeHealth | None:
        """The newest digest of ``node`` describing it at or before ``at_ns``."""
        history = self._digests.get(node)
        if not history:
            return None
        for digest in reversed(history):
            if digest.as_of_ns <= at_ns:
                return digest
        return None

    # -- answers --------------------------------------------------------------------------
    def nic_for(self, node: str, gpu_index: int) -> str:
        """The NIC port id that serves a GPU (topology first, then the rail convention)."""
        key = (node, gpu_index)
        nic = self._nic_of.get(key)
        if nic is None:
            nic = rail_nic(gpu_index)
            if self.topology is not None:
                for port in self.topology.nics_of(node):
                    if port.gpu_index == gpu_index:
                        nic = port.entity_id
                        break
            if len(self._nic_of) < self.max_nodes:
                self._nic_of[key] = nic
        return nic

    def _around(self, node: str, at_ns: int, since_ns: int | None,
                read_at_ns: int | None = None) -> tuple[int, int, NodeHealth | None]:
        """The window around ``at_ns`` (from ``since_ns`` if later than the look-back), and the
        node's digest as of its end (or as of the window of ``read_at_ns``, if later)."""
        lo = at_ns - int(self.lookback_s * 1e9)
        if since_ns is not None:
            lo = max(lo, min(since_ns, at_ns))
        hi = at_ns + int(self.lookahead_s * 1e9)
        as_of = hi if read_at_ns is None else max(hi, read_at_ns + int(self.lookahead_s * 1e9))
        return lo, hi, self.digest_as_of(node, as_of)

    def cause_for(self, node: str, gpu_index: int, at_ns: int, *, since_ns: int | None = None,
                  slowdown: float | None = None, candidates: tuple[str, ...] = CAUSES,
                  read_at_ns: int | None = None) -> tuple[str, list[Evidence]]:
        """Most likely local cause of a slow rank on ``node``/``gpu_index`` around ``at_ns``.

        The window is from ``lookback_s`` before ``at_ns`` (or from ``since_ns``, the start
        of the slow step, if later) to ``lookahead_s`` after it. ``slowdown`` (the rank's
        time over its peers') lets a clock throttle count only if it explains that much;
        ``candidates`` restricts and orders the causes tried (e.g. `GPU_CAUSES` for a rank
        whose own compute is slow). ``read_at_ns``: read the digest as of that later window's
        end (an earlier step judged again with what is known now: a condition is published
        some samples after it began, and its episode then reaches back to its start). Returns
        ``NONE`` when the node was seen but shows none of them, ``UNKNOWN`` when there is no
        telemetry around then.
        """
        lo, hi, digest = self._around(node, at_ns, since_ns, read_at_ns)
        if digest is None:
            return UNKNOWN, [Evidence("samples", 0, 1, "samples", f"no telemetry from {node} before the step")]
        seen_until = digest.observed_until_ns if digest.silent else max(digest.observed_until_ns,
                                                                        min(self.watermark_ns, hi))
        seen_until = min(hi, seen_until)
        window = _Window(lo, hi, seen_until, digest.observed_since_ns)
        if seen_until < lo or digest.observed_since_ns > hi:
            # sparse or stopped sampling: the last observation, if recent enough, stands for the window
            if digest.observed_until_ns < at_ns - int(MAX_SAMPLE_AGE_S * 1e9) or digest.observed_since_ns > hi:
                return UNKNOWN, [Evidence("samples", 0, 1, "samples",
                                          f"no telemetry from {node} within {MAX_SAMPLE_AGE_S:g} s before the step")]
            last = digest.observed_until_ns
            window = _Window(last, last, last, last)
        for cause in candidates:
            evidence = self._check(cause, digest, gpu_index, node, window, at_ns, slowdown)
            if evidence:
                return cause, evidence
        evidence = [Evidence("window_s", (window.hi - window.lo) / 1e9, 1, "s",
                             f"GPU{gpu_index} unthrottled, its NIC up at nominal rate and unpaused, "
                             "PCIe links at their maximum, no hardware XID/ECC")]
        return NONE, evidence + self._application_xids(digest, gpu_index, at_ns)

    def _application_xids(self, digest: NodeHealth, gpu: int, at_ns: int) -> list[Evidence]:
        """Weak evidence: XIDs that say nothing of the GPU's health (NVIDIA's catalog: the
        application's own errors such as 13, 31, 43, and 45, the driver's cleanup after
        another fault), shown when nothing else explains the rank."""
        lo, hi = at_ns - int(self.event_lookback_s * 1e9), at_ns + int(self.lookahead_s * 1e9)
        entity = gpu_entity(gpu)
        codes = sorted({e.code for e in digest.events if e.kind == XID and e.entity_id == entity
                        and not is_gpu_fault(e.code) and lo <= e.time_ns <= hi})
        if not codes:
            return []
        return [Evidence("application_xid", float(codes[-1]), math.nan, "code",
                         f"XID {', '.join(map(str, codes))} on {entity}: raised by the application, "
                         "not a GPU fault")]

    # -- rules ----------------------------------------------------------------------------
    def _covering(self, digest: NodeHealth, entity_id: str, condition: str,
                  w: _Window) -> tuple[float, list[tuple[Episode, float]]]:
        """Share of the window's samples that showed a condition, and the episodes behind it.

        Samples are counted on each episode's own sampling grid, as a book of samples would
        count them: those in the window and in the episode's span, times its on-fraction,
        over those the node reported in the window.
        """
        hits, found = 0.0, []
        observed = 0
        for e in digest.episodes:
            if e.entity_id != entity_id or e.condition != condition:
                continue
            step = e.sample_interval_ns
            jitter = step // 4                 # sample times wander around the grid by clock jitter
            end = max(e.end_ns, w.seen_until) if e.open and e.holding else e.end_ns
            n = _samples(w.lo, min(w.hi, end + jitter), e.start_ns, step)
            observed = max(observed, _samples(w.lo, w.seen_until + jitter,
                                              w.since + (e.start_ns - w.since) % step, step))
            if n:
                hits += n * e.on_fraction
                found.append((e, n * e.on_fraction))
        return (min(1.0, hits / observed) if observed else (1.0 if found else 0.0)), found

    def _check(self, cause, digest, gpu, node, window, at_ns, slowdown) -> list[Evidence]:
        if cause in (THERMAL, POWER):
            return self._throttle(cause, digest, gpu, window, slowdown)
        if cause == GPU_PCIE:
            return self._state(cause, digest, gpu_entity(gpu), window)
        if cause in (NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, STORM_VICTIM, PARTIAL_PAUSE):
            return self._state(cause, digest, self.nic_for(node, gpu), window, slowdown)
        if cause in (XID, ECC):
            return self._events(cause, digest, gpu, at_ns)
        raise ValueError(f"candidates: unknown cause {cause!r}; known: {CAUSES}")

    def _throttle(self, cause, digest, gpu, window, slowdown) -> list[Evidence]:
        fraction, hits = self._covering(digest, gpu_entity(gpu), cause, window)
        if not hits or fraction < self.cause_min_fraction:
            return []
        weight = sum(n for _, n in hits)
        ratio = sum(e.value * n for e, n in hits) / weight
        if slowdown is not None and slowdown > 1:
            needed = 1.0 / (1.0 + THROTTLE_EXPLAINS_FRACTION * (slowdown - 1.0))
        else:
            needed = self.throttle_clock_ratio
        if not ratio <= needed:
            return []
        seen = 0
        for e, _ in hits:
            seen |= e.reasons
        main = max(hits, key=lambda h: h[1])[0]
        return [
            Evidence("sm_clock_ratio", ratio, needed, "ratio",
                     f"{', '.join(reason_names(seen))}, SM clock {main.detail} MHz"),
            Evidence("throttled_sample_fraction", fraction, self.cause_min_fraction, "fraction",
                     f"{weight:.0f} busy samples in the window throttled"),
            Evidence("temperature_c", main.temperature_c, math.nan, "degC"),
            Evidence("power_w", main.power_w, math.nan, "W"),
        ]

    def _state(self, cause, digest, entity, window, slowdown=None) -> list[Evidence]:
        """A condition of a NIC port or a GPU's link that held over enough of the window."""
        fraction, hits = self._covering(digest, entity, cause, window)
        if not hits or fraction < self.cause_min_fraction:
            return []
        main = max(hits, key=lambda h: h[1])[0]
        n = sum(k for _, k in hits)
        if cause == PARTIAL_PAUSE and slowdown is not None and slowdown > 1:
            duty = min(0.99, fraction * sum(e.value * k for e, k in hits) / n)   # share of the window paused
            if 1.0 / (1.0 - duty) - 1.0 < PAUSE_EXPLAINS_FRACTION * (slowdown - 1.0):
                return []
        share = Evidence(f"{cause}_sample_fraction", fraction, self.cause_min_fraction, "fraction",
                         f"{n:.0f} samples in the window")
        if cause == NIC_DOWNGRADE:
            return [Evidence("nic_rate_gbps", main.value, main.reference, "Gb/s",
                             f"{entity} at {main.detail}, nominal {main.reference:g} Gb/s"), share]
        if cause == NIC_DOWN:
            return [Evidence("nic_state", main.value, 4, "state", f"{entity} {main.detail}"), share]
        if cause in (NIC_PCIE, GPU_PCIE):
            return [Evidence("pcie_width", main.value, main.reference, "lanes", f"{entity} PCIe {main.detail}"),
                    share]
        return [Evidence("rx_pause_duty", main.value, main.reference, "s/s",
                         f"{entity} paused by its switch {main.value:.0%} of the time"), share]

    def related_for(self, node: str, gpu_index: int, at_ns: int, *,
                    since_ns: int | None = None) -> list[tuple[str, str, str]]:
        """Anomalies stage 1 had open on the GPU or its NIC during the window around ``at_ns``.

        ``(kind, entity id, id of the anomaly's open event)``, oldest first, read from the
        digest as of the window's end like `cause_for` (the same answer on any worker).

        >>> book = HealthBook()
        >>> book.apply(NodeHealth("c1", "n1", 9 * 10**9, 0, 9 * 10**9, episodes=(
        ...     Episode("mlx5_0/1", "link_downgrade", 2 * 10**9, 9 * 10**9, True, 1, 1, detail="a1b2"),)))
        >>> book.related_for("n1", 0, 8 * 10**9), book.related_for("n1", 1, 8 * 10**9)
        ([('link_downgrade', 'mlx5_0/1', 'a1b2')], [])
        """
        lo, hi, digest = self._around(node, at_ns, since_ns)
        if digest is None:
            return []
        mine = (gpu_entity(gpu_index), self.nic_for(node, gpu_index))
        found = [(e.start_ns, e.condition, e.entity_id, e.detail) for e in digest.episodes
                 if e.condition in RELATED_KINDS and e.entity_id in mine and e.detail
                 and e.start_ns <= hi and (e.open or e.end_ns >= lo)]
        return [(kind, entity, ident) for _, kind, entity, ident in sorted(found)]

    def _events(self, cause, digest, gpu, at_ns) -> list[Evidence]:
        lo = at_ns - int(self.event_lookback_s * 1e9)
        hi = at_ns + int(self.lookahead_s * 1e9)
        entity = gpu_entity(gpu)
        hits = [e for e in digest.events if e.kind == cause and e.entity_id == entity and lo <= e.time_ns <= hi
                and not (cause == XID and not is_gpu_fault(e.code))]
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


class NodeHealthBook:
    """A `HealthTracker` and a `HealthBook` in one process: ticks in, causes out.

    Parameters are those of both halves (``topology``, ``nominal_nic_rate``,
    ``history_s``, ``lookback_s``, ``lookahead_s``, ``event_lookback_s``,
    ``cause_min_fraction``, ``storm_victim_pause_duty``, ``throttle_clock_ratio``).
    """

    def __init__(self, topology: Topology | None = None, nominal_nic_rate: str = "", *,
                 history_s: float = HISTORY_S, lookback_s: float = LOOKBACK_S, lookahead_s: float = LOOKAHEAD_S,
                 event_lookback_s: float = EVENT_LOOKBACK_S, cause_min_fraction: float = CAUSE_MIN_FRACTION,
                 storm_victim_pause_duty: float = STORM_VICTIM_PAUSE_DUTY,
                 throttle_clock_ratio: float = THROTTLE_CLOCK_RATIO) -> None:
        from .health_tracker import HealthTracker
        from .rates import RateTracker

        if lookback_s > history_s:
            raise ValueError(f"lookback_s ({lookback_s}) must not exceed history_s ({history_s})")
        self.tracker = HealthTracker(topology=topology, nominal_nic_rate=nominal_nic_rate, history_s=history_s,
                                     storm_victim_pause_duty=storm_victim_pause_duty)
        self.book = HealthBook(topology=topology, lookback_s=lookback_s, lookahead_s=lookahead_s,
                               event_lookback_s=event_lookback_s, cause_min_fraction=cause_min_fraction,
                               throttle_clock_ratio=throttle_clock_ratio)
        self._rates = RateTracker()

    def update(self, view: SourceView) -> None:
        """Add one tick of a node (rates are derived here if the frames carry none)."""
        from .frames import SourceBatch

        if view.source_kind != "node":
            return
        batch = SourceBatch.of_views([view])
        for stack in batch.stacks:
            self._rates.update_stack(view.source, stack)
        self.update_batch(batch)

    def update_batch(self, batch) -> None:
        for digest in self.tracker.update_batch(batch):
            self.book.apply(digest)
        self.book.advance(int(batch.times_ns[-1]))

    def cause_for(self, node: str, gpu_index: int, at_ns: int, **kwargs) -> tuple[str, list[Evidence]]:
        return self.book.cause_for(node, gpu_index, at_ns, **kwargs)

    def related_for(self, node: str, gpu_index: int, at_ns: int, **kwargs) -> list[tuple[str, str, str]]:
        return self.book.related_for(node, gpu_index, at_ns, **kwargs)

    def nic_for(self, node: str, gpu_index: int) -> str:
        return self.book.nic_for(node, gpu_index)

    def nodes(self) -> list[str]:
        return self.book.nodes()

    def forget(self, node: str) -> None:
        self.tracker.forget(node)
        self.book.forget(node)
