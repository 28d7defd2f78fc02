"""The scenario suites of `fabricwatch eval`: which scenarios one evaluation runs.

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

>>> from fabricwatch.evaluation.scenarios import SuiteConfig, expected_case_counts
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

from fabricwatch.simulator.fabric_faults import LinkDowngrade, PfcStorm
from fabricwatch.simulator.host_faults import ApplicationXid, XidCascade

from .fault_scenarios import (STORM_NODES, _congestion, _deadlock, _ecmp, _fault_mix, _hang, _link_down, _storm_cluster,
                              _storm_long, _storm_multi, _storm_pair, _stragglers)
from .negative_scenarios import _healthy, _must_not_fire
from .scenarios import Scenario, SuiteConfig, _jobs, _topology

__all__ = ["build_suites"]

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

