"""Link and PCIe downgrade rule, through the detection pipeline (no Kafka)."""
import time

from helpers import gpu_block, nic_snapshot

from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.pipeline import DetectionPipeline

S = 10**9
T0 = time.time_ns()


def run(snapshots, topology=None):
    p = DetectionPipeline(topology=topology)
    return [(f.kind, f.state, f.entity.path(), f.severity) for s in snapshots for f in p.process(s)]


def test_healthy_ports_raise_nothing():
    assert run([nic_snapshot(t_ns=T0 + i * S, seq=i) for i in range(5)]) == []


def test_speed_downgrade_opens_on_first_sample_and_resolves():
    snaps = [nic_snapshot(t_ns=T0, seq=1),
             nic_snapshot(t_ns=T0 + S, seq=2, rates={3: "200 Gb/sec (4X HDR)"}),
             nic_snapshot(t_ns=T0 + 2 * S, seq=3, rates={3: "200 Gb/sec (4X HDR)"}),
             nic_snapshot(t_ns=T0 + 3 * S, seq=4)]
    assert run(snaps) == [("link_downgrade", "open", "c1/node-0001/mlx5_3/1", "critical"),
                          ("link_downgrade", "resolved", "c1/node-0001/mlx5_3/1", "critical")]


def test_lane_change_at_same_speed_is_a_downgrade():
    out = run([nic_snapshot(t_ns=T0, rates={0: "400 Gb/sec (8X HDR)"})])
    assert out == [("link_downgrade", "open", "c1/node-0001/mlx5_0/1", "warning")]


def test_port_down_is_not_a_downgrade():
    assert run([nic_snapshot(t_ns=T0, rates={i: "40 Gb/sec (4X QDR)" for i in range(8)}, state="1: DOWN")]) == []


def test_fleet_consensus_without_topology():
    # A 200G fleet with the default nominal of 400G: consensus wins, no false alarms.
    snaps = [nic_snapshot(source=f"node-{n}", t_ns=T0, rates={i: "200 Gb/sec (4X HDR)" for i in range(8)})
             for n in range(4)]
    assert run(snaps) == []


def test_topology_nominal_overrides_default():
    topo = rail_optimised("c1", n_nodes=2, nodes_per_unit=2, n_spines=1, nic_rate="200 Gb/sec (4X HDR)")
    snaps = [nic_snapshot(t_ns=T0, rates={i: "200 Gb/sec (4X HDR)" for i in range(8)})]
    assert run(snaps, topology=topo) == []


def test_idle_gpu_pcie_gen_drop_is_power_saving_not_a_fault():
    snap = nic_snapshot(t_ns=T0)
    gpu_block(snap, util=0.0, gen=1, gen_max=5)
    assert run([snap]) == []


def test_busy_gpu_pcie_gen_drop_is_a_downgrade():
    snap = nic_snapshot(t_ns=T0)
    gpu_block(snap, util=95.0, gen=3, gen_max=5, n=1)
    assert run([snap]) == [("pcie_downgrade", "open", "c1/node-0001/gpu0", "warning")]


def test_gpu_pcie_width_drop_counts_even_when_idle():
    snap = nic_snapshot(t_ns=T0)
    gpu_block(snap, util=0.0, width=8, width_max=16, n=1)
    assert run([snap]) == [("pcie_downgrade", "open", "c1/node-0001/gpu0", "warning")]


def test_switch_port_below_cable_nominal():
    topo = rail_optimised("c1", n_nodes=2, nodes_per_unit=2, n_spines=1)
    snap = pb.Snapshot(cluster="c1", source="leaf-u0-r0", source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=T0)
    snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, gauge_names=["port_speed_gbps", "oper_up"],
                    entity_ids=["Ethernet0",     # to node-0001, nominal 400
                                "Ethernet1",
                                "Ethernet9"],    # uncabled port: no nominal, no finding
                    gauges=[100, 1, 400, 1, 100, 1])
    assert run([snap], topology=topo) == [("link_downgrade", "open", "c1/leaf-u0-r0/Ethernet0", "critical")]


def test_duplicate_snapshot_is_skipped():
    p = DetectionPipeline()
    s = nic_snapshot(t_ns=T0, rates={0: "200 Gb/sec (4X HDR)"})
    assert len(p.process(s)) == 1
    assert p.process(s) == []
    assert p.counters()["duplicate_or_late_snapshots"] == 1
