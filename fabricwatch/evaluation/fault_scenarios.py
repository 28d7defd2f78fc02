"""The labelled fault scenarios of `fabricwatch eval`, one builder per suite.

Fault mix, stragglers, PFC storms, link down, ECMP imbalance, PFC deadlock, congestion
tuning and hangs: each builder draws its entities from the scenario's seed and injects the
faults (with the suite's labelled negatives in the same runs). `suites.build_suites`
calls them; the suites are described in `suites`. Separate from the `Scenario` model and
from the negative suites: this is where the fault mix is written down.
"""
from __future__ import annotations

import math

import numpy as np

from fabricwatch.simulator.cluster import Fault
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDowngrade, LinkFlap, NicPcieDowngrade, PfcStorm, LinkDown, NicAdminDown, SwitchLinkDown
from fabricwatch.simulator.host_faults import EccUncorrectable, GpuPcieDowngrade, GpuXid, Straggler
from fabricwatch.simulator.timeline import INF
from fabricwatch.simulator.fabric_faults import PinnedCounter, SwitchPfcStorm
from fabricwatch.simulator.host_faults import ApplicationXid, XidCascade
from fabricwatch.simulator.fabric_faults import EcmpPolarization, PfcDeadlock
from fabricwatch.simulator.fabric_faults import EcnAfterPause, Incast, NicLosslessDrops, QueueDrops
from fabricwatch.simulator.host_faults import CheckpointStall, JobPause, LongStep, RankLost, RankStuck
from fabricwatch.simulator.workload import Job, auto_jobs
from fabricwatch.models.topology import Topology

from .scenarios import (APP_XID_CODES, CASCADE_FRACTION, DOWNGRADE_RATES, GPUS, STRAGGLER_CAUSES, XID_CODES, Scenario,
                        _frac, _jobs, _nic, _topology)


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

