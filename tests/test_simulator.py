"""The simulated cluster: determinism, wire format, physics of healthy telemetry.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
from helpers import Recorder, START, entity_rows, leaf_port, small_topology, two_jobs

from fabricwatch.counters import GPU_GAUGES, NIC_GAUGES, Overflow, spec_for
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.columns import GPU_COUNTERS, NIC_COUNTERS, SWITCH_COUNTERS, SWITCH_PORT_GAUGES
from fabricwatch.simulator.fabric_faults import LinkFlap
from fabricwatch.simulator.workload import Job, auto_jobs


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
