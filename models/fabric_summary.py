"""What the fabric did over a window, per port: the numbers behind `fabricwatch report`.

Network engineers tune DCQCN, ECN and PFC thresholds and ECMP hashing from a few totals
per switch port: how long it paused its peers and was paused, how many packets it
ECN-marked, how many CNPs the NICs sent and handled, what it dropped, and how evenly a
leaf's uplinks share its traffic. `FabricSummary` adds them up from the same batches the
worker reads, through `models.rates` (so wraps, saturated counters and resets count as
they do for the detectors: an interval without an honest rate adds nothing; the rates
are in `fabricwatch.counters`' units: pause durations in seconds, IB data words in
bytes), one array operation per block layout.

Counters are grouped into `FAMILIES` by their source names (switch gNMI leaves, mlx5
``ethtool -S`` keys and hw_counters), summed over priorities and queues:

>>> import numpy as np
>>> from fabricwatch.models.frames import FrameStack, SourceBatch
>>> def tick(t_s, pause_us, marks):
...     names = ("pfc3-tx-pkts", "pfc3-tx-pause-duration-us", "queue3-ecn-marked-pkts", "out-octets")
...     stack = FrameStack("switch_port", ("Ethernet0",), names, (), np.array([0]),
...                        np.array([[[pause_us // 10, pause_us, marks, 125_000_000 * t_s]]], dtype=np.uint64),
...                        np.empty((1, 1, 0)))
...     return SourceBatch("c1", "leaf-1", "switch", np.array([t_s * 10**9]), [stack])
>>> summary = FabricSummary()
>>> summary.add(tick(0, 0, 0)); summary.add(tick(2, 1_000_000, 40))    # 1 s of pause in 2 s
>>> port = summary.ports[("c1", "leaf-1", "Ethernet0")]
>>> port["pause_tx_s"], port["ecn_marked"], port["tx_bytes"], summary.seconds
(1.0, 40.0, 250000000.0, 2.0)
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from .frames import SourceBatch
from .rates import RateTracker
from .topology import Topology


@dataclass(frozen=True)
class Family:
    name: str
    unit: str
    pattern: str          # a full match of the counter's source name


FAMILIES = (
    # PFC: switch SAI/gNMI leaves (collectors.gnmi_profiles) and mlx5 ethtool per-priority keys
    Family("pause_tx_frames", "frames", r"pfc\d-tx-pkts|tx_prio\d_pause"),
    Family("pause_rx_frames", "frames", r"pfc\d-rx-pkts|rx_prio\d_pause"),
    Family("pause_tx_s", "s", r"pfc\d-tx-pause-duration-us|tx_prio\d_pause_duration"),
    Family("pause_rx_s", "s", r"pfc\d-rx-pause-duration-us|rx_prio\d_pause_duration"),
    # ECN: a switch queue's marked packets (SAI WRED_ECN_MARKED_PACKETS, OpenConfig/Cumulus
    # ecn-marked-pkts), the NIC's CE-marked RoCE packets received (notification point)
    Family("ecn_marked", "packets",
           r".*ecn[-_]marked.*|.*ECN_MARKED.*|np_ecn_marked_roce_packets|rx_prio\d_marked|cc_rx_ce_pkts"),
    # DCQCN: CNPs sent by the receiver's NIC, CNPs acted on by the sender's
    Family("cnp_sent", "packets", r"np_cnp_sent|cc_tx_cnp_pkts"),
    Family("cnp_handled", "packets", r"rp_cnp_handled|cc_rx_cnp_pkts"),
    Family("drops", "packets", r".*discard.*|.*drop.*|.*DROPPED.*|out_of_buffer"),
    Family("tx_bytes", "bytes", r"out-octets|port_xmit_data"),
    Family("rx_bytes", "bytes", r"in-octets|port_rcv_data"),
)
FAMILY_NAMES = tuple(dict.fromkeys(f.name for f in FAMILIES))
_INDEX = {name: i for i, name in enumerate(FAMILY_NAMES)}
_COMPILED = [(re.compile(f.pattern), _INDEX[f.name]) for f in FAMILIES]
# Ports summed at most (a 100,000-GPU fabric has about 250,000): beyond, new ids are refused
# and counted (the ids come from the senders).
MAX_PORTS = 500_000
# ... and at most this many of one source (a switch has ~64-512): one sender inventing ids
# cannot crowd out the others' ports.
MAX_PORTS_PER_SOURCE = 4_096
# Per-second timeline of each switch's pause frames kept for at most this many seconds,
# and this many (switch, second) points in all (~100 B each).
MAX_TIMELINE_S = 86_400
MAX_TIMELINE_POINTS = 500_000


def _weights(names: tuple[str, ...]) -> np.ndarray:
    """[m, F]: 1 where a column belongs to a family."""
    w = np.zeros((len(names), len(FAMILY_NAMES)))
    for j, name in enumerate(names):
        for pattern, family in _COMPILED:
            if pattern.fullmatch(name):
                w[j, family] = 1.0
                break
    return w


@dataclass
class PortTotals:
    """A port's family totals over the window (index by family name)."""

    values: np.ndarray = field(default_factory=lambda: np.zeros(len(FAMILY_NAMES)))

    def __getitem__(self, family: str) -> float:
        return float(self.values[_INDEX[family]])


@dataclass(frozen=True)
class UplinkBalance:
    """A leaf's uplinks over the window: bytes sent on each, and how unequal."""

    leaf: str
    tx_bytes: dict[str, float]          # uplink port -> bytes sent up
    max_over_mean: float                # 1.0 = perfectly even
    coefficient_of_variation: float
    mean_utilisation: float             # of the uplinks' nominal speed, 0..1


class FabricSummary:
    """Totals per (cluster, source, port) of every `FAMILIES` counter, over the batches added."""

    def __init__(self, topology: Topology | None = None, max_ports: int = MAX_PORTS) -> None:
        self.topology = topology
        self.max_ports = max_ports
        self.stats: Counter[str] = Counter()
        self.ports: dict[tuple[str, str, str], PortTotals] = {}
        self.kinds: dict[tuple[str, str], str] = {}          # (cluster, source) -> "node" | "switch"
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        # switch -> {second: pause frames sent in it}: when a storm or an incast happened
        self.pause_timeline: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self._rates = RateTracker()
        self._weights: dict[tuple[str, ...], np.ndarray] = {}
        self._ports_of: Counter[tuple[str, str]] = Counter()     # (cluster, source) -> ports summed
        self._timeline_points = 0

    @property
    def seconds(self) -> float:
        return 0.0 if self.first_ns is None else (self.last_ns - self.first_ns) / 1e9

    def add(self, batch: SourceBatch) -> None:
        """One record's ticks (any source, in event-time order per source)."""
        if len(batch.times_ns) == 0:
            return
        lo, hi = int(batch.times_ns[0]), int(batch.times_ns[-1])
        self.first_ns = lo if self.first_ns is None else min(self.first_ns, lo)
        self.last_ns = hi if self.last_ns is None else max(self.last_ns, hi)
        if len(self.kinds) < self.max_ports or (batch.cluster, batch.source) in self.kinds:
            self.kinds[(batch.cluster, batch.source)] = batch.source_kind
        pause_col = _INDEX["pause_tx_frames"]
        for stack in batch.stacks:
            w = self._weights.get(stack.counter_names)
            if w is None:
                w = self._weights[stack.counter_names] = _weights(stack.counter_names)
            if not w.any() or not self._rates.update_stack(batch.source, stack):
                continue
            done = np.nan_to_num(stack.rates * stack.dt_s[:, None, None])      # [t, n, m], unknown = 0
            per_tick = done @ w                                                   # [t, n, F]
            totals = per_tick.sum(axis=0)                                         # [n, F]
            for i, entity in enumerate(stack.ids):
                key = (batch.cluster, batch.source, entity)
                port = self.ports.get(key)
                if port is None:
                    if len(self.ports) >= self.max_ports or self._ports_of[key[:2]] >= MAX_PORTS_PER_SOURCE:
                        self.stats["ports_refused"] += 1
                        continue
                    self._ports_of[key[:2]] += 1
                    port = self.ports[key] = PortTotals()
                port.values += totals[i]
            if batch.source_kind == "switch" and w[:, pause_col].any():
                line = self.pause_timeline[batch.source]
                for t_ns, frames in zip(stack.times_ns.tolist(), per_tick[:, :, pause_col].sum(axis=1).tolist()):
                    second = t_ns // 1_000_000_000
                    if frames and second not in line:
                        if len(line) >= MAX_TIMELINE_S or self._timeline_points >= MAX_TIMELINE_POINTS:
                            self.stats["timeline_points_refused"] += 1
                            continue
                        self._timeline_points += 1
                    if frames:
                        line[second] += frames

    def by_source(self, kind: str) -> dict[tuple[str, str], PortTotals]:
        """Per (cluster, source) of ``kind`` ("switch" or "node"): the sum over its ports."""
        out: dict[tuple[str, str], PortTotals] = {}
        for (cluster, source, _), port in self.ports.items():
            if self.kinds.get((cluster, source)) == kind:
                out.setdefault((cluster, source), PortTotals()).values += port.values
        return out

    def uplink_balance(self) -> list[UplinkBalance]:
        """Each leaf of the topology with traffic on its spine uplinks, most unequal first."""
        if self.topology is None or not self.seconds:
            return []
        roles = {name: sw.role for name, sw in self.topology.switches.items()}
        uplinks: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for link in self.topology.links:
            for leaf, port, other in ((link.a_switch, link.a_port, link.b_switch),
                                      (link.b_switch, link.b_port, link.a_switch)):
                if roles.get(leaf) == "leaf" and roles.get(other) == "spine":
                    uplinks[leaf].append((port, link.nominal_speed_gbps))
        out = []
        # the clusters a switch reported under (the gateway stamps the token's cluster, which
        # need not be the topology file's name)
        clusters = defaultdict(list)
        for cluster, source in self.kinds:
            clusters[source].append(cluster)
        for leaf, ports in uplinks.items():
            sent = {port: self.ports[(cluster, leaf, port)]["tx_bytes"]
                    for cluster in clusters.get(leaf, ()) for port, _ in ports if (cluster, leaf, port) in self.ports}
            if len(sent) < 2 or not any(sent.values()):
                continue
            values = np.array(list(sent.values()))
            mean = float(values.mean())
            capacity_bytes = sum(speed for port, speed in ports if port in sent) * 1e9 / 8 * self.seconds
            out.append(UplinkBalance(leaf, sent, float(values.max() / mean), float(values.std() / mean),
                                     float(values.sum() / capacity_bytes) if capacity_bytes else 0.0))
        return sorted(out, key=lambda b: -b.coefficient_of_variation)
