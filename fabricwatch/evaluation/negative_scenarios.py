"""The scenarios that must not fire, and the long healthy runs that give the false-alarm rate.

`must_not_fire`: storms shorter than T_detect, XON floods, pauses with nothing queued,
admin port toggles, a node reboot, clock skew, application XIDs of buggy user code.
`healthy`: noisy healthy clusters, sized in node-hours, one busy node in eight running
buggy code. Separate from `fault_scenarios`: nothing here is a fault to find, only
behaviour a detector must stay quiet through.
"""
from __future__ import annotations

import math

import numpy as np

from fabricwatch.simulator.fabric_faults import AdminToggle, PfcStorm
from fabricwatch.simulator.host_faults import ClockSkew, NodeReboot
from fabricwatch.simulator.fabric_faults import PinnedCounter, SwitchPfcStorm
from fabricwatch.models.topology import Topology

from .fault_scenarios import STORM_NODES, _app_xid, _storm_cluster
from .scenarios import APP_XID_CODES, GPUS, Scenario, SuiteConfig, _jobs, _nic, _topology


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

