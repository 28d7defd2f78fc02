"""Scenario suites for `fabricwatch eval`, as data.

A `Scenario` is everything needed to regenerate one labelled telemetry run: the fabric
size, the sampling interval, the duration, the seed and the injected faults (times in
seconds after the simulator start, as `fabricwatch.simulator.timeline` defines them). The
simulator reports each fault as a `GroundTruth` record (source entity, victims, onset,
offset, ``expect_alert``), which `matching` scores detector output against.

Suites (``suite`` field):

* ``fault_mix`` (1 s sampling, 8 nodes): the real fault mix, two rounds of six faults on
  distinct entities per scenario: NIC link speed/lanes low, NIC and GPU PCIe width,
  cable link-down (flaps), hardware GPU XIDs (48/63/64/74/79/92/94/95/119/120, half of them
  followed by XID 45 on 1-7 sibling GPUs), uncorrectable ECC errors; plus one buggy job's
  application XIDs (13/31/43, must not fire) per round.
* ``straggler`` (1 s, 8 nodes): one slow rank per multi-node job, from thermal, software
  thermal or power capping, an invisible cause (slow data loader), a downgraded NIC, the
  NIC's or the GPU's PCIe link at x8, a partial PFC pause on its NIC, or its NIC dead with
  NCCL on a sibling (at least 3 of each).
* ``pfc_storm`` (0.1 s, 4 nodes): the sonic-mgmt pfcwd test plan: single-port storms during
  traffic, two-port (same and different leaf), all-port storms (a source on an idle node
  there holds nothing: not expected), a storm ended by the NIC's own watchdog, switch-port
  storms towards a busy NIC whose ``port_xmit_wait`` is pinned at 2^32-1 (with and without
  the switch's TX pause duration), a storm whose victims' ``port_xmit_wait`` are all
  pinned; every scenario also pins ~10 % of the NICs' ``port_xmit_wait`` (the simulator's
  default quirk). PFC needs 0.1 s sampling so that the 200 ms
  detection time can be judged. Plus one two-port storm of 100 s at 1 s sampling (8 nodes),
  long enough for a ``for: 1m`` rule.
* ``link_down`` (1 s, 8 nodes): links that die and stay down for minutes: a NIC link with NCCL
  failing over to its sibling NIC, one without (the job hangs), one that shows uncorrectable
  FEC errors first, one that comes back; a leaf uplink; plus, in the same runs, an operator
  shutting a leaf port (90 s) and a NIC on its host (80 s), which must not fire as link faults
  (a job behind them hangs: that is a labelled ``hang``).
* ``hang`` (1 s, 8 nodes): one rank holds up its job's collective, by root: a stuck process
  (alive, never enters the next collective), a dead one (heartbeats stop), its GPU lost (XID
  79: also a ``gpu_xid``), its NIC link down without NCCL failover (also a ``link_down``); in the
  same run another job stalls without hanging (a long checkpoint with every rank idle, a job
  paused by its scheduler, a long step whose small collectives keep completing: must not fire).
  The hangs that other suites' faults cause (a NIC link down without failover, an operator
  shutting a busy NIC's leaf port for minutes, a long storm from a stuck host) are labelled too.
* ``*-cadence`` (in their suites): three fault-mix, two straggler, two dead-link and two hang
  scenarios again at the node collector's real cadence (PFC-only ticks every 100 ms between
  full snapshots every second): a tick without a column must say nothing about it.
* ``must_not_fire``: storms shorter than T_detect, the NIC watchdog ending a storm after
  100 ms, XON floods (5 s; 110 s), pauses with nothing queued (an idle node's NIC pausing
  its leaf, a leaf port pausing an idle node: sonic-mgmt ``test_pfcwd_no_traffic``), admin port
  toggles (leaf port facing a NIC, leaf uplink), a node reboot, clock skew, application XIDs of
  buggy user code (0.1 s or 1 s sampling as fits).
* ``ecmp_imbalance`` (1 s, 12 nodes in three units of 4, 4 spines, leaves spreading their spine
  traffic evenly with per-tick jitter): two polarized leaves per scenario (one or two hot
  uplinks of four); labelled negatives in the same runs: a polarization shorter than the
  detector's persistence, a hot spot that moves every 10 s (flowlets / adaptive routing), an
  operator shutting an uplink (90 s), and a polarized leaf that sends nothing to the spines.
* ``pfc_deadlock`` (0.1 s, 8 nodes in two units, 4 spines): two pause loops per scenario (a
  down-up loop through two leaves and two spines, a leaf-spine loop), for 3-10 s; labelled
  negatives: a transient loop shorter than the hold, an ordinary storm from a stuck NIC (a
  tree of pauses with a source), SONiC's TX pause duration exported or not.
* ``congestion`` (1 s, 8 nodes, 8 leaves): a leaf whose ECN marking thresholds sit above
  XOFF (pauses under incast with 0, 1 or 5 % of the marks; with its own incast episodes or a
  forced heavy incast), a leaf port dropping on lossless queue 3, a NIC discarding on
  lossless priority 3 (``rx_prio3_buf_discard``); labelled negatives in the same
  runs: heavy healthy incast on another leaf (marks first), a misordered leaf with no incast
  at all (nothing pauses: invisible), drops on lossy queue 0, a NIC link that flaps
  behind a leaf port (its queues and the NIC lose the frames in flight: a link event, not
  the buffers),
  and in every fourth run (240 s) a leaf port storming a busy NIC for ~65 s at the end
  (one port's pauses without marks: a ``pfc_storm``, not incast).
* ``healthy``: long noisy healthy runs for the false-alarm rate, sized in node-hours; one
  busy node in eight runs buggy code that throws application XIDs every 1-4 minutes.

Every scenario has its own seed (job placement, noise), entities are drawn per seed.

>>> suites = build_suites(SuiteConfig(quick=True))
>>> sorted({s.suite for s in suites})
['fault_mix', 'healthy', 'must_not_fire', 'pfc_storm']
>>> full = build_suites(SuiteConfig(healthy_node_hours=1.0))
>>> counts = expected_case_counts(full)
>>> all(counts[c] >= 20 for c in ("link_downgrade", "pcie_downgrade", "link_flap", "pfc_storm",
...                               "straggler", "gpu_xid", "gpu_ecc_uncorrectable", "link_down", "hang"))
True
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fabricwatch.models.topology import Topology, rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator, Fault
from fabricwatch.simulator.encoding import Cadence
from fabricwatch.simulator.fabric_faults import (
    STORM_DETECTION_TIME_S, AdminToggle, EcmpPolarization, EcnAfterPause, Incast, LinkDown, LinkDowngrade, LinkFlap,
    NicAdminDown, NicLosslessDrops, NicPcieDowngrade, PfcDeadlock, PfcStorm, PinnedCounter, QueueDrops, SwitchLinkDown,
    SwitchPfcStorm,
)
from fabricwatch.simulator.host_faults import (
    ApplicationXid, CheckpointStall, ClockSkew, EccUncorrectable, GpuPcieDowngrade, GpuXid, JobPause, LongStep,
    NodeReboot, RankLost, RankStuck, Straggler, XidCascade,
)
from fabricwatch.simulator.timeline import DEFAULT_START_UNIX_NS, INF
from fabricwatch.simulator.workload import Job, auto_jobs

__all__ = ["Scenario", "SuiteConfig", "build_suites", "expected_case_counts", "fault_class", "T_DETECT_S",
           "FAULT_CLASSES"]

T_DETECT_S = STORM_DETECTION_TIME_S   # SONiC pfcwd DEFAULT_DETECTION_TIME (200 ms)
GPUS = 8

# Ground-truth kind -> the fault class it is scored under.
_CLASS_OF_GT_KIND = {
    "link_downgrade": "link_downgrade",
    "nic_pcie_downgrade": "pcie_downgrade",
    "gpu_pcie_downgrade": "pcie_downgrade",
    "link_flap": "link_flap",
    "pfc_storm": "pfc_storm",
    "straggler": "straggler",
    "gpu_xid": "gpu_xid",
    "ecc_uncorrectable": "gpu_ecc_uncorrectable",
    "link_down": "link_down",
    "ecmp_imbalance": "ecmp_imbalance",
    "pfc_deadlock": "pfc_deadlock",
    "ecn_pfc_misorder": "ecn_pfc_misorder",
    "lossless_drop": "lossless_drop",
    "hang": "hang",
}
FAULT_CLASSES = ("link_downgrade", "pcie_downgrade", "link_flap", "pfc_storm", "straggler", "gpu_xid",
                 "gpu_ecc_uncorrectable", "link_down", "ecmp_imbalance", "pfc_deadlock")
FAULT_CLASSES += ("ecn_pfc_misorder", "lossless_drop")       # congestion tuning (issue 15)
FAULT_CLASSES += ("hang",)

DOWNGRADE_RATES = ("200 Gb/sec (4X HDR)", "100 Gb/sec (4X EDR)", "400 Gb/sec (8X HDR)", "200 Gb/sec (2X NDR)")
# Hardware and firmware XIDs of NVIDIA's catalog (`fabricwatch.xid`): the gpu_xid cases.
XID_CODES = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
# Application XIDs of user bugs (must not fire): 13 illegal instruction / exception, 31 MMU
# page fault (illegal address), 43 the driver stopped a killed context.
APP_XID_CODES = (13, 31, 43)
# Half the fault-mix XIDs cascade: XID 45 on 1-7 sibling GPUs 0.1-3 s after the root.
CASCADE_FRACTION = 0.5
# Not "storm_victim": the simulator's storm next door has a stuck host, which hangs the source's
# job and pauses the victim's almost completely, so no step of the slow rank ever completes.
STRAGGLER_CAUSES = ("thermal", "power", "none", "nic_downgrade", "sw_thermal", "nic_pcie", "partial_pause",
                    "gpu_pcie", "nic_down")


def fault_class(gt_kind: str) -> str | None:
    """The scored fault class of a ground-truth kind; None for kinds that only must-not-fire."""
    return _CLASS_OF_GT_KIND.get(gt_kind)


@dataclass(frozen=True)
class Scenario:
    """One labelled run: a rail-optimised fabric, a sampling interval, faults, a seed."""
    name: str
    suite: str
    seed: int
    n_nodes: int
    interval_s: float
    duration_s: float
    faults: tuple = ()
    nodes_per_unit: int = 0       # 0: all nodes in one unit (up to 32)
    n_spines: int = 2
    note: str = ""
    switch_tx_pause_duration: bool = False   # switches export pfc<p>-tx-pause-duration-us (SONiC)
    # 0: every tick is a full snapshot, every `interval_s`. > 0: the collectors' cadence,
    # PFC-only ticks every `pfc_interval_s` between full snapshots every `interval_s`.
    pfc_interval_s: float = 0.0
    ecmp_spread: bool = True    # leaves spread their spine traffic over every spine (`ClusterSimulator`)

    def topology(self) -> Topology:
        return _topology(self.n_nodes, self.nodes_per_unit or min(32, self.n_nodes), self.n_spines)

    def simulator(self) -> ClusterSimulator:
        cadence = Cadence(self.pfc_interval_s, self.interval_s) if self.pfc_interval_s else None
        return ClusterSimulator(self.topology(), seed=self.seed, interval_s=self.tick_s, cadence=cadence,
                                faults=list(self.faults), switch_tx_pause_duration=self.switch_tx_pause_duration,
                                ecmp_spread=self.ecmp_spread)

    @property
    def tick_s(self) -> float:
        """Time between two ticks of the simulator (the fastest collector interval)."""
        return self.pfc_interval_s or self.interval_s

    @property
    def simulator_start_ns(self) -> int:
        return DEFAULT_START_UNIX_NS

    @property
    def ticks(self) -> int:
        return int(round(self.duration_s / self.tick_s))

    @property
    def node_hours(self) -> float:
        return self.n_nodes * self.duration_s / 3600.0

    def describe_faults(self) -> str:
        return "; ".join(_describe(f) for f in self.faults) or "none"


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of the suites. The defaults finish `fabricwatch eval` in ~10 min on 2 cores."""
    quick: bool = False
    seed: int = 0
    mix_scenarios: int = 12          # x 2 rounds: 24 cases of each fault-mix class
    link_down_scenarios: int = 14    # one dead NIC link each, a dead uplink every other: 21 cases
    straggler_scenarios: int = 14    # 1-2 stragglers each (one per multi-node job): >= 3 per cause
    cadence_mix_scenarios: int = 3   # the same kinds of scenario again at the collectors' cadence
    cadence_straggler_scenarios: int = 2
    cadence_link_down_scenarios: int = 2
    hang_scenarios: int = 16         # one hang each (4 per root), a job stall that is no hang on another job
    cadence_hang_scenarios: int = 2
    storm_pair_scenarios: int = 6    # x 2 sequential single-port storms
    healthy_node_hours: float = 8.0  # long healthy runs (1 s sampling) for false alarms
    healthy_nodes: int = 32
    healthy_run_s: float = 300.0     # each healthy run; runs = ceil(node-hours / (nodes x run))
    healthy_fast_s: float = 60.0     # one healthy run at 0.1 s sampling (storm false alarms)
    ecmp_scenarios: int = 12         # x 2 polarized leaves: 24 cases
    deadlock_scenarios: int = 10     # x 2 pause loops: 20 cases
    congestion_scenarios: int = 20   # one misordered leaf and one lossless-drop port each: 20 cases of each


@lru_cache(maxsize=64)
def _topology(n_nodes: int, nodes_per_unit: int, n_spines: int) -> Topology:
    return rail_optimised("eval", n_nodes=n_nodes, nodes_per_unit=nodes_per_unit, n_spines=n_spines)


def _jobs(topo: Topology, seed: int) -> tuple[list[Job], list[str], list[str]]:
    """Jobs as the simulator will place them, nodes of multi-node jobs, nodes with no job."""
    jobs = auto_jobs(topo, seed)
    busy = [n for j in jobs if len(j.nodes) >= 2 for n in j.nodes]
    in_job = {n for j in jobs for n in j.nodes}
    idle = [n for n in topo.nodes if n not in in_job]
    return jobs, busy, idle


def _frac(rng, lo: float, hi: float, interval_s: float) -> float:
    """An onset in [lo, hi) that is not on a sampling instant (so delay < one interval is possible)."""
    t = float(rng.uniform(lo, hi))
    k = round(t / interval_s)
    if abs(t - k * interval_s) < 0.05 * interval_s:
        t += 0.37 * interval_s
    return round(t, 3)


def _nic(k: int) -> str:
    return f"mlx5_{k}/1"


# --------------------------------------------------------------------------- fault mix


def _fault_mix(i: int, seed: int, n_nodes: int = 8, duration_s: float = 100.0, rounds=(15.0, 57.0)) -> Scenario:
    topo = _topology(n_nodes, n_nodes, 2)
    _, busy, _ = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0xF1])
    rng_x = np.random.default_rng([seed, 0xF1, 0x45])   # XID cascades and user bugs (leaves the rest as it was)
    used_nic: set[tuple[str, int]] = set()
    used_gpu: set[tuple[str, int]] = set()
    faults: list[Fault] = []

    def free_nic(node: str) -> int:
        k = int(rng.integers(GPUS))
        while (node, k) in used_nic:
            k = (k + 1) % GPUS
        used_nic.add((node, k))
        return k

    def free_gpu(node: str) -> int:
        g = int(rng.integers(GPUS))
        while (node, g) in used_gpu:
            g = (g + 1) % GPUS
        used_gpu.add((node, g))
        return g

    for r, base in enumerate(rounds):
        gpu_pcie_node = busy[int(rng.integers(len(busy)))]   # visible while busy: a node that runs a job
        others = [n for n in rng.permutation(topo.nodes).tolist() if n != gpu_pcie_node][:5]
        dn, pn, fn, xn, en = others
        t = _frac(rng, base, base + 8, 1.0)
        off = INF if rng.random() < 0.5 else round(t + float(rng.uniform(15, 30)), 3)
        faults.append(LinkDowngrade(dn, _nic(free_nic(dn)), onset_s=t, offset_s=off,
                                    rate=DOWNGRADE_RATES[(i * 2 + r) % len(DOWNGRADE_RATES)]))
        t = _frac(rng, base, base + 8, 1.0)
        faults.append(NicPcieDowngrade(pn, _nic(free_nic(pn)), onset_s=t, width=int(rng.choice([8, 4]))))
        t = _frac(rng, base, base + 8, 1.0)
        faults.append(GpuPcieDowngrade(gpu_pcie_node, free_gpu(gpu_pcie_node), onset_s=t,
                                       width=int(rng.choice([8, 4]))))
        t = _frac(rng, base, base + 8, 1.0)
        down = round(float(rng.uniform(1.0, 5.0)), 2)
        flaps = int(rng.integers(1, 4))
        faults.append(LinkFlap(fn, _nic(free_nic(fn)), onset_s=t, down_s=down, flaps=flaps,
                               period_s=max(8.0, down + 3.0)))
        t = _frac(rng, base, base + 8, 1.0)
        code = XID_CODES[(i * 2 + r) % len(XID_CODES)]
        g = free_gpu(xn)
        if code == 79:
            kw = dict(offset_s=round(t + 15.0, 3))
        elif rng.random() < 0.3:
            kw = dict(repeat_s=5.0, offset_s=round(t + 20.0, 3))
        else:
            kw = {}
        if rng_x.random() < CASCADE_FRACTION:
            faults.append(XidCascade(xn, g, code, onset_s=t, **kw, **_cascade(rng_x, g)))
        else:
            faults.append(GpuXid(xn, g, code, onset_s=t, **kw))
        faults.append(_app_xid(rng_x, busy[int(rng_x.integers(len(busy)))], base, 1.0,
                               APP_XID_CODES[(i + r) % len(APP_XID_CODES)]))
        t = _frac(rng, base, base + 8, 1.0)
        faults.append(EccUncorrectable(en, free_gpu(en), onset_s=t, count=int(rng.integers(1, 4))))
    return Scenario(f"mix-{i:02d}", "fault_mix", seed, n_nodes, 1.0, duration_s, tuple(faults),
                    note="real fault mix, two rounds of six faults on distinct entities")


def _cascade(rng, root: int) -> dict:
    """1-7 sibling GPUs that log XID 45 0.1-3 s after the root XID (the driver's cleanup)."""
    others = [g for g in range(GPUS) if g != root]
    k = int(rng.integers(1, GPUS))
    victims = tuple(sorted(int(g) for g in rng.choice(others, k, replace=False)))
    delays = tuple(round(float(d), 3) for d in rng.uniform(0.1, 3.0, k))
    return {"victims": victims, "delays_s": delays}


def _app_xid(rng, node: str, lo_s: float, interval_s: float, code: int, bursts: int = 1,
             period_s: float = 180.0, crash: bool = False) -> ApplicationXid:
    """A buggy job's XID ``code`` on 1-8 of its GPUs of ``node``, then XID 45 on some of the rest."""
    n = int(rng.integers(1, GPUS + 1))
    gpus = tuple(sorted(int(g) for g in rng.choice(GPUS, n, replace=False)))
    rest = [g for g in range(GPUS) if g not in gpus]
    cleanup = tuple(sorted(int(g) for g in rng.choice(rest, int(rng.integers(0, len(rest) + 1)), replace=False))) \
        if rest else ()
    return ApplicationXid(node, gpus, onset_s=_frac(rng, lo_s, lo_s + 8, interval_s), code=code, bursts=bursts,
                          period_s=period_s, cleanup=cleanup, cleanup_delay_s=round(float(rng.uniform(0.05, 2.0)), 3),
                          crash=crash)


# --------------------------------------------------------------------------- stragglers


def _stragglers(i: int, seed: int, n_nodes: int = 8, duration_s: float = 100.0) -> Scenario:
    topo = _topology(n_nodes, n_nodes, 2)
    jobs, _, _ = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0x57])
    faults: list[Fault] = []
    multi = [j for j in jobs if len(j.nodes) >= 2][:2]
    for k, job in enumerate(multi):
        cause = STRAGGLER_CAUSES[(2 * i + k) % len(STRAGGLER_CAUSES)]
        node = job.nodes[int(rng.integers(len(job.nodes)))]
        t = _frac(rng, 35.0 + 12 * k, 45.0 + 12 * k, 1.0)
        factor = round(float(rng.uniform(1.2, 2.0)), 2)
        faults.append(Straggler(node, int(rng.integers(GPUS)), onset_s=t, factor=factor, cause=cause))
    return Scenario(f"straggler-{i:02d}", "straggler", seed, n_nodes, 1.0, duration_s, tuple(faults),
                    note="one slow rank per multi-node job")


# --------------------------------------------------------------------------- PFC storms (0.1 s)

STORM_NODES = 4   # one unit: every leaf has one port per node, so a storm has victims on its leaf


def _storm_cluster(seed: int):
    topo = _topology(STORM_NODES, STORM_NODES, 2)
    _, busy, idle = _jobs(topo, seed)
    return topo, busy, idle


def _storm_pair(i: int, seed: int) -> Scenario:
    _, busy, _ = _storm_cluster(seed)
    rng = np.random.default_rng([seed, 0x5A])
    t1 = _frac(rng, 2.0, 3.0, 0.1)
    d1 = round(float(rng.uniform(3.0, 5.0)), 2)
    t2 = _frac(rng, t1 + d1 + 3.0, t1 + d1 + 4.0, 0.1)
    d2 = round(float(rng.uniform(3.0, 5.0)), 2)
    a, b = busy[int(rng.integers(len(busy)))], busy[int(rng.integers(len(busy)))]
    ra, rb = int(rng.integers(GPUS)), int(rng.integers(GPUS))
    faults = (PfcStorm(((a, _nic(ra)),), onset_s=t1, offset_s=round(t1 + d1, 3)),
              PfcStorm(((b, _nic(rb)),), onset_s=t2, offset_s=round(t2 + d2, 3)))
    return Scenario(f"storm-single-{i:02d}", "pfc_storm", seed, STORM_NODES, 0.1, math.ceil(t2 + d2 + 3.0),
                    faults, nodes_per_unit=STORM_NODES,
                    note="single-port storm during traffic (stuck host), twice, on random busy ports")


def _storm_multi(kind: str, i: int, seed: int) -> Scenario:
    topo, busy, idle = _storm_cluster(seed)
    rng = np.random.default_rng([seed, 0x5B, i])
    t = _frac(rng, 2.0, 3.0, 0.1)
    d = round(float(rng.uniform(3.0, 5.0)), 2)
    rail = int(rng.integers(GPUS))
    duration = math.ceil(t + d + 3.0)
    if kind == "two-port-same-leaf":
        a, b = (busy[j] for j in rng.choice(len(busy), 2, replace=False))
        sources = ((a, _nic(rail)), (b, _nic(rail)))
        note = "two-port storm, both ports on the same leaf"
    elif kind == "two-port-diff-leaf":
        a, b = (busy[j] for j in rng.choice(len(busy), 2, replace=False))
        rb = (rail + 1 + int(rng.integers(GPUS - 1))) % GPUS
        sources = ((a, _nic(rail)), (b, _nic(rb)))
        note = "two-port storm, ports on different leaves"
    elif kind == "all-port":
        sources = tuple((n, _nic(rail)) for n in topo.nodes)
        note = "all-port storm: every NIC port of one leaf"
    elif kind in ("switch-port", "switch-port-tx"):
        node = busy[int(rng.integers(len(busy)))]
        lp = topo.nic(node, _nic(rail))
        faults = (SwitchPfcStorm(lp.switch, lp.switch_port, onset_s=t, offset_s=round(t + d, 3)),
                  PinnedCounter(node, _nic(rail)))
        tx = kind == "switch-port-tx"
        return Scenario(f"storm-{kind}-{i:02d}", "pfc_storm", seed, STORM_NODES, 0.1, duration, faults,
                        nodes_per_unit=STORM_NODES, switch_tx_pause_duration=tx,
                        note="a leaf port pauses a busy NIC whose port_xmit_wait is pinned at 2^32-1"
                             + ("; the switch exports its TX pause duration" if tx else ""))
    elif kind == "pinned-victims":
        node = busy[int(rng.integers(len(busy)))]
        sources = ((node, _nic(rail)),)
        pins = tuple(PinnedCounter(n, _nic(rail)) for n in topo.nodes if n != node)
        fault = PfcStorm(sources, onset_s=t, offset_s=round(t + d, 3))
        return Scenario(f"storm-{kind}-{i:02d}", "pfc_storm", seed, STORM_NODES, 0.1, duration, (fault,) + pins,
                        nodes_per_unit=STORM_NODES, switch_tx_pause_duration=True,
                        note="single-port storm; every victim NIC's port_xmit_wait pinned at 2^32-1")
    elif kind == "nic-watchdog-1s":
        node = busy[int(rng.integers(len(busy)))]
        fault = PfcStorm(((node, _nic(rail)),), onset_s=t, offset_s=round(t + d, 3), nic_watchdog_ms=1000.0)
        return Scenario(f"storm-{kind}-{i:02d}", "pfc_storm", seed, STORM_NODES, 0.1, duration, (fault,),
                        nodes_per_unit=STORM_NODES, note="storm that the NIC's own watchdog stops after 1 s")
    else:
        raise ValueError(kind)
    fault = PfcStorm(sources, onset_s=t, offset_s=round(t + d, 3))
    return Scenario(f"storm-{kind}-{i:02d}", "pfc_storm", seed, STORM_NODES, 0.1, duration, (fault,),
                    nodes_per_unit=STORM_NODES, note=note)


def _storm_long(seed: int) -> Scenario:
    """A two-port storm over a minute and a half, at 1 s sampling (long enough for a `for: 1m` rule)."""
    topo = _topology(8, 8, 2)
    _, busy, _ = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0x5C])
    a, b = (busy[j] for j in rng.choice(len(busy), 2, replace=False))
    rail = int(rng.integers(GPUS))
    t = _frac(rng, 62.0, 66.0, 1.0)         # after a full minute of history, as a 1-minute rate expects
    fault = PfcStorm(((a, _nic(rail)), (b, _nic((rail + 1) % GPUS))), onset_s=t, offset_s=round(t + 100.0, 3))
    return Scenario("storm-long-1s", "pfc_storm", seed, 8, 1.0, 175.0, (fault,),
                    note="two-port storm (different leaves) lasting 100 s, 1 s sampling")


# --------------------------------------------------------------------------- link down

LINK_DOWN_VARIANTS = ("failover", "no_failover", "fec_then_down", "failover_recovers")


def _link_down(i: int, seed: int, n_nodes: int = 8, duration_s: float = 150.0) -> Scenario:
    """A dead NIC link (variant by ``i``), a dead leaf uplink on odd ``i``, and two operator
    shutdowns (a leaf port, a host NIC) on nodes of other jobs, which must not fire."""
    topo = _topology(n_nodes, n_nodes, 2)
    jobs, _, idle = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0x1D])
    multi = [j for j in jobs if len(j.nodes) >= 2]
    victim_job = multi[0] if multi else jobs[0]
    node = victim_job.nodes[int(rng.integers(len(victim_job.nodes)))]
    others = [n for n in rng.permutation(topo.nodes).tolist() if n not in victim_job.nodes] or \
        [n for n in topo.nodes if n != node]
    variant = LINK_DOWN_VARIANTS[i % len(LINK_DOWN_VARIANTS)]
    t = _frac(rng, 20.0, 35.0, 1.0)
    rail = int(rng.integers(GPUS))
    off = round(t + float(rng.uniform(50.0, 80.0)), 3) if variant == "failover_recovers" else INF
    faults: list[Fault] = [LinkDown(node, _nic(rail), onset_s=t, offset_s=off, failover=variant != "no_failover",
                                    fec_warning_s=20.0 if variant == "fec_then_down" else 0.0)]
    if i % 2:
        uplinks = [link for link in topo.links if link.a_switch.startswith("leaf")]
        up = uplinks[int(rng.integers(len(uplinks)))]
        faults.append(SwitchLinkDown(up.a_switch, up.a_port, onset_s=_frac(rng, 30.0, 45.0, 1.0)))
    a, b = others[0], others[1 % len(others)]
    leaf = topo.nic(a, _nic(int(rng.integers(GPUS))))
    faults.append(AdminToggle(leaf.switch, leaf.switch_port, onset_s=_frac(rng, 25.0, 40.0, 1.0), down_s=90.0))
    host = idle[0] if idle and idle[0] not in (node, a) else b
    faults.append(NicAdminDown(host, _nic(int(rng.integers(GPUS))), onset_s=_frac(rng, 25.0, 40.0, 1.0), down_s=80.0))
    return Scenario(f"link-down-{i:02d}-{variant}", "link_down", seed, n_nodes, 1.0, duration_s, tuple(faults),
                    note=f"a dead NIC link ({variant.replace('_', ' ')})" + (", a dead leaf uplink" if i % 2 else "")
                    + "; an operator shuts a leaf port (90 s) and a host NIC (80 s)")


# --------------------------------------------------------------------------- ECMP imbalance

# Three units of four nodes: rails of jobs across units cross the spines; a unit whose jobs stay
# home has leaves that send nothing upward (the idle-leaf negative).
ECMP_NODES, ECMP_UNIT, ECMP_SPINES = 12, 4, 4
DEADLOCK_NODES = 8                              # two units: a down-up loop through both
# The short negative: one 10 s window and a bit. A window polarized for a fraction x of its time
# reads imbalanced once x >= 1/6 (one hot uplink of four: x + (1 - x) / 4 >= 1.5 / 4), so 12 s
# shows at most two imbalanced windows in a row, below the detector's three.
ECMP_SHORT_S = 12.0


def _sending_leaves(topo: Topology, jobs: list[Job]) -> tuple[list[str], list[str]]:
    """Leaves that send to the spines (a job spans both units: its rings cross), and the others."""
    unit = {n: i // ECMP_UNIT for i, n in enumerate(topo.nodes)}
    units = {u for j in jobs if len({unit[n] for n in j.nodes}) > 1 for n in j.nodes for u in [unit[n]]}
    leaves = [s for s, sw in topo.switches.items() if sw.role == "leaf"]
    send = [lf for lf in leaves if int(lf.split("-")[1][1:]) in units]
    return send, [lf for lf in leaves if lf not in send]


def _uplinks(topo: Topology, leaf: str) -> list[str]:
    return sorted((lk.a_port for lk in topo.links if lk.a_switch == leaf), key=lambda p: int(p[8:]))


def _ecmp(i: int, seed: int, duration_s: float = 150.0) -> Scenario:
    """Two polarized leaves; a negative by ``i``: short, moving, an uplink shut; an idle leaf's too."""
    topo = _topology(ECMP_NODES, ECMP_UNIT, ECMP_SPINES)
    k = 0
    send, idle = _sending_leaves(topo, auto_jobs(topo, seed))
    while len(send) < 3:                      # a placement with no job across the units: the next one
        k += 1
        send, idle = _sending_leaves(topo, auto_jobs(topo, seed + 1000 * k))
    seed += 1000 * k
    rng = np.random.default_rng([seed, 0xEC])
    leaves = [send[j] for j in rng.permutation(len(send))[:3]]
    faults: list[Fault] = []
    for n, leaf in enumerate(leaves[:2]):
        ups = _uplinks(topo, leaf)
        hot = tuple(sorted(rng.choice(ups, 1 + (i + n) % 2, replace=False).tolist(), key=lambda p: int(p[8:])))
        onset = _frac(rng, 15.0, 35.0, 1.0)
        off = round(onset + float(rng.uniform(70.0, 100.0)), 3) if (i + n) % 2 else INF
        faults.append(EcmpPolarization(leaf, hot, onset_s=onset, offset_s=off))
    third, ups = leaves[2], _uplinks(topo, leaves[2])
    variant = ("short", "moving", "uplink_shut")[i % 3]
    t = _frac(rng, 20.0, 40.0, 1.0)
    if variant == "short":
        faults.append(EcmpPolarization(third, (ups[int(rng.integers(len(ups)))],), onset_s=t,
                                       offset_s=round(t + ECMP_SHORT_S, 3)))
    elif variant == "moving":
        faults.append(EcmpPolarization(third, (ups[0],), onset_s=t, offset_s=round(t + 100.0, 3), rotate_s=10.0))
    else:
        faults.append(AdminToggle(third, ups[int(rng.integers(len(ups)))], onset_s=t, down_s=90.0))
    if idle:
        lf = idle[int(rng.integers(len(idle)))]
        faults.append(EcmpPolarization(lf, (_uplinks(topo, lf)[0],), onset_s=_frac(rng, 15.0, 30.0, 1.0)))
    return Scenario(f"ecmp-{i:02d}-{variant}", "ecmp_imbalance", seed, ECMP_NODES, 1.0, duration_s, tuple(faults),
                    nodes_per_unit=ECMP_UNIT, n_spines=ECMP_SPINES, ecmp_spread=True,
                    note=f"two polarized leaves; negatives: {variant.replace('_', ' ')}"
                    + (", a polarized leaf that sends nothing" if idle else ""))


# --------------------------------------------------------------------------- PFC deadlock


def _down_up_loop(rail: int, a: int, b: int) -> tuple[tuple[str, str], ...]:
    """leaf-u0-r -> spine-a -> leaf-u1-r -> spine-b -> leaf-u0-r: the held ports, in order."""
    up = ECMP_UNIT
    return ((f"leaf-u0-r{rail}", f"Ethernet{up + a}"), (f"spine-{a}", f"Ethernet{GPUS + rail}"),
            (f"leaf-u1-r{rail}", f"Ethernet{up + b}"), (f"spine-{b}", f"Ethernet{rail}"))


def _leaf_spine_loop(unit: int, rail: int, spine: int) -> tuple[tuple[str, str], ...]:
    """A leaf and a spine holding each other over one link (a routing loop between the two)."""
    return ((f"leaf-u{unit}-r{rail}", f"Ethernet{ECMP_UNIT + spine}"), (f"spine-{spine}", f"Ethernet{unit * GPUS + rail}"))


def _deadlock(i: int, seed: int, duration_s: float = 30.0) -> Scenario:
    """Two pause loops on distinct rails and spines; a transient loop; a storm every other one."""
    topo = _topology(DEADLOCK_NODES, ECMP_UNIT, ECMP_SPINES)
    jobs, busy, _ = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0xDE])
    rails = [int(r) for r in rng.permutation(GPUS)[:4]]
    sp = [int(s) for s in rng.permutation(ECMP_SPINES)]
    t1 = _frac(rng, 3.0, 8.0, 0.1)
    t2 = _frac(rng, 10.0, 16.0, 0.1)
    faults: list[Fault] = [
        PfcDeadlock(_down_up_loop(rails[0], sp[0], sp[1]), onset_s=t1, offset_s=round(t1 + float(rng.uniform(3.0, 10.0)), 3)),
        PfcDeadlock(_leaf_spine_loop(int(rng.integers(2)), rails[1], sp[2]), onset_s=t2,
                    offset_s=round(t2 + float(rng.uniform(3.0, 10.0)), 3)),
    ]
    t3 = _frac(rng, 18.0, 24.0, 0.1)
    faults.append(PfcDeadlock(_leaf_spine_loop(int(rng.integers(2)), rails[2], sp[3]), onset_s=t3,
                              offset_s=round(t3 + float(rng.uniform(0.3, 0.7)), 3)))
    if i % 2 == 0 and busy:
        node = busy[int(rng.integers(len(busy)))]
        t4 = _frac(rng, 4.0, 20.0, 0.1)
        faults.append(PfcStorm(((node, _nic(rails[3])),), onset_s=t4, offset_s=round(t4 + float(rng.uniform(2.0, 5.0)), 3)))
    return Scenario(f"deadlock-{i:02d}", "pfc_deadlock", seed, DEADLOCK_NODES, 0.1, duration_s, tuple(faults),
                    nodes_per_unit=ECMP_UNIT, n_spines=ECMP_SPINES, switch_tx_pause_duration=bool(i % 3 == 1),
                    note="a down-up loop and a leaf-spine loop; a transient loop" + (", a storm" if i % 2 == 0 else "")
                    + (" (TX pause duration exported)" if i % 3 == 1 else ""))


# --------------------------------------------------------------------------- congestion tuning (issue 15)

CONGESTION_VARIANTS = ("own_incast", "forced_incast", "late_onset")


def _congestion(i: int, seed: int, n_nodes: int = 8, duration_s: float = 150.0) -> Scenario:
    """A misordered leaf (variant by ``i``) and lossless drops on another leaf's port; negatives:
    heavy healthy incast, a misordered leaf without incast (odd ``i``), lossy drops, a NIC link
    flapping behind a third port (its transitions drop the frames in flight)."""
    topo = _topology(n_nodes, n_nodes, 2)
    rng = np.random.default_rng([seed, 0xEC])
    leaves = [s for s, sw in topo.switches.items() if sw.role == "leaf"]
    order = [leaves[k] for k in rng.permutation(len(leaves))]
    bad, incast, drop_leaf, quiet = order[0], order[1], order[2], order[3]
    variant = CONGESTION_VARIANTS[i % len(CONGESTION_VARIANTS)]
    t = _frac(rng, 10.0, 20.0, 1.0) if variant != "late_onset" else _frac(rng, 50.0, 60.0, 1.0)
    # no marks at all, 1 % of a healthy switch's, or 5 % (over the DCQCN floor at times: its peers decide)
    factor = (0.0, 0.01, 0.05)[i // len(CONGESTION_VARIANTS) % 3]
    faults: list[Fault] = [EcnAfterPause(bad, onset_s=t, incast=0.5 if variant == "forced_incast" else 0.0,
                                         marking_factor=factor),
                           Incast(incast, onset_s=_frac(rng, 10.0, 30.0, 1.0), offset_s=_frac(rng, 100.0, 140.0, 1.0))]
    if i % 2:
        faults.append(EcnAfterPause(quiet, onset_s=_frac(rng, 10.0, 30.0, 1.0), quiet=True))
    nics = sorted((p for p in topo.nic_ports if p.switch == drop_leaf), key=lambda p: p.switch_port)
    a, b, c = (nics[int(k)] for k in rng.choice(len(nics), 3, replace=False))
    a, b = a.switch_port, b.switch_port
    faults.append(QueueDrops(drop_leaf, a, onset_s=_frac(rng, 20.0, 60.0, 1.0),
                             drops_per_s=float(rng.choice([0.5, 5.0, 50.0]))))
    faults.append(QueueDrops(drop_leaf, b, onset_s=_frac(rng, 20.0, 60.0, 1.0), priority=0, drops_per_s=200.0))
    # the NIC behind a third port flaps: its leaf port's queues lose the frames in flight (the link's drops)
    faults.append(LinkFlap(c.node, c.entity_id, onset_s=_frac(rng, 30.0, 60.0, 1.0), down_s=float(rng.uniform(1, 4)),
                           flaps=2, period_s=10.0))
    # a NIC discarding on lossless priority 3 (its buffer or PFC config), behind a fifth leaf
    nics = [p for p in topo.nic_ports if p.switch == order[5] and p.node != c.node]
    d = nics[int(rng.integers(len(nics)))]
    faults.append(NicLosslessDrops(d.node, d.entity_id, onset_s=_frac(rng, 20.0, 60.0, 1.0),
                                   drops_per_s=float(rng.choice([1.0, 20.0]))))
    if i % 4 == 3:
        # after the rest, a leaf port storming a busy NIC for ~65 s: one port's pauses without
        # marks, not incast (later, so that its stalled job does not hide the misordered leaf)
        duration_s += 90.0
        _, busy, _ = _jobs(topo, seed)
        victim = next((p for p in topo.nic_ports if p.switch == order[4] and p.node in busy), None)
        if victim is not None:
            faults.append(SwitchPfcStorm(victim.switch, victim.switch_port, onset_s=_frac(rng, 150.0, 160.0, 1.0),
                                         offset_s=_frac(rng, 215.0, 225.0, 1.0)))
    return Scenario(f"congestion-{i:02d}-{variant}", "congestion", seed, n_nodes, 1.0, duration_s, tuple(faults),
                    note=f"a leaf marking ECN above XOFF ({variant.replace('_', ' ')}), lossless drops on a leaf "
                         "port; negatives: healthy heavy incast, lossy drops, drops as a NIC link flaps"
                         + (", a misordered leaf without incast" if i % 2 else "")
                         + (", then a leaf port storming a busy NIC for ~65 s" if i % 4 == 3 else ""))


# --------------------------------------------------------------------------- hangs


# The hang's root, by scenario index: a rank that never enters the next collective (alive), its
# process dead (heartbeats stop), its GPU lost (XID 79), its NIC's link down without NCCL failover.
HANG_VARIANTS = ("stuck_process", "process_lost", "xid", "nic_down")
# Job stalls that are no hang, on another job of the same run: every rank idle between
# collectives (a long checkpoint), every heartbeat stopped (the scheduler paused the job), a
# long step whose small collectives keep completing.
HANG_NEGATIVES = ("checkpoint_stall", "job_pause", "long_step")


def _hang(i: int, seed: int, n_nodes: int = 8, duration_s: float = 180.0) -> Scenario:
    """One rank holds up its job (root by ``i``); another job stalls without hanging."""
    topo = _topology(n_nodes, n_nodes, 2)
    jobs, _, _ = _jobs(topo, seed)
    rng = np.random.default_rng([seed, 0x4A6])
    order = sorted(jobs, key=lambda j: (-len(j.nodes), j.job_id))
    victim, other = order[0], (order[1] if len(order) > 1 else None)
    node = victim.nodes[int(rng.integers(len(victim.nodes)))]
    gpu = int(rng.integers(GPUS))
    variant = HANG_VARIANTS[i % len(HANG_VARIANTS)]
    t = _frac(rng, 30.0, 50.0, 1.0)
    faults: list[Fault] = []
    if variant == "stuck_process":
        faults.append(RankStuck(node, gpu, onset_s=t))
    elif variant == "process_lost":
        faults.append(RankLost(node, gpu, onset_s=t))
    elif variant == "xid":
        faults.append(GpuXid(node, gpu, 79, onset_s=t))
    else:
        faults.append(LinkDown(node, _nic(gpu), onset_s=t, failover=False))
    negative = HANG_NEGATIVES[(i // len(HANG_VARIANTS) + i) % len(HANG_NEGATIVES)]
    if other is not None:
        on = other.nodes[int(rng.integers(len(other.nodes)))]
        t2 = _frac(rng, 20.0, 40.0, 1.0)
        if negative == "checkpoint_stall":
            faults.append(CheckpointStall(on, onset_s=t2, duration_s=round(float(rng.uniform(90.0, 150.0)), 1)))
        elif negative == "job_pause":
            faults.append(JobPause(on, onset_s=t2, duration_s=round(float(rng.uniform(60.0, 110.0)), 1)))
        else:
            faults.append(LongStep(on, onset_s=t2, duration_s=round(float(rng.uniform(90.0, 140.0)), 1)))
    return Scenario(f"hang-{i:02d}-{variant}", "hang", seed, n_nodes, 1.0, duration_s, tuple(faults),
                    note=f"a hung collective ({variant.replace('_', ' ')} on {node} gpu{gpu})"
                    + (f"; {negative.replace('_', ' ')} on another job" if other is not None else ""))


# --------------------------------------------------------------------------- must not fire


# The node collector's real cadence: PFC counters every 100 ms between full snapshots every
# second (`intervals.ethtool_pfc`), so most ticks carry no link labels, GPU gauges or sysfs
# counters: a detector that took a missing column for a healthy one would flap here.
COLLECTOR_PFC_INTERVAL_S = 0.1


def _at_collector_cadence(cfg: SuiteConfig, seed: int) -> list[Scenario]:
    """Fault-mix, straggler and dead-link scenarios again, sampled as the collectors sample."""
    built = ([_fault_mix(i, seed + i) for i in range(cfg.cadence_mix_scenarios)]
             + [_stragglers(i, seed + 20 + i) for i in range(cfg.cadence_straggler_scenarios)]
             + [_link_down(i, seed + 40 + i) for i in range(cfg.cadence_link_down_scenarios)]
             + [_hang(i, seed + 60 + i) for i in range(cfg.cadence_hang_scenarios)])
    return [dataclasses.replace(sc, name=f"{sc.name}-cadence", pfc_interval_s=COLLECTOR_PFC_INTERVAL_S,
                                note=f"{sc.note}; at the collectors' cadence (PFC-only ticks every 100 ms)")
            for sc in built]


def _must_not_fire(seed: int, quick: bool = False) -> list[Scenario]:
    out = []
    topo, busy, idle = _storm_cluster(seed)
    rng = np.random.default_rng([seed, 0x3F])
    a, b, c = (busy[j % len(busy)] for j in range(3))
    short = tuple(PfcStorm(((n, _nic(int(rng.integers(GPUS)))),), onset_s=t, offset_s=round(t + d, 3))
                  for n, t, d in ((a, 2.33, 0.05), (b, 4.37, 0.1), (c, 6.41, 0.15)))
    out.append(Scenario("mnf-storm-shorter-than-tdetect", "must_not_fire", seed, STORM_NODES, 0.1, 9.0, short,
                        nodes_per_unit=STORM_NODES, note="storms of 50, 100, 150 ms (< T_detect = 200 ms)"))
    out.append(Scenario("mnf-xon-flood", "must_not_fire", seed + 1, STORM_NODES, 0.1, 9.0,
                        (PfcStorm(((a, _nic(2)),), onset_s=2.33, offset_s=7.33, xon_only=True),),
                        nodes_per_unit=STORM_NODES, note="XON-only frames (quanta 0) for 5 s: pause nothing"))
    if quick:
        return out
    out.append(Scenario("mnf-nic-watchdog-100ms", "must_not_fire", seed + 2, STORM_NODES, 0.1, 9.0,
                        (PfcStorm(((b, _nic(5)),), onset_s=2.33, offset_s=7.33, nic_watchdog_ms=100.0),),
                        nodes_per_unit=STORM_NODES, note="the NIC's own watchdog ends the storm after 100 ms"))
    # sonic-mgmt test_pfcwd_no_traffic: pauses with nothing queued behind them are not a storm
    # (job placement follows the scenario's seed: the idle node is drawn with it)
    quiet = _storm_cluster(seed + 4)[2]
    if quiet:
        out.append(Scenario("mnf-storm-no-traffic", "must_not_fire", seed + 4, STORM_NODES, 0.1, 9.0,
                            (PfcStorm(((quiet[0], _nic(4)),), onset_s=2.33, offset_s=7.33),),
                            nodes_per_unit=STORM_NODES, switch_tx_pause_duration=True,
                            note="an idle node's NIC pauses its leaf for 5 s: nothing is sent to it"))
    quiet = _storm_cluster(seed + 5)[2]
    if quiet:
        lp = topo.nic(quiet[0], _nic(6))
        out.append(Scenario("mnf-switch-storm-idle-node", "must_not_fire", seed + 5, STORM_NODES, 0.1, 9.0,
                            (SwitchPfcStorm(lp.switch, lp.switch_port, onset_s=2.33, offset_s=7.33),
                             PinnedCounter(quiet[0], _nic(6))),
                            nodes_per_unit=STORM_NODES, switch_tx_pause_duration=True,
                            note="a leaf port pauses an idle node's NIC (port_xmit_wait pinned) for 5 s"))
    leaf_port = topo.nic(c, _nic(3))
    out.append(Scenario("mnf-admin-toggle-leaf-100ms", "must_not_fire", seed + 3, STORM_NODES, 0.1, 10.0,
                        (AdminToggle(leaf_port.switch, leaf_port.switch_port, onset_s=2.33, down_s=3.0),),
                        nodes_per_unit=STORM_NODES, note="operator shuts and re-enables a leaf port facing a busy NIC"))
    # 1 s sampling, 8 nodes
    topo8 = _topology(8, 8, 2)
    _, busy8, _ = _jobs(topo8, seed + 10)
    out.append(Scenario("mnf-node-reboot", "must_not_fire", seed + 10, 8, 1.0, 130.0,
                        (NodeReboot(busy8[0], onset_s=30.4),),
                        note="a busy node reboots (simulator default: 60 s down, job restarts 30 s later), "
                             "counters restart near 0"))
    _, busy8, _ = _jobs(topo8, seed + 11)
    out.append(Scenario("mnf-clock-skew", "must_not_fire", seed + 11, 8, 1.0, 90.0,
                        (ClockSkew(busy8[0], onset_s=30.4, skew_s=5.0),
                         ClockSkew(busy8[-1], onset_s=50.4, offset_s=70.4, skew_s=-2.0)),
                        note="one node's clock jumps 5 s ahead; another runs 2 s behind for 20 s"))
    _, busy8, _ = _jobs(topo8, seed + 12)
    up = next(link for link in topo8.links if link.a_switch.startswith("leaf"))
    lp = topo8.nic(busy8[1], _nic(6))
    out.append(Scenario("mnf-admin-toggle-1s", "must_not_fire", seed + 12, 8, 1.0, 90.0,
                        (AdminToggle(up.a_switch, up.a_port, onset_s=30.4, down_s=10.0),
                         AdminToggle(lp.switch, lp.switch_port, onset_s=55.4, down_s=5.0)),
                        note="operator toggles a leaf uplink (10 s) and a leaf port facing a busy NIC (5 s)"))
    _, busy8, _ = _jobs(topo8, seed + 14)
    rng_a = np.random.default_rng([seed, 0x13])
    bugs = (_app_xid(rng_a, busy8[0], 10.0, 1.0, 13, bursts=4, period_s=25.0),
            _app_xid(rng_a, busy8[1 % len(busy8)], 20.0, 1.0, 31, bursts=2, period_s=40.0, crash=True),
            _app_xid(rng_a, busy8[2 % len(busy8)], 30.0, 1.0, 43, bursts=3, period_s=30.0))
    out.append(Scenario("mnf-application-xid", "must_not_fire", seed + 14, 8, 1.0, 120.0, bugs,
                        note="buggy user code: XID 13 / 31 / 43 bursts on a job's GPUs, XID 45 on its other GPUs; "
                             "one job crashes and restarts from its checkpoint"))
    _, busy8, _ = _jobs(topo8, seed + 13)
    out.append(Scenario("mnf-xon-flood-long", "must_not_fire", seed + 13, 8, 1.0, 180.0,
                        (PfcStorm(((busy8[2], _nic(1)),), onset_s=62.4, offset_s=172.4, xon_only=True),),
                        note="XON-only flood for 110 s (long enough for a frame-rate rule with `for: 1m`)"))
    return out


# --------------------------------------------------------------------------- healthy


def _healthy(cfg: SuiteConfig) -> list[Scenario]:
    out = []
    n = cfg.healthy_nodes
    per_run = n * cfg.healthy_run_s / 3600.0
    runs = max(1, math.ceil(cfg.healthy_node_hours / per_run - 1e-9)) if cfg.healthy_node_hours > 0 else 0
    for k in range(runs):
        seed = cfg.seed + 1000 + k
        out.append(Scenario(f"healthy-1s-{k:02d}", "healthy", seed, n, 1.0, cfg.healthy_run_s,
                            _buggy_jobs(_topology(n, min(32, n), 8 if n > 32 else 4), seed, 1.0, cfg.healthy_run_s),
                            nodes_per_unit=min(32, n), n_spines=8 if n > 32 else 4,
                            note="noisy healthy cluster running some buggy user code (application XIDs), no faults"))
    if cfg.healthy_fast_s > 0:
        seed = cfg.seed + 2000
        out.append(Scenario("healthy-100ms", "healthy", seed, 8, 0.1, cfg.healthy_fast_s,
                            _buggy_jobs(_topology(8, 8, 2), seed, 0.1, cfg.healthy_fast_s),
                            switch_tx_pause_duration=True,
                            note="noisy healthy cluster at 0.1 s sampling (PFC-rate), application XIDs, no faults; "
                                 "switches export their TX pause duration"))
    return out


# A healthy cluster runs buggy user code too: about one busy node in eight hosts a job that
# throws an application-XID burst every 1-4 minutes (a crash loop, a bad kernel in one rank).
BUGGY_NODE_FRACTION = 0.125
BUG_PERIOD_S = (60.0, 240.0)


def _buggy_jobs(topo: Topology, seed: int, interval_s: float, duration_s: float) -> tuple:
    _, busy, _ = _jobs(topo, seed)
    if not busy:
        return ()
    rng = np.random.default_rng([seed, 0xB06])
    k = max(1, int(round(BUGGY_NODE_FRACTION * len(busy))))
    out = []
    for node in sorted(rng.choice(busy, k, replace=False).tolist()):
        period = round(float(rng.uniform(*BUG_PERIOD_S)), 3)
        first = float(rng.uniform(2.0, min(period, duration_s / 2)))
        bursts = max(1, int((duration_s - 1.0 - first) // period) + 1)
        out.append(_app_xid(rng, node, first, interval_s, APP_XID_CODES[int(rng.integers(len(APP_XID_CODES)))],
                            bursts=bursts, period_s=period))
    return tuple(sorted(out, key=lambda f: f.onset_s))


# --------------------------------------------------------------------------- suites


def _quick(cfg: SuiteConfig) -> list[Scenario]:
    seed = cfg.seed
    topo = _topology(4, 4, 2)
    _, busy, _ = _jobs(topo, seed)
    mix = Scenario("quick-mix", "fault_mix", seed, 4, 1.0, 24.0,
                   (LinkDowngrade(busy[0], "mlx5_3/1", onset_s=8.4, offset_s=18.4),
                    XidCascade(busy[1], 2, 48, onset_s=12.6, victims=(0, 5, 7), delays_s=(0.3, 0.8, 2.1))),
                   nodes_per_unit=4, note="a clear 200G downgrade and an XID 48 with XID 45 on three sibling GPUs")
    _, sbusy, _ = _storm_cluster(seed + 1)
    storm = Scenario("quick-storm", "pfc_storm", seed + 1, STORM_NODES, 0.1, 6.0,
                     (PfcStorm(((sbusy[0], "mlx5_5/1"),), onset_s=2.03, offset_s=4.53),),
                     nodes_per_unit=STORM_NODES, note="one single-port storm")
    _, hbusy, _ = _jobs(topo, seed + 2)
    healthy = Scenario("quick-healthy", "healthy", seed + 2, 4, 1.0, 40.0,
                       (ApplicationXid(hbusy[0], (3,), onset_s=10.4, code=31, bursts=2, period_s=15.0,
                                       cleanup=(1, 2, 6)),),
                       nodes_per_unit=4, note="noisy healthy cluster, a buggy job's XID 31 + XID 45 bursts, no faults")
    return [mix, storm, healthy] + _must_not_fire(seed + 3, quick=True)[:1]


def build_suites(cfg: SuiteConfig | None = None) -> list[Scenario]:
    """Every scenario of one evaluation, deterministic in ``cfg``."""
    cfg = cfg or SuiteConfig()
    if cfg.quick:
        return _quick(cfg)
    s0 = cfg.seed
    out: list[Scenario] = []
    out += [_fault_mix(i, s0 + 100 + i) for i in range(cfg.mix_scenarios)]
    out += [_stragglers(i, s0 + 200 + i) for i in range(cfg.straggler_scenarios)]
    out += [_storm_pair(i, s0 + 300 + i) for i in range(cfg.storm_pair_scenarios)]
    multi = ["two-port-same-leaf", "two-port-diff-leaf", "two-port-same-leaf", "two-port-diff-leaf", "all-port",
             "switch-port", "switch-port-tx", "nic-watchdog-1s", "switch-port", "switch-port-tx", "pinned-victims"]
    out += [_storm_multi(kind, i, s0 + 400 + i) for i, kind in enumerate(multi)]
    out.append(_storm_long(s0 + 450))
    out += [_link_down(i, s0 + 600 + i) for i in range(cfg.link_down_scenarios)]
    out += [_hang(i, s0 + 800 + i) for i in range(cfg.hang_scenarios)]
    out += _at_collector_cadence(cfg, s0 + 700)
    out += [_congestion(i, s0 + 800 + i) for i in range(cfg.congestion_scenarios)]
    out += _must_not_fire(s0 + 500)
    out += [_ecmp(i, s0 + 800 + i) for i in range(cfg.ecmp_scenarios)]
    out += [_deadlock(i, s0 + 900 + i) for i in range(cfg.deadlock_scenarios)]
    out += _healthy(cfg)
    return out


def expected_case_counts(scenarios: list[Scenario]) -> Counter:
    """Positive (expect_alert) ground-truth cases per fault class, as the simulator labels them."""
    counts: Counter = Counter()
    for sc in scenarios:
        if not sc.faults:
            continue
        for gt in sc.simulator().ground_truth():
            cls = fault_class(gt.kind)
            if gt.expect_alert and cls:
                counts[cls] += 1
    return counts


def _describe(f) -> str:
    name = type(f).__name__
    if isinstance(f, PfcStorm):
        src = ",".join(f"{n}/{p}" for n, p in f.sources)
        extra = " xon-only" if f.xon_only else ""
        extra += f" nic-wd {f.nic_watchdog_ms:g} ms" if f.nic_watchdog_ms else ""
        return f"{name}[{src}] {f.onset_s:g}-{f.offset_s:g} s{extra}"
    if isinstance(f, PfcDeadlock):
        loop = " > ".join(f"{sw}/{p}" for sw, p in f.ports)
        return f"{name}[{loop}] {f.onset_s:g}-{f.offset_s:g} s"
    who = getattr(f, "node", None) or getattr(f, "switch", "")
    dev = getattr(f, "nic", None) or getattr(f, "port", None)
    if dev is None and hasattr(f, "gpu"):
        dev = f"gpu{f.gpu}"
    off = getattr(f, "offset_s", INF)
    when = f"{f.onset_s:g}" + (f"-{off:g}" if off != INF else "-") + " s"
    extra = ""
    if isinstance(f, LinkDowngrade):
        extra = f" {f.rate}"
    elif isinstance(f, XidCascade):
        extra = f" xid {f.code} + xid 45 on {len(f.victims)} GPU(s)"
    elif isinstance(f, GpuXid):
        extra = f" xid {f.code}"
    elif isinstance(f, ApplicationXid):
        dev = "gpu" + ",".join(map(str, f.gpus))
        extra = f" app xid {f.code} x{f.bursts}" + (f" + xid 45 on {len(f.cleanup)}" if f.cleanup else "") + (
            " crash" if f.crash else "")
    elif isinstance(f, Straggler):
        extra = f" x{f.factor:g} {f.cause}"
    elif isinstance(f, EcmpPolarization):
        extra = " hot " + ",".join(f.hot_uplinks) + (f" moving every {f.rotate_s:g} s" if f.rotate_s else "")
    return f"{name}[{who}/{dev}]{extra} {when}" if dev else f"{name}[{who}]{extra} {when}"

