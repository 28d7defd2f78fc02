"""ECMP imbalance: a leaf whose uplinks carry persistently unequal traffic (hash polarization).

A leaf spreads the flows it sends to the spines over its uplinks by a hash of each packet's
header fields (ECMP; RFC 2992 analyses the hash-threshold method). RoCE traffic of a
training job is a few large, long flows (NCCL: a handful of channels x queue pairs per
peer), so the hash has little to average over: with ``m`` flows in ``k`` bins some uplinks
carry several flows and others none, and that split lasts as long as the flows (the same
5-tuples hash the same way every time). When the hash also ignores the field that varies
(the RoCE UDP source port) or every tier uses the same hash function and seed (the second
tier sees only the flows the first sent its way, all of which agree on the hash: *hash
polarization*), the leaf runs some uplinks hot and leaves others cold for the whole job.

Reads switch ports' ``out-octets`` rates, ``port_speed_gbps`` and ``oper_up`` / ``admin_up``;
the uplinks of a leaf are its ports whose cable peer (topology) is a spine. Rule, per leaf:

* traffic is summed per uplink over windows of ``WINDOW_S``; a window's utilisation of an
  uplink is its bits over its speed x the window;
* uplinks that are down (``oper_up`` or ``admin_up`` 0) or trained below the cable's nominal
  speed are left out: that is ``link_down`` / ``link_downgrade``, and ECMP with equal
  weights over a slower member legitimately fills it more;
* a window counts only when at least ``MIN_UPLINKS`` uplinks are up and their mean
  utilisation is at least ``MIN_MEAN_UTILISATION`` (an idle leaf's ratios are noise);
* it is *imbalanced* when the hottest uplink carries at least ``MAX_OVER_MEAN`` x the mean
  and at least ``MIN_SPREAD_UTILISATION`` of line rate more than the coldest;
* ``ecmp_imbalance`` opens after ``OPEN_WINDOWS`` imbalanced windows in a row **with at
  least one uplink hot** (``HOT_OVER_MEAN``) **in every one of them**: polarization is
  static; ECMP jitter from flows that come and go, flowlets or adaptive routing moves the hot
  spot, and a spot that moves on within about two windows is never hot three times. It resolves
  after ``RESOLVE_WINDOWS`` windows in a row that are not imbalanced.

Evidence: max/mean and the coefficient of variation across the uplinks, the hot and the cold
uplinks with their utilisation. Hint: add entropy to the hash (hash on the RoCE UDP source
port, more queue pairs per connection), change the hash seed or polynomial, or enable
adaptive routing.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> from fabricwatch.models.topology import rail_optimised
>>> topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=2, n_spines=4)
>>> ups = ("Ethernet2", "Ethernet3", "Ethernet4", "Ethernet5")
>>> def tick(t_s, gbps):
...     f = EntityFrame("switch_port", ups, ("out-octets",), np.zeros((4, 1), np.uint64),
...                     ("port_speed_gbps", "oper_up"), np.array([[400.0, 1.0]] * 4), {})
...     f.rates, f.dt_s = np.array(gbps, float)[:, None] * 1e9 / 8, 1.0
...     return SourceView("c1", "leaf-u0-r0", "switch", int(t_s * 1e9), 0, [f])
>>> det = EcmpImbalanceDetector(topo)
>>> out = [f for t in range(45) for f in det.update(tick(t, [300, 290, 40, 50]))]
>>> [(f.kind, f.state, f.entity.path()) for f in out]
[('ecmp_imbalance', 'open', 'c1/leaf-u0-r0')]
>>> out[0].summary
'leaf-u0-r0 uplinks unbalanced for 30 s: Ethernet2, Ethernet3 hot (75%, 72%), Ethernet4, Ethernet5 cold (10%, 12%)'
>>> [f.state for t in range(45, 90) for f in det.update(tick(t, [170, 170, 170, 170]))]
['resolved']
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector, PerTick
from .findings import OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from .frames import SWITCH_PORT, EntityFrame, LayoutGroup, SourceView
from .topology import Topology
from .vocabulary import ECMP_IMBALANCE, ECMP_POLARIZATION

DETECTOR = "ecmp_imbalance/v1"
KIND = ECMP_IMBALANCE
# Window over which traffic is summed per uplink: many training steps (a step's all-reduce
# bursts last tens to hundreds of ms), so the ratio compares what the hash sends each way,
# not where the current burst happens to be.
WINDOW_S = 10.0
# Up uplinks needed to speak of a balance at all.
MIN_UPLINKS = 2
# Mean utilisation of the up uplinks below which a window says nothing: 2 % of line rate
# (8 Gb/s on 400G: an idle leaf carries control traffic and trickles whose ratios are noise).
MIN_MEAN_UTILISATION = 0.02
# Hottest uplink over the mean: 1.5 x. Random hashing of m equal flows into k bins puts
# about m/k + sqrt(2 (m/k) ln k) flows in the fullest bin (balls into bins); for a leaf with
# tens of flows per uplink (NCCL's channels x QPs of a large job) that is <= 1.4 x the mean,
# so 1.5 x is beyond what a working hash does with a realistic flow count. Fewer flows than
# that is itself the problem the hint addresses (more QPs per connection).
MAX_OVER_MEAN = 1.5
# ... and the hottest uplink carries at least 5 % of line rate more than the coldest (20 Gb/s
# on 400G, a few NCCL channels' worth): a ratio on a trickle moves no job's step time.
MIN_SPREAD_UTILISATION = 0.05
# Imbalanced windows in a row, the hot spot staying put, before it opens (30 s): ECMP
# jitter (flows starting and ending, flowlet switching, adaptive routing) moves the hot spot;
# polarization keeps it where the hash put it.
OPEN_WINDOWS = 3
# Windows in a row that are not imbalanced (balanced, or idle) before it resolves.
RESOLVE_WINDOWS = 3
# A port counts as hot above this x the mean, as cold below this fraction of the mean.
HOT_OVER_MEAN = 1.25
COLD_UNDER_MEAN = 0.75
# Samples further apart than this (a silent switch) restart the window.
MAX_SAMPLE_GAP_S = 30.0
# A port trained below this fraction of its cable's nominal speed is downgraded, not hashed to.
DOWNGRADED_SPEED_FRACTION = 0.99


@dataclass
class _Leaf:
    ids: tuple[str, ...]
    uplinks: np.ndarray                 # indices into ids
    nominal_gbps: np.ndarray            # per uplink, from the topology
    speed_gbps: np.ndarray              # last read per uplink
    usable: np.ndarray                  # last read: up and at nominal speed
    bits: np.ndarray                    # this window, per uplink
    seconds: np.ndarray                 # this window, per uplink (seconds with a rate)
    window_start_ns: int
    last_ns: int
    streak: int = 0
    hot: frozenset = frozenset()        # the uplinks hot in every window of the streak
    quiet: int = 0
    finding: Finding | None = None


@dataclass
class EcmpImbalanceDetector(PerTick, Detector):
    """Per leaf: uplink utilisation per window, imbalance that persists. Needs the topology."""
    topology: Topology | None = None
    window_s: float = WINDOW_S
    _leaves: dict[str, _Leaf] = field(default_factory=dict, repr=False)
    stats: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")

    def reads(self, kind, counter_names, gauge_names, label_names) -> bool:
        return kind == SWITCH_PORT and "out-octets" in counter_names and self.topology is not None

    def screen(self, group: LayoutGroup) -> None:
        """Nothing to share across records: every switch tick adds to its leaf's window."""

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        for frame in view.frames:
            if frame.kind == SWITCH_PORT and frame.column("out-octets") is not None:
                out += self._tick(view, frame)
        return out

    def _leaf(self, view: SourceView, frame: EntityFrame) -> _Leaf | None:
        leaf = self._leaves.get(view.source)
        if leaf is not None and leaf.ids == frame.ids:
            return leaf
        topo = self.topology
        ups, nominal = [], []
        for i, port in enumerate(frame.ids):
            peer = topo.peer_of(view.source, port)
            sw = topo.switches.get(peer.switch) if peer is not None and peer.switch else None
            if sw is not None and sw.role == "spine":
                ups.append(i)
                nominal.append(next((lk.nominal_speed_gbps for lk in topo.links
                                     if (lk.a_switch, lk.a_port) == (view.source, port)
                                     or (lk.b_switch, lk.b_port) == (view.source, port)), 0.0))
        if len(ups) < MIN_UPLINKS:
            self._leaves.pop(view.source, None)
            return None
        n = len(ups)
        nom = np.array(nominal, float)
        leaf = self._leaves[view.source] = _Leaf(frame.ids, np.array(ups), nom, nom.copy(), np.ones(n, bool),
                                                 np.zeros(n), np.zeros(n), view.time_ns, view.time_ns)
        return leaf

    def _tick(self, view: SourceView, frame: EntityFrame) -> list[Finding]:
        leaf = self._leaf(view, frame)
        if leaf is None:
            return []
        u = leaf.uplinks
        if view.time_ns - leaf.last_ns > MAX_SAMPLE_GAP_S * 1e9:
            self._restart(leaf, view.time_ns)
        leaf.last_ns = view.time_ns
        speed = frame.gauge("port_speed_gbps")[u]
        leaf.speed_gbps = np.where(np.isfinite(speed) & (speed > 0), speed, leaf.speed_gbps)
        oper, admin = frame.gauge("oper_up")[u], frame.gauge("admin_up")[u]
        read = np.isfinite(oper) | np.isfinite(admin)
        down = (oper == 0) | (admin == 0)
        leaf.usable = np.where(read, ~down, leaf.usable)
        rate = frame.rate("out-octets")[u] * 8.0      # bits/s
        dt = float(frame.dt_s) if np.isfinite(frame.dt_s) else 0.0
        ok = np.isfinite(rate) & (dt > 0)
        leaf.bits += np.where(ok, rate * dt, 0.0)
        leaf.seconds += np.where(ok, dt, 0.0)
        if view.time_ns - leaf.window_start_ns < self.window_s * 1e9:
            return []
        found = self._judge(view, leaf)
        self._restart(leaf, view.time_ns)
        return found

    @staticmethod
    def _restart(leaf: _Leaf, now_ns: int) -> None:
        leaf.bits[:] = 0.0
        leaf.seconds[:] = 0.0
        leaf.window_start_ns = now_ns

    def _judge(self, view: SourceView, leaf: _Leaf) -> list[Finding]:
        usable = (leaf.usable & (leaf.seconds > 0)
                  & (leaf.speed_gbps >= DOWNGRADED_SPEED_FRACTION * np.where(leaf.nominal_gbps > 0,
                                                                              leaf.nominal_gbps, 0.0)))
        idx = np.flatnonzero(usable)
        imbalanced = False
        util = np.full(len(leaf.uplinks), np.nan)
        if len(idx) >= MIN_UPLINKS:
            util[idx] = leaf.bits[idx] / (leaf.speed_gbps[idx] * 1e9 * leaf.seconds[idx])
            m = float(np.mean(util[idx]))
            if m >= MIN_MEAN_UTILISATION:
                top, bottom = float(np.max(util[idx])), float(np.min(util[idx]))
                imbalanced = top >= MAX_OVER_MEAN * m and top - bottom >= MIN_SPREAD_UTILISATION
        if not imbalanced:
            leaf.streak, leaf.hot = 0, frozenset()
            if leaf.finding is None:
                return []
            leaf.quiet += 1
            if leaf.quiet < RESOLVE_WINDOWS:
                return []
            f, leaf.finding, leaf.quiet = leaf.finding, None, 0
            return [Finding(**{**f.__dict__, "state": RESOLVED, "detected_ns": view.time_ns,
                               "evidence": list(f.evidence), "related": list(f.related),
                               "summary": f"resolved: {f.summary}; balanced for {RESOLVE_WINDOWS} windows"})]
        leaf.quiet = 0
        m = float(np.mean(util[idx]))
        hot = frozenset(leaf.ids[int(leaf.uplinks[i])] for i in idx if util[i] >= HOT_OVER_MEAN * m)
        if hot & leaf.hot:               # some uplink hot in every window of the streak
            leaf.streak, leaf.hot = leaf.streak + 1, hot & leaf.hot
        else:
            leaf.streak, leaf.hot = 1, hot
        if leaf.finding is not None or leaf.streak < OPEN_WINDOWS:
            return []
        leaf.finding = self._open(view, leaf, idx, util)
        return [leaf.finding]

    def _open(self, view: SourceView, leaf: _Leaf, idx: np.ndarray, util: np.ndarray) -> Finding:
        u = util[idx]
        m = float(np.mean(u))
        cv = float(np.std(u) / m)
        names = [leaf.ids[int(leaf.uplinks[i])] for i in idx]
        order = np.argsort(-u, kind="stable")
        hot = [(names[k], float(u[k])) for k in order if u[k] >= HOT_OVER_MEAN * m]
        cold = [(names[k], float(u[k])) for k in order[::-1] if u[k] <= COLD_UNDER_MEAN * m][::-1]
        cold = sorted(cold, key=lambda p: p[0]) if cold else [(names[int(order[-1])], float(u[order[-1]]))]
        hot = sorted(hot, key=lambda p: p[0])

        def fmt(ports):
            return ", ".join(p for p, _ in ports), ", ".join(f"{x:.0%}" for _, x in ports)
        spines = {}
        for p, _ in hot + cold:
            peer = self.topology.peer_of(view.source, p)
            spines[p] = peer
        related = [EntityRef(cluster=view.cluster, switch=view.source, port=p) for p, _ in hot + cold]
        related += [EntityRef(cluster=view.cluster, switch=peer.switch, port=peer.port)
                    for p, peer in spines.items() if peer is not None]
        persisted_s = OPEN_WINDOWS * self.window_s
        hot_s = ", ".join(p for p, _ in hot)
        cold_s = ", ".join(p for p, _ in cold)
        return Finding(
            KIND, OPEN, EntityRef(cluster=view.cluster, switch=view.source), WARNING,
            onset_ns=view.time_ns - int(persisted_s * 1e9), detected_ns=view.time_ns,
            evidence=[Evidence("max_over_mean", round(float(np.max(u)) / m, 3), MAX_OVER_MEAN, "x",
                               f"hottest uplink over the mean of {len(idx)} up uplinks"),
                      Evidence("coefficient_of_variation", round(cv, 3), 0.0, "ratio",
                               "std / mean of the uplinks' utilisation"),
                      Evidence("mean_utilisation", round(m, 4), MIN_MEAN_UTILISATION, "ratio",
                               f"mean of the up uplinks over the last {self.window_s:g} s window"),
                      Evidence("windows_imbalanced", float(leaf.streak), OPEN_WINDOWS, "windows",
                               f"{self.window_s:g} s windows in a row with {', '.join(sorted(leaf.hot))} hot in each"),
                      *[Evidence(f"utilisation:{p}", round(x, 4), m, "ratio",
                                 f"{'hot' if x > m else 'cold'} uplink to {spines[p].switch if spines[p] else '?'}")
                        for p, x in hot + cold]],
            probable_cause=("ECMP hash polarization: the leaf's hash sends the few large RoCE flows to some "
                            "uplinks and not others (too little entropy in the hashed fields, or the same hash "
                            "and seed as the tier before)"),
            cause=ECMP_POLARIZATION,
            suggested_action=(f"add entropy to the ECMP hash on {view.source} (hash on the RoCE UDP source port; "
                              f"per-QP source ports: NCCL_IB_QPS_PER_CONNECTION>1), change the hash seed or "
                              f"polynomial, or enable adaptive routing; hot uplinks {hot_s}, cold {cold_s}"),
            summary=(f"{view.source} uplinks unbalanced for {persisted_s:.0f} s: {fmt(hot)[0]} hot ({fmt(hot)[1]}), "
                     f"{fmt(cold)[0]} cold ({fmt(cold)[1]})"),
            detector=DETECTOR, related=related)
