"""The simulated cluster's injected faults: what each one does to the telemetry, ground truth, cost.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
from helpers import Recorder, START, leaf_port, small_topology, two_jobs

from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.demo import demo_scenario
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDowngrade, LinkFlap, PfcStorm
from fabricwatch.simulator.host_faults import ClockSkew, EccUncorrectable, GpuXid, NodeReboot, Straggler
from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.simulator.workload import Job, auto_jobs


# ---------------------------------------------------------------- faults


def test_link_downgrade_visible_in_rate_label_speed_and_capped_traffic():
    topo = small_topology()
    faults = [LinkDowngrade("node-0002", "mlx5_3/1", onset_s=3.0, rate="200 Gb/sec (4X HDR)"),
              LinkDowngrade("node-0005", "mlx5_1/1", onset_s=3.0, rate="400 Gb/sec (8X HDR)")]
    rec = Recorder(ClusterSimulator(topo, seed=2, start_unix_ns=START, jobs=two_jobs(topo), faults=faults,
                                    interval_s=0.5), 16)
    rates = rec.label("node-0002", "mlx5_3/1", "rate")
    assert rates[:5] == ["400 Gb/sec (4X NDR)"] * 5 and set(rates[6:]) == {"200 Gb/sec (4X HDR)"}
    assert rec.gauge("node-0002", "mlx5_3/1", "netdev_speed_mbps")[-1] == 200_000
    assert set(rec.label("node-0005", "mlx5_1/1", "rate")[6:]) == {"400 Gb/sec (8X HDR)"}   # lanes only
    assert rec.gauge("node-0005", "mlx5_1/1", "netdev_speed_mbps")[-1] == 400_000
    sw, port = leaf_port(topo, "node-0002", "mlx5_3/1")
    assert rec.gauge(sw, port, "port_speed_gbps")[-1] == 200
    assert all(w * 32 <= 200e9 for w in rec.rate("node-0002", "mlx5_3/1", "port_xmit_data")[6:])
    (gt,) = [g for g in rec.sim.ground_truth() if g.entity == "node-0002/mlx5_3/1"]
    assert gt.kind == "link_downgrade" and gt.onset_unix_ns == START + 3_000_000_000 and gt.offset_unix_ns is None
    assert gt.related == (f"{sw}/{port}",)


def test_pfc_storm_source_transmits_pauses_victims_receive_them():
    topo = small_topology()
    src = ("node-0002", "mlx5_4/1")
    storm = PfcStorm(sources=(src,), onset_s=5.0, offset_s=15.0)
    jobs = [Job("job-a", ("node-0001", "node-0002", "node-0003", "node-0005")),     # spans two leaves
            Job("job-b", ("node-0006", "node-0007"))]
    rec = Recorder(ClusterSimulator(topo, seed=4, start_unix_ns=START, jobs=jobs, faults=[storm]), 20)
    tx_duty = [us / 1e6 for us in rec.rate(*src, "tx_prio3_pause_duration")]
    rx_duty = [us / 1e6 for us in rec.rate(*src, "rx_prio3_pause_duration")]
    assert all(d > 0.98 for d in tx_duty[5:14]) and all(d < 0.02 for d in tx_duty[:4] + tx_duty[15:])
    assert max(rx_duty[5:14]) < 0.05                                 # the source is not paused itself
    assert min(rec.rate(*src, "tx_prio3_pause")[5:14]) > 10_000      # XOFF refreshes, ~24k/s at 400G
    sw, port = leaf_port(topo, *src)
    assert all(u / 1e6 > 0.98 for u in rec.rate(sw, port, "pfc3-rx-pause-duration-us")[5:14])
    assert all(q == 0 for q in rec.rate(sw, port, "queue3-transmit-pkts")[5:14])   # the queue is stuck...
    assert min(rec.gauge(sw, port, "queue3-occupancy-bytes")[6:14]) > 1e6           # ...and full
    (gt,) = rec.sim.ground_truth()
    assert gt.kind == "pfc_storm" and gt.entity == "node-0002/mlx5_4/1" and gt.expect_alert
    assert gt.related == (f"{sw}/{port}",)
    victims = [v for v in gt.victims if v.startswith("node-")]
    assert victims and "node-0001/mlx5_4/1" in victims and "node-0003/mlx5_4/1" in victims
    for v in victims:
        node, nic = v.split("/", 1)
        duty = [us / 1e6 for us in rec.rate(node, nic, "rx_prio3_pause_duration")]
        assert statistics.mean(duty[6:14]) > 0.8
        assert all(d < 0.7 for d in duty[:4])
        assert statistics.mean(rec.rate(node, nic, "tx_prio3_pause_duration")[6:14]) < 0.05e6
        vsw, vport = leaf_port(topo, node, nic)
        assert statistics.mean(rec.rate(vsw, vport, "pfc3-tx-pkts")[6:14]) > 1000
        before = statistics.mean(rec.rate(node, nic, "port_xmit_data")[:4])
        during = statistics.mean(rec.rate(node, nic, "port_xmit_data")[6:14])
        assert during < 0.25 * before                                 # their traffic collapses
    spine_ports = [v for v in gt.victims if v.startswith("spine-")]   # the leaf pauses its uplinks too
    assert spine_ports
    for v in spine_ports:
        sw_, port_ = v.split("/")
        assert statistics.mean(rec.rate(sw_, port_, "pfc3-rx-pause-duration-us")[6:14]) > 0.8e6
        peer = topo.peer_of(sw_, port_)
        assert statistics.mean(rec.rate(peer.switch, peer.port, "pfc3-tx-pkts")[6:14]) > 1000


def test_storm_variants_short_idle_xon_two_port_watchdog():
    topo = small_topology()
    jobs = two_jobs(topo)
    faults = [
        PfcStorm(((topo.nodes[3], "mlx5_0/1"),), onset_s=2.0, offset_s=8.0),              # idle node: no traffic
        PfcStorm(((topo.nodes[0], "mlx5_1/1"),), onset_s=3.05, offset_s=3.15),            # 100 ms
        PfcStorm(((topo.nodes[4], "mlx5_2/1"),), onset_s=2.0, offset_s=6.0, xon_only=True),
        PfcStorm(((topo.nodes[5], "mlx5_3/1"), (topo.nodes[6], "mlx5_3/1")), onset_s=10.0, offset_s=14.0),
        PfcStorm(((topo.nodes[1], "mlx5_5/1"),), onset_s=10.0, offset_s=20.0, nic_watchdog_ms=2000),
    ]
    rec = Recorder(ClusterSimulator(topo, seed=6, start_unix_ns=START, jobs=jobs, faults=faults), 18)
    truth = {g.entity: g for g in rec.sim.ground_truth()}
    idle = truth[f"{topo.nodes[3]}/mlx5_0/1"]
    assert not idle.expect_alert and not idle.detail["traffic_to_source"] and idle.victims == ()   # holds nothing
    sw, port = leaf_port(topo, topo.nodes[3], "mlx5_0/1")
    assert all(o == 0 for o in rec.gauge(sw, port, "queue3-occupancy-bytes")[2:7])
    assert min(rec.rate(topo.nodes[3], "mlx5_0/1", "tx_prio3_pause_duration")[2:7]) > 0.98e6
    short = truth[f"{topo.nodes[0]}/mlx5_1/1"]
    assert not short.expect_alert
    assert rec.rate(topo.nodes[0], "mlx5_1/1", "tx_prio3_pause_duration")[2] == pytest.approx(1e5, rel=0.01)
    xon = truth[f"{topo.nodes[4]}/mlx5_2/1"]
    assert xon.kind == "pfc_xon_flood" and not xon.expect_alert and xon.victims == ()
    assert min(rec.rate(topo.nodes[4], "mlx5_2/1", "tx_prio3_pause")[2:5]) > 1000
    assert max(rec.rate(topo.nodes[4], "mlx5_2/1", "tx_prio3_pause_duration")[2:5]) < 0.05e6
    xsw, xport = leaf_port(topo, topo.nodes[4], "mlx5_2/1")
    assert min(rec.rate(xsw, xport, "pfc3-rx-pkts")[2:5]) > 1000
    assert max(rec.rate(xsw, xport, "pfc3-rx-pause-duration-us")[2:5]) < 0.05e6
    for n in (topo.nodes[5], topo.nodes[6]):                                     # two-port storm
        assert truth[f"{n}/mlx5_3/1"].detail["sources"] == 2
        assert min(rec.rate(n, "mlx5_3/1", "tx_prio3_pause_duration")[10:13]) > 0.98e6
    wd = truth[f"{topo.nodes[1]}/mlx5_5/1"]
    assert wd.offset_unix_ns == START + 12_000_000_000                        # the NIC gave up pausing
    tx = rec.rate(topo.nodes[1], "mlx5_5/1", "tx_prio3_pause_duration")
    assert min(tx[9:11]) > 0.98e6 and max(tx[12:]) < 0.1e6
    assert rec.counter(topo.nodes[1], "mlx5_5/1", "tx_pause_storm_warning_events")[-1] == 1
    assert rec.counter(topo.nodes[1], "mlx5_5/1", "tx_pause_storm_error_events")[-1] == 1


def test_straggler_busy_and_wait_relation():
    topo = small_topology()
    strag = Straggler("node-0002", gpu=3, onset_s=5.0, factor=1.4, cause="thermal")
    rec = Recorder(ClusterSimulator(topo, seed=8, start_unix_ns=START, jobs=two_jobs(topo), faults=[strag]), 25)
    steps = defaultdict(list)
    for r in rec.rank_steps():
        if r.job_id == "job-a":
            steps[r.step].append(r)
    slow_rank = 1 * 8 + 3                    # node-0002 is the job's second node
    (gt,) = rec.sim.ground_truth()
    assert gt.entity == f"job=job-a/rank={slow_rank}" and gt.victims == ("job=job-a",)
    assert gt.related == ("node-0002/gpu3",) and gt.detail["cause"] == "thermal"
    before, after = [], []
    for _step, ranks in sorted(steps.items()):
        assert len(ranks) == 24 and len({r.step_seconds for r in ranks}) == 1       # one wall clock
        for r in ranks:
            assert r.busy_seconds + r.collective_wait_seconds == pytest.approx(r.step_seconds)
        start = (ranks[0].start_unix_ns - START) / 1e9
        (slow,) = [r for r in ranks if r.rank == slow_rank]
        others = [r for r in ranks if r.rank != slow_rank]
        med_busy = statistics.median(r.busy_seconds for r in others)
        row = (slow.busy_seconds / med_busy, statistics.median(r.collective_wait_seconds for r in others),
               slow.collective_wait_seconds, ranks[0].step_seconds)
        (after if start > 5.5 else before if start < 4.5 else []).append(row)
    assert all(0.9 < b[0] < 1.1 for b in before) and all(1.3 < a[0] < 1.5 for a in after)
    # the others now wait for the straggler: their wait grows by what it lost, its own wait is the least
    extra = statistics.mean(a[1] for a in after) - statistics.mean(b[1] for b in before)
    assert extra == pytest.approx(0.4 * 0.6, rel=0.3)
    assert all(a[2] < a[1] for a in after)
    assert statistics.mean(a[3] for a in after) > statistics.mean(b[3] for b in before) + 0.15
    reasons = rec.gauge("node-0002", "gpu3", "clocks_event_reasons")
    clocks = rec.gauge("node-0002", "gpu3", "sm_clock_mhz")
    assert all(int(r) & 0x40 for r in reasons[8:]) and not any(int(r) & 0x40 for r in reasons[:4])
    assert statistics.mean(clocks[8:]) < 0.8 * statistics.mean(clocks[:4])
    assert rec.gauge("node-0002", "gpu3", "temperature_c")[-1] > rec.gauge("node-0002", "gpu3", "temperature_c")[4] + 5


def test_reboot_resets_counters_and_is_no_storm():
    topo = small_topology()
    reboot = NodeReboot("node-0002", onset_s=4.5, down_s=5.0, restart_s=3.0)
    rec = Recorder(ClusterSimulator(topo, seed=9, start_unix_ns=START, jobs=two_jobs(topo), faults=[reboot]), 16)
    present = ["node-0002" in t for t in rec.ticks]
    assert present[:4] == [True] * 4 and not any(present[4:9]) and all(present[9:])
    data = rec.counter("node-0002", "mlx5_0/1", "port_xmit_data")
    energy = rec.counter("node-0002", "gpu0", "energy_mj")
    assert data[3] > 1e12 and data[9] < 1e6 and energy[3] > 1e9 and energy[9] < 2e6
    assert rec.counter("node-0002", "mlx5_0/1", "link_downed")[9] == 0
    assert [rec.ticks[i]["node-0002"].seq for i in (3, 9)] == [4, 5]
    sw, port = leaf_port(topo, "node-0002", "mlx5_0/1")
    assert rec.gauge(sw, port, "oper_up")[5] == 0 and rec.gauge(sw, port, "oper_up")[10] == 1
    trans = rec.counter(sw, port, "interface-transitions")
    assert trans[-1] - trans[0] == 2
    assert all(r == 0 for r in rec.rate(sw, port, "pfc3-rx-pkts")[3:10])
    (gt,) = rec.sim.ground_truth()
    assert gt.kind == "node_reboot" and not gt.expect_alert and gt.entity == "node-0002"


def test_link_flap_and_admin_toggle():
    topo = small_topology()
    faults = [LinkFlap("node-0001", "mlx5_2/1", onset_s=2.5, down_s=1.2),
              LinkFlap("node-0003", "mlx5_0/1", onset_s=3.0, down_s=2.0),        # on tick boundaries
              AdminToggle("leaf-u1-r1", "Ethernet2", onset_s=2.5, down_s=2.0)]
    rec = Recorder(ClusterSimulator(topo, seed=10, start_unix_ns=START, jobs=two_jobs(topo), faults=faults), 8)
    assert rec.label("node-0001", "mlx5_2/1", "state")[1:4] == ["4: ACTIVE", "1: DOWN", "4: ACTIVE"]
    assert rec.label("node-0001", "mlx5_2/1", "phys_state")[2] == "3: Disabled"
    assert rec.gauge("node-0001", "mlx5_2/1", "netdev_speed_mbps")[2] == -1
    downed = rec.counter("node-0001", "mlx5_2/1", "link_downed")
    phy = rec.counter("node-0001", "mlx5_2/1", "link_down_events_phy")
    assert downed[-1] - downed[0] == 1 and phy[-1] - phy[0] == 1
    sw, port = leaf_port(topo, "node-0001", "mlx5_2/1")
    trans = rec.counter(sw, port, "interface-transitions")
    assert trans[-1] - trans[0] == 2
    sw, port = leaf_port(topo, "node-0003", "mlx5_0/1")
    trans = rec.counter(sw, port, "interface-transitions")
    assert trans[-1] - trans[0] == 2 and rec.gauge(sw, port, "oper_up")[2:6] == [0.0, 0.0, 1.0, 1.0]
    # admin toggle: admin_up and oper_up drop, the NIC behind sees the link go, no pause anywhere
    assert rec.gauge("leaf-u1-r1", "Ethernet2", "admin_up")[2:4] == [0.0, 0.0]
    assert rec.gauge("leaf-u1-r1", "Ethernet2", "admin_up")[5] == 1.0
    assert rec.gauge("leaf-u1-r1", "Ethernet2", "oper_up")[2] == 0.0
    trans = rec.counter("leaf-u1-r1", "Ethernet2", "interface-transitions")
    assert trans[-1] - trans[0] == 2
    nic = topo.peer_of("leaf-u1-r1", "Ethernet2").nic
    assert rec.label(nic.node, nic.entity_id, "phys_state")[2] == "2: Polling"
    assert max(rec.rate("leaf-u1-r1", "Ethernet2", "pfc3-rx-pause-duration-us")) < 0.05e6
    (toggle,) = [g for g in rec.sim.ground_truth() if g.kind == "admin_toggle"]
    assert not toggle.expect_alert and toggle.related == (f"{nic.node}/{nic.entity_id}",)


def test_xid_ecc_and_clock_skew():
    topo = small_topology()
    faults = [GpuXid("node-0001", 2, 79, onset_s=2.5, offset_s=5.0),
              GpuXid("node-0005", 1, 48, onset_s=1.2, repeat_s=1.0, offset_s=4.0),
              EccUncorrectable("node-0006", 0, onset_s=2.2, count=2),
              ClockSkew("node-0003", onset_s=3.0, offset_s=6.0, skew_s=7.0)]
    rec = Recorder(ClusterSimulator(topo, seed=12, start_unix_ns=START, jobs=two_jobs(topo), faults=faults), 8)
    events = [(i, s.source, e.entity_id, e.kind, e.code) for i, t in enumerate(rec.ticks)
              for s in t.values() for e in s.events]
    assert (2, "node-0001", "gpu2", "xid", 79) in events
    assert [e for e in events if e[1] == "node-0005"] == [(i, "node-0005", "gpu1", "xid", 48) for i in (1, 2, 3)]
    assert ("node-0006", "gpu0", "ecc_dbe") in {e[1:4] for e in events}
    unc = rec.counter("node-0005", "gpu1", "ecc_uncorrected_volatile_total")
    assert unc[-1] - unc[0] == 3
    unc = rec.counter("node-0006", "gpu0", "ecc_uncorrected_volatile_total")
    assert unc[-1] - unc[0] == 2
    util = rec.gauge("node-0001", "gpu2", "utilization_gpu_pct")
    assert all(math.isnan(u) for u in util[2:4]) and not math.isnan(util[0])   # fallen off the bus
    skew = [(t["node-0003"].time_unix_ns - t["node-0004"].time_unix_ns) / 1e9 for t in rec.ticks]
    assert all(abs(s) < 0.02 for s in skew[:2] + skew[6:]) and all(abs(s - 7) < 0.02 for s in skew[2:5])


def test_ground_truth_and_demo_scenario():
    topo, faults = demo_scenario(n_nodes=32, seed=5)
    assert [type(f).__name__ for f in faults] == ["LinkDowngrade", "PfcStorm", "Straggler"]
    assert all(f.onset_s < 30 for f in faults)
    sim = ClusterSimulator(topo, seed=5, start_unix_ns=START, faults=faults)
    truth = sim.ground_truth()
    assert [g.kind for g in truth] == ["link_downgrade", "pfc_storm", "straggler"]
    assert all(isinstance(g, GroundTruth) and g.onset_unix_ns > START for g in truth)
    storm = truth[1]
    assert storm.victims and storm.entity not in storm.victims
    assert storm.active_at(storm.onset_unix_ns) and not storm.active_at(storm.offset_unix_ns)
    assert truth[2].entity.startswith("job=") and truth[2].detail["cause"] == "thermal"
    # the demo's faults hit nodes that do run jobs, so the straggler shows in RankSteps
    busy = {n for j in auto_jobs(topo, seed=5) for n in j.nodes}
    assert {faults[0].node, faults[1].sources[0][0], faults[2].node} <= busy


def test_invalid_faults_are_rejected():
    topo = small_topology()
    with pytest.raises(ValueError):
        ClusterSimulator(topo, faults=[LinkDowngrade("node-0099", "mlx5_0/1", onset_s=1.0)])
    with pytest.raises(ValueError):
        ClusterSimulator(topo, faults=[LinkDowngrade("node-0001", "mlx5_0/1", onset_s=1.0, rate="fast")])
    with pytest.raises(ValueError):
        ClusterSimulator(topo, jobs=two_jobs(topo), faults=[Straggler("node-0004", 0, onset_s=1.0)])  # idle
    with pytest.raises(ValueError):
        PfcStorm(sources=(), onset_s=1.0)
    with pytest.raises(ValueError):
        LinkDowngrade("node-0001", "mlx5_0/1", onset_s=5.0, offset_s=2.0)
    with pytest.raises(ValueError):
        ClusterSimulator(topo, interval_s=0.0)
    with pytest.raises(TypeError):
        ClusterSimulator(topo, faults=["storm"])


def test_cost_is_reported_per_node_snapshot():
    """Not a benchmark: a guard that 64 nodes tick well under a second on a shared core."""
    import time
    sim = ClusterSimulator(rail_optimised("t", n_nodes=64), seed=0)
    sim.tick()
    t = time.process_time()
    for _ in range(3):
        sim.tick()
    per_node_us = (time.process_time() - t) / 3 / 64 * 1e6
    assert per_node_us < 2000


def test_topology_from_a_file_with_irregular_names():
    """A hand-written topology: no spines, 2 GPUs per node, node names of very different length."""
    from fabricwatch.topology_file import topology_from_dict
    nodes = ["a", "gpu-node-with-a-much-longer-name"]
    doc = {
        "cluster": "lab", "gpus_per_node": 2, "nodes": nodes,
        "switches": [{"name": "sw0", "role": "leaf"}, {"name": "sw1", "role": "leaf"}],
        "nic_ports": [{"node": n, "device": f"mlx5_{r}", "port": 1, "rail": r, "netdev": f"ens{r}f0np0",
                       "switch": f"sw{r}", "switch_port": f"swp{i + 1}"}
                      for i, n in enumerate(nodes) for r in range(2)],
        "links": [],
    }
    topo = topology_from_dict(doc)
    rec = Recorder(ClusterSimulator(topo, seed=1, start_unix_ns=START, interval_s=0.5), 12)
    steps = rec.rank_steps()
    assert steps and {r.node for r in steps} == set(nodes) and {r.world_size for r in steps} == {4}
    for r in steps:
        assert r.node == nodes[r.rank // 2] and r.local_gpu == r.rank % 2
    assert rec.label("a", "mlx5_1/1", "netdev")[0] == "ens1f0np0"
    tx = rec.rate("a", "mlx5_0/1", "port_xmit_data")
    rx = rec.rate("gpu-node-with-a-much-longer-name", "mlx5_0/1", "port_rcv_data")
    assert sum(tx) > 0 and sum(tx) == pytest.approx(sum(rx), rel=0.02)


def test_all_port_storm_on_a_leaf():
    topo = rail_optimised("t", n_nodes=8, nodes_per_unit=4, n_spines=2)
    leaf = "leaf-u0-r6"
    sources = tuple((n.node, n.entity_id) for n in topo.nic_ports if n.switch == leaf)
    jobs = [Job("x", tuple(topo.nodes[:6]))]          # spans both units: uplinks carry traffic
    rec = Recorder(ClusterSimulator(topo, seed=2, start_unix_ns=START, jobs=jobs,
                                    faults=[PfcStorm(sources, onset_s=2.0, offset_s=6.0)]), 8)
    truth = rec.sim.ground_truth()
    assert len(truth) == 4 and {g.entity for g in truth} == {f"{n}/{p}" for n, p in sources}
    assert all(not v.startswith("node-") for v in truth[0].victims)     # every downlink is a source
    for node, nic in sources:
        assert min(rec.rate(node, nic, "tx_prio3_pause_duration")[2:5]) > 0.98e6
