"""The simulated cluster: determinism, wire format, physics of healthy telemetry, injected faults."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
from helpers import entity_rows

from fabricwatch.counters import GPU_GAUGES, NIC_GAUGES, Overflow, spec_for
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.columns import GPU_COUNTERS, NIC_COUNTERS, SWITCH_COUNTERS, SWITCH_PORT_GAUGES
from fabricwatch.simulator.demo import demo_scenario
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDowngrade, LinkFlap, PfcStorm
from fabricwatch.simulator.host_faults import ClockSkew, EccUncorrectable, GpuXid, NodeReboot, Straggler
from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.simulator.workload import Job, auto_jobs

START = 1_800_000_000_000_000_000


def small_topology(n_nodes: int = 8):
    return rail_optimised("t", n_nodes=n_nodes, nodes_per_unit=4, n_spines=2)


def two_jobs(topo) -> list[Job]:
    nodes = topo.nodes
    return [Job("job-a", tuple(nodes[0:3]), step_compute_s=0.6, step_comm_s=0.3),
            Job("job-b", tuple(nodes[4:7]), step_compute_s=0.8, step_comm_s=0.25)]


class Recorder:
    """Runs a simulator and indexes what it sent: (source, entity) -> per-tick samples."""

    def __init__(self, sim: ClusterSimulator, ticks: int) -> None:
        self.sim = sim
        self.ticks: list[dict[str, pb.Snapshot]] = []
        for _ in range(ticks):
            self.ticks.append({s.source: s for s in sim.tick()})

    def entity(self, i: int, source: str, eid: str):
        snap = self.ticks[i].get(source)
        if snap is None:
            return None
        for block in snap.blocks:
            for e in entity_rows(block):
                if e.id == eid:
                    return (dict(zip(block.counter_names, e.counters)), dict(zip(block.gauge_names, e.gauges)),
                            dict(e.labels))
        raise KeyError((source, eid))

    def counter(self, source: str, eid: str, name: str) -> list[int | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[0][name] for i in range(len(self.ticks))]

    def gauge(self, source: str, eid: str, name: str) -> list[float | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[1][name] for i in range(len(self.ticks))]

    def label(self, source: str, eid: str, name: str) -> list[str | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[2][name] for i in range(len(self.ticks))]

    def rate(self, source: str, eid: str, name: str) -> list[float | None]:
        """Per-second deltas (None across a missing sample)."""
        xs = self.counter(source, eid, name)
        dt = self.sim.interval_s
        return [None if a is None or b is None else (b - a) / dt for a, b in zip(xs, xs[1:])]

    def rank_steps(self) -> list[pb.RankStep]:
        return [r for t in self.ticks for s in t.values() for r in s.rank_steps]


def leaf_port(topo, node: str, nic: str) -> tuple[str, str]:
    n = topo.nic(node, nic)
    return n.switch, n.switch_port


# ---------------------------------------------------------------- determinism and wire format


def test_same_seed_same_bytes_other_seed_differs():
    def run(seed):
        sim = ClusterSimulator(small_topology(), seed=seed, start_unix_ns=START,
                               faults=[LinkFlap("node-0002", "mlx5_1/1", onset_s=1.5)])
        # deterministic=True: upb orders map entries (labels) by a per-process hash otherwise
        return [s.SerializeToString(deterministic=True) for _ in range(4) for s in sim.tick()]
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_snapshot_counts_ids_kinds_seq_and_times():
    topo = small_topology()
    sim = ClusterSimulator(topo, seed=1, start_unix_ns=START, interval_s=0.5)
    for k in range(1, 5):
        snaps = sim.tick()
        nodes = [s for s in snaps if s.source_kind == pb.SOURCE_KIND_NODE]
        switches = [s for s in snaps if s.source_kind == pb.SOURCE_KIND_SWITCH]
        assert [s.source for s in nodes] == topo.nodes
        assert snaps[:len(nodes)] == nodes                       # nodes first, then switches
        assert sorted(s.source for s in switches) == sorted(topo.switches)
        for s in snaps:
            assert s.cluster == "t" and s.seq == k
            assert abs(s.time_unix_ns - (START + k * 500_000_000)) < 10_000_000   # a few ms of jitter
        for s in nodes:
            gpu, nic = s.blocks
            assert gpu.entity_kind == pb.ENTITY_KIND_GPU and nic.entity_kind == pb.ENTITY_KIND_NIC_PORT
            assert list(gpu.counter_names) == list(GPU_COUNTERS) and list(gpu.gauge_names) == list(GPU_GAUGES)
            assert list(nic.counter_names) == list(NIC_COUNTERS) and list(nic.gauge_names) == list(NIC_GAUGES)
            assert [e.id for e in entity_rows(gpu)] == [f"gpu{g}" for g in range(8)]
            assert [e.id for e in entity_rows(nic)] == [f"mlx5_{r}/1" for r in range(8)]
            for e in entity_rows(nic):
                assert len(e.counters) == len(NIC_COUNTERS) and len(e.gauges) == len(NIC_GAUGES)
                assert e.labels["link_layer"] == "Ethernet" and e.labels["state"] == "4: ACTIVE"
                assert e.labels["phys_state"] == "5: LinkUp" and parse_ib_rate(e.labels["rate"]).gbps == 400
                assert e.labels["netdev"].startswith("eth") and e.labels["pci_bdf"].startswith("0000:")
            for e in entity_rows(gpu):
                assert len(e.counters) == len(GPU_COUNTERS) and len(e.gauges) == len(GPU_GAUGES)
                assert e.labels["uuid"].startswith("GPU-")
        for s in switches:
            (block,) = s.blocks
            assert block.entity_kind == pb.ENTITY_KIND_SWITCH_PORT
            assert list(block.counter_names) == list(SWITCH_COUNTERS)
            assert list(block.gauge_names) == list(SWITCH_PORT_GAUGES)
            assert {e.id for e in entity_rows(block)} == set(topo.ports_of(s.source))


def test_wire_encoding_parses_to_the_simulated_state():
    """Snapshots are assembled as bytes; what parses must be exactly the internal totals."""
    sim = ClusterSimulator(small_topology(), seed=2, start_unix_ns=START)
    for _ in range(3):
        snaps = sim.tick()
    for s in snaps:
        assert pb.Snapshot.FromString(s.SerializeToString()) == s
        for block in s.blocks:
            for e in entity_rows(block):
                if block.entity_kind == pb.ENTITY_KIND_NIC_PORT:
                    p = sim._p_key[(s.source, e.id)]
                    assert list(e.counters) == sim._nic.values[p].tolist()
                    assert list(e.gauges) == sim._nic_gauges[p].tolist()
                elif block.entity_kind == pb.ENTITY_KIND_GPU:
                    row = sim._node_idx[s.source] * sim.G + int(e.id[3:])
                    assert list(e.counters) == sim._gpu.values[row].tolist()
                else:
                    sp = sim._sp_key[(s.source, e.id)]
                    assert list(e.counters) == sim._sw.values[sp, :len(SWITCH_COUNTERS)].tolist()


# ---------------------------------------------------------------- healthy physics


@pytest.fixture(scope="module")
def healthy():
    topo = small_topology()
    sim = ClusterSimulator(topo, seed=7, start_unix_ns=START, jobs=two_jobs(topo), interval_s=1.0)
    return Recorder(sim, 40)


def test_counters_monotonic_in_a_healthy_run(healthy):
    for i in range(1, len(healthy.ticks)):
        for source, snap in healthy.ticks[i].items():
            prev = {(b.entity_kind, e.id): (b.counter_names, e.counters)
                    for b in healthy.ticks[i - 1][source].blocks for e in entity_rows(b)}
            for b in snap.blocks:
                for e in entity_rows(b):
                    names, before = prev[(b.entity_kind, e.id)]
                    for name, a, c in zip(names, before, e.counters):
                        spec = spec_for(name)
                        if spec.overflow is Overflow.SATURATE:
                            assert c >= a, (source, e.id, name)
                        else:   # may wrap at its width, never go back
                            delta = (c - a) % (1 << spec.width_bits)
                            assert delta < 1 << (spec.width_bits - 1), (source, e.id, name)


def test_units_bytes_within_line_rate_and_pause_within_interval():
    topo = small_topology()
    for dt in (1.0, 0.1):
        rec = Recorder(ClusterSimulator(topo, seed=3, start_unix_ns=START, jobs=two_jobs(topo), interval_s=dt),
                       int(6 / dt))
        peak = 0.0
        for nic in topo.nic_ports:
            gbps = parse_ib_rate(nic.nominal_rate).gbps
            for words in rec.rate(nic.node, nic.entity_id, "port_xmit_data"):
                bps = words * 4 * 8
                assert bps <= gbps * 1e9
                peak = max(peak, bps)
            for us in rec.rate(nic.node, nic.entity_id, "rx_prio3_pause_duration"):
                assert us <= 1e6 + 1
        assert peak > 0.15 * 400e9      # all-reduce bursts do fill the links
    # GPUs: energy (mJ) grows like the power gauge (mW)
    node = topo.nodes[0]
    energy = rec.rate(node, "gpu0", "energy_mj")
    power = rec.gauge(node, "gpu0", "power_mw")
    assert statistics.mean(energy) == pytest.approx(statistics.mean(power[1:]), rel=0.05)


def test_peer_counters_agree_nic_to_leaf_and_leaf_to_spine(healthy):
    topo = healthy.sim.topology
    for nic in topo.nic_ports:
        sw, port = leaf_port(topo, nic.node, nic.entity_id)
        for i in (5, 20):
            n = healthy.entity(i, nic.node, nic.entity_id)[0]
            m = healthy.entity(i - 1, nic.node, nic.entity_id)[0]
            s = healthy.entity(i, sw, port)[0]
            t = healthy.entity(i - 1, sw, port)[0]
            d = {k: n[k] - m[k] for k in n}
            e = {k: s[k] - t[k] for k in s}
            assert d["port_xmit_data"] * 4 <= e["in-octets"] <= d["port_xmit_data"] * 4 + 1000
            assert d["port_rcv_data"] * 4 <= e["out-octets"] <= d["port_rcv_data"] * 4 + 1000
            assert e["queue3-transmit-octets"] == d["rx_prio3_bytes"]
            assert e["pfc3-rx-pkts"] == d["tx_prio3_pause"]               # pause frames the NIC sends
            assert e["pfc3-tx-pkts"] == d["rx_prio3_pause"]               # pause frames the NIC receives
            assert e["pfc3-rx-pause-duration-us"] == d["tx_prio3_pause_duration"]
    for link in topo.links:
        for i in (5, 20):
            a = {k: v - healthy.entity(i - 1, link.a_switch, link.a_port)[0][k]
                 for k, v in healthy.entity(i, link.a_switch, link.a_port)[0].items()}
            b = {k: v - healthy.entity(i - 1, link.b_switch, link.b_port)[0][k]
                 for k, v in healthy.entity(i, link.b_switch, link.b_port)[0].items()}
            assert a["out-octets"] == pytest.approx(b["in-octets"], abs=2)
            assert a["in-octets"] == pytest.approx(b["out-octets"], abs=2)
            assert a["pfc3-tx-pkts"] == pytest.approx(b["pfc3-rx-pkts"], abs=1)
    # the fabric loses nothing: all NIC transmit = all NIC receive
    tx = sum(r for nic in topo.nic_ports for r in healthy.rate(nic.node, nic.entity_id, "port_xmit_data"))
    rx = sum(r for nic in topo.nic_ports for r in healthy.rate(nic.node, nic.entity_id, "port_rcv_data"))
    assert tx == pytest.approx(rx, rel=1e-6)


@pytest.mark.slow
def test_healthy_incast_pauses_are_intermittent_while_traffic_flows():
    topo = rail_optimised("t", n_nodes=16, nodes_per_unit=8, n_spines=2)
    rec = Recorder(ClusterSimulator(topo, seed=11, start_unix_ns=START), 60)
    duties, paused_traffic, ecn_when_paused, ecn_quiet = [], [], [], []
    busy_ports = 0
    for nic in topo.nic_ports:
        tx = rec.rate(nic.node, nic.entity_id, "port_xmit_data")
        if statistics.mean(tx) * 32 < 1e9:
            continue    # an idle node
        busy_ports += 1
        duty = [us / 1e6 for us in rec.rate(nic.node, nic.entity_id, "rx_prio3_pause_duration")]
        tx_duty = [us / 1e6 for us in rec.rate(nic.node, nic.entity_id, "tx_prio3_pause_duration")]
        ecn = rec.rate(nic.node, nic.entity_id, "np_ecn_marked_roce_packets")
        duties += duty
        assert max(tx_duty) < 0.1                      # healthy NICs barely pause their leaf
        for d, t, m in zip(duty, tx, ecn):
            if d > 0.05:
                paused_traffic.append(t * 32)
                ecn_when_paused.append(m)
            elif d == 0:
                ecn_quiet.append(m)
    assert busy_ports > 50
    frac_paused = sum(d > 0 for d in duties) / len(duties)
    assert 0.1 < frac_paused < 0.9                     # intermittent, not constant
    assert sum(d > 0.01 for d in duties) / len(duties) < 0.5
    assert 0.1 < max(duties) < 0.7                     # bursts reach tens of %, never a storm
    assert min(paused_traffic) > 1e9                   # traffic keeps flowing while paused
    assert statistics.mean(ecn_when_paused) > 2 * statistics.mean(ecn_quiet)   # ECN follows congestion


def test_idle_nodes_and_busy_gpus():
    topo = small_topology()
    rec = Recorder(ClusterSimulator(topo, seed=5, start_unix_ns=START, jobs=two_jobs(topo)), 8)
    idle = topo.nodes[3]                               # in no job
    assert rec.sim.idle_nodes == [topo.nodes[3], topo.nodes[7]]
    assert all(g == 1.0 for g in rec.gauge(idle, "gpu0", "pcie_gen_current"))   # NVML power saving
    assert all(g == 5.0 for g in rec.gauge(idle, "gpu0", "pcie_gen_max"))
    assert all(u < 5 for u in rec.gauge(idle, "gpu0", "utilization_gpu_pct"))
    assert all(int(r) & 0x1 for r in rec.gauge(idle, "gpu0", "clocks_event_reasons"))
    assert all(r == 0 for r in rec.rate(idle, "mlx5_0/1", "port_xmit_data"))
    busy = topo.nodes[0]
    assert statistics.mean(rec.gauge(busy, "gpu0", "utilization_gpu_pct")) > 80
    assert statistics.mean(rec.gauge(busy, "gpu0", "power_mw")) > 3 * statistics.mean(rec.gauge(idle, "gpu0", "power_mw"))
    assert statistics.mean(rec.gauge(busy, "gpu0", "temperature_c")) > statistics.mean(rec.gauge(idle, "gpu0", "temperature_c"))


def test_auto_jobs_fill_most_nodes_and_steps_look_synchronous():
    topo = rail_optimised("t", n_nodes=64)
    jobs = auto_jobs(topo, seed=0)
    busy = sum(len(j.nodes) for j in jobs)
    assert 2 <= len(jobs) <= 8 and 0.8 <= busy / 64 <= 0.9
    assert auto_jobs(topo, seed=0) == jobs
    sim = ClusterSimulator(topo, seed=0, start_unix_ns=START)
    steps = defaultdict(list)
    for _ in range(8):
        for s in sim.tick():
            for r in s.rank_steps:
                steps[(r.job_id, r.step)].append(r)
    assert {j for j, _ in steps} == {j.job_id for j in jobs}
    for (_job_id, _step), ranks in steps.items():
        world = ranks[0].world_size
        if len(ranks) != world:
            continue
        assert sorted(r.rank for r in ranks) == list(range(world))
        assert len({r.step_seconds for r in ranks}) == 1
        assert 0.3 < ranks[0].step_seconds < 4.0
        for r in ranks:
            assert r.busy_seconds + r.collective_wait_seconds == pytest.approx(r.step_seconds)
            assert r.node == topo.nodes[topo.nodes.index(r.node)] and r.local_gpu == r.rank % 8


def test_checkpoint_makes_one_long_step_without_traffic():
    topo = small_topology()
    jobs = [Job("ck", tuple(topo.nodes[:3]), step_compute_s=0.5, step_comm_s=0.3, checkpoint_every_s=100,
                since_checkpoint_s=97, checkpoint_s=12)]
    rec = Recorder(ClusterSimulator(topo, seed=1, start_unix_ns=START, jobs=jobs), 25)
    tx = rec.rate(topo.nodes[0], "mlx5_0/1", "port_xmit_data")
    assert sum(1 for x in tx if x * 32 < 1e9) >= 8          # ~12 s of (near) silence
    steps = defaultdict(list)
    for r in rec.rank_steps():
        steps[r.step].append(r)
    longest = max(steps.values(), key=lambda rs: rs[0].step_seconds)
    assert longest[0].step_seconds > 12
    assert min(r.busy_seconds for r in longest) > 11            # every rank saved


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
