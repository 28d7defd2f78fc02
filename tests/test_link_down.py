"""link_down: a link that stays down, apart from flaps, downgrades and operators' shutdowns."""
import math

import numpy as np
import pytest

from fabricwatch.models.findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING
from fabricwatch.models.frames import EntityFrame, SourceBatch, SourceView
from fabricwatch.models.link_down import LINK_DOWN_HOLD_S, LinkDownDetector
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDown, LinkFlap, NicAdminDown, SwitchLinkDown
from fabricwatch.simulator.host_faults import NodeReboot
from fabricwatch.streams.pipeline import DetectionPipeline

UP, DOWN = "4: ACTIVE", "1: DOWN"
IDS = tuple(f"mlx5_{k}/1" for k in range(4))


def nic(t_s, states, speed=None, tx=None, phys=None, source="node-0001"):
    """One full NIC tick: ``state`` labels, ``netdev_speed_mbps``, transmit bytes/s as rates."""
    n = len(states)
    speed = [(-1.0 if s != UP else 400000.0) for s in states] if speed is None else speed
    phys = phys or ["5: LinkUp" if s == UP else "2: Polling" for s in states]
    f = EntityFrame("nic_port", IDS[:n], ("port_xmit_data",), np.zeros((n, 1), np.uint64), ("netdev_speed_mbps",),
                    np.array(speed, dtype=float).reshape(n, 1),
                    [{"state": s, "phys_state": p} for s, p in zip(states, phys)])
    f.rates, f.dt_s = np.array(tx if tx is not None else [0.0] * n, dtype=float).reshape(n, 1), 1.0
    return SourceView("c1", source, "node", int(t_s * 1e9), 0, [f])


def pfc_only(t_s, n=4, source="node-0001"):
    """A PFC-only tick: counters, no ``state`` label."""
    f = EntityFrame("nic_port", IDS[:n], ("rx_prio3_pause",), np.zeros((n, 1), np.uint64), (), np.empty((n, 0)),
                    {"netdev": [f"eth{k}" for k in range(n)]})
    return SourceView("c1", source, "node", int(t_s * 1e9), 0, [f])


def switch(t_s, oper, admin, source="spine-0", ports=("Ethernet1", "Ethernet2")):
    g = np.array([oper, admin], dtype=float).T
    f = EntityFrame("switch_port", ports, (), np.zeros((len(ports), 0), np.uint64), ("oper_up", "admin_up"), g, {})
    return SourceView("c1", source, "switch", int(t_s * 1e9), 0, [f])


def run(det, views, batches=True):
    """Through `update_batch` (its quiet path); ``batches=False``: tick by tick, with the rates."""
    if not batches:
        return [f for v in views for f in det.update(v)]
    return [f for v in views for f in det.update_batch(SourceBatch.of_views([v]))]


def test_a_port_down_for_the_hold_opens_critical_and_resolves_after_the_up_hold():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4)] + [nic(t, [UP, DOWN, UP, UP]) for t in range(1, 32)] + \
            [nic(t, [UP] * 4) for t in range(32, 45)]
    out = run(det, views)
    assert [(f.state, f.entity.path(), f.severity) for f in out] == [
        (OPEN, "c1/node-0001/mlx5_1/1", CRITICAL), (RESOLVED, "c1/node-0001/mlx5_1/1", CRITICAL)]
    opened, resolved = out
    assert opened.detected_ns - opened.onset_ns >= LINK_DOWN_HOLD_S * 1e9
    assert opened.onset_ns == 1_000_000_000
    assert resolved.detected_ns == 42_000_000_000                  # up at 32 s, 10 s up hold
    assert opened.evidence[0].name == "down_for_s"


def test_a_flap_length_down_and_a_bounce_are_not_link_down():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4)] + [nic(t, [DOWN, UP, UP, UP]) for t in range(1, 6)] + [nic(6, [UP] * 4)]
    views += [nic(t, [DOWN, UP, UP, UP]) for t in range(7, 30)] + [nic(30, [UP] * 4)]   # 23 s < hold
    assert run(det, views) == []


def test_ticks_without_the_state_column_neither_break_nor_resolve():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4)]
    for t in range(1, 33):
        views += [pfc_only(t - 0.5), nic(t, [DOWN, UP, UP, UP])]
    out = run(det, views)
    assert [f.state for f in out] == [OPEN]
    out = run(det, [pfc_only(33 + 0.1 * k) for k in range(200)])   # 20 s of PFC-only ticks
    assert out == []


def test_a_gap_in_the_samples_restarts_the_hold():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4), nic(1, [DOWN, UP, UP, UP]), nic(25, [DOWN, UP, UP, UP]), nic(33, [DOWN, UP, UP, UP])]
    assert run(det, views) == []          # 24 s without a sample: the down is known from 25 s only


def test_a_port_never_seen_up_is_not_expected_up_without_a_topology():
    det = LinkDownDetector()
    assert run(det, [nic(t, [UP, UP, UP, DOWN]) for t in range(0, 60)]) == []


def test_a_port_in_the_topology_is_expected_up_from_the_first_sample():
    topo = rail_optimised("c1", n_nodes=2, nodes_per_unit=2, n_spines=2, gpus_per_node=4)
    det = LinkDownDetector(topo)
    out = run(det, [nic(t, [UP, UP, UP, DOWN]) for t in range(0, 40)])
    assert [(f.state, f.entity.path()) for f in out] == [(OPEN, "c1/node-0001/mlx5_3/1")]
    leaf = topo.nic("node-0001", "mlx5_3/1")
    assert {r.path() for r in out[0].related} == {f"c1/{leaf.switch}/{leaf.switch_port}", "c1/node-0001/gpu3"}
    assert [e.value for e in out[0].evidence if e.name == "gpu_index"] == [3.0]


def test_a_nic_shut_on_its_host_is_no_fault():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4)] + [nic(t, [UP, DOWN, UP, UP], speed=[4e5, math.nan, 4e5, 4e5],
                                      phys=["5: LinkUp", "3: Disabled", "5: LinkUp", "5: LinkUp"])
                                  for t in range(1, 100)]
    assert run(det, views) == []


def test_a_dead_nic_with_disabled_phys_state_but_no_carrier_is_a_fault():
    det = LinkDownDetector()   # speed -1: the interface runs, there is no carrier
    views = [nic(0, [UP] * 4)] + [nic(t, [UP, DOWN, UP, UP], phys=["5: LinkUp", "3: Disabled", "5: LinkUp",
                                                                     "5: LinkUp"]) for t in range(1, 35)]
    assert [f.state for f in run(det, views)] == [OPEN]


def test_failover_to_a_sibling_that_carries_two_rails_is_a_warning_with_the_sibling_as_evidence():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4, tx=[10e9] * 4)]
    views += [nic(t, [UP, DOWN, UP, UP], tx=[10e9, 0.0, 10e9, 10e9]) for t in range(1, 9)]       # NCCL retrying
    views += [nic(t, [UP, DOWN, UP, UP], tx=[20e9, 0.0, 10e9, 10e9]) for t in range(9, 60)]      # moved to mlx5_0
    out = run(det, views, batches=False)
    assert [(f.state, f.severity) for f in out] == [(OPEN, WARNING)]
    ev = {e.name: e for e in out[0].evidence}
    assert "mlx5_0/1" in ev["failover_nic"].detail and 1.6 <= ev["failover_nic"].value <= 2.0
    assert "failed over" in out[0].summary


def test_a_hung_node_is_critical_until_a_late_failover_makes_it_a_warning():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4, tx=[10e9] * 4), nic(1, [UP, DOWN, UP, UP], tx=[5e9, 0.0, 5e9, 5e9])]
    views += [nic(t, [UP, DOWN, UP, UP], tx=[0.0] * 4) for t in range(2, 40)]          # the collective blocks
    views += [nic(t, [UP, DOWN, UP, UP], tx=[10e9, 0.0, 20e9, 10e9]) for t in range(40, 80)]
    out = run(det, views, batches=False)
    assert [(f.state, f.severity) for f in out] == [(OPEN, CRITICAL), (UPDATE, WARNING)]
    assert "failover_nic" in {e.name for e in out[1].evidence}


def test_traffic_spread_over_the_other_rails_is_a_warning():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4, tx=[10e9] * 4)]
    views += [nic(t, [UP, DOWN, UP, UP], tx=[13e9, 0.0, 13e9, 13e9]) for t in range(1, 40)]
    out = run(det, views, batches=False)
    assert [(f.state, f.severity) for f in out] == [(OPEN, WARNING)]
    assert {e.name for e in out[0].evidence} >= {"failover_spread"}


def test_uneven_traffic_or_an_idle_node_is_no_failover():
    det = LinkDownDetector()
    views = [nic(0, [UP] * 4, tx=[1e6] * 4)] + [nic(t, [UP, DOWN, UP, UP], tx=[3e6, 0, 1e6, 1e6]) for t in range(1, 40)]
    assert [f.severity for f in run(det, views, batches=False)] == [CRITICAL]   # the other rails carry ~nothing


def test_switch_link_down_with_admin_up_opens_admin_down_never():
    det = LinkDownDetector()
    views = [switch(0, [1, 1], [1, 1])] + [switch(t, [0, 0], [1, 0]) for t in range(1, 40)]
    out = run(det, views)
    assert [(f.state, f.entity.path(), f.severity) for f in out] == [(OPEN, "c1/spine-0/Ethernet1", WARNING)]
    assert run(det, [switch(t, [1, 0], [1, 0]) for t in range(40, 60)])[0].state == RESOLVED


def test_nan_and_missing_gauges_say_nothing():
    det = LinkDownDetector()
    views = [switch(0, [1, 1], [1, 1])] + [switch(t, [math.nan, 1], [math.nan, 1]) for t in range(1, 60)]
    assert run(det, views) == []
    det = LinkDownDetector()
    assert run(det, [nic(t, ["", "", "", ""]) for t in range(60)]) == []


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        LinkDownDetector(hold_s=0)


# -- simulated telemetry through the pipeline -------------------------------------------------------

def simulate(faults, seconds, seed=4):
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=seed, faults=faults)
    pipeline = DetectionPipeline(topology=topo)
    found = [f for snaps in sim.run(seconds) for snap in snaps for f in pipeline.process(snap)]
    return topo, sim, [f for f in found if f.kind in ("link_down", "link_flap")]


@pytest.mark.slow
def test_simulated_dead_nic_link_with_failover_names_the_pcie_sibling():
    _, sim, out = simulate([LinkDown("node-0003", "mlx5_2/1", onset_s=20.5, offset_s=100.5)], seconds=120)
    nic = "c1/node-0003/mlx5_2/1"
    assert [(f.kind, f.state, f.entity.path(), f.severity) for f in out] == [
        ("link_down", OPEN, nic, WARNING), ("link_down", RESOLVED, nic, WARNING)]
    ev = {e.name: e for e in out[0].evidence}
    assert ev["failover_nic"].detail.startswith("mlx5_3/1")
    assert sim.ground_truth()[0].detail["failover_nic"] == "mlx5_3/1"
    assert 50.0 <= (out[0].detected_ns - sim.start_unix_ns) / 1e9 <= 53.0


@pytest.mark.slow
def test_simulated_dead_nic_link_without_failover_is_critical_and_no_flap():
    _, _, out = simulate([LinkDown("node-0003", "mlx5_2/1", onset_s=20.5, offset_s=80.5, failover=False)], seconds=110)
    assert [(f.kind, f.state, f.severity) for f in out] == [("link_down", OPEN, CRITICAL),
                                                              ("link_down", RESOLVED, CRITICAL)]


def test_simulated_dead_uplink_opens_on_both_ends():
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    up = next(link for link in topo.links if link.a_switch.startswith("leaf"))
    _, _, out = simulate([SwitchLinkDown(up.a_switch, up.a_port, onset_s=10.5)], seconds=50)
    assert {(f.kind, f.state, f.entity.path()) for f in out} == {
        ("link_down", OPEN, f"c1/{up.a_switch}/{up.a_port}"), ("link_down", OPEN, f"c1/{up.b_switch}/{up.b_port}")}


@pytest.mark.slow
def test_operators_reboots_and_flaps_are_not_link_down():
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    leaf = topo.nic("node-0005", "mlx5_4/1")
    up = next(link for link in topo.links if link.a_switch.startswith("leaf"))
    faults = [AdminToggle(leaf.switch, leaf.switch_port, onset_s=10.5, down_s=90.0),
              AdminToggle(up.a_switch, up.a_port, onset_s=12.5, down_s=90.0),
              NicAdminDown("node-0002", "mlx5_1/1", onset_s=11.5, down_s=80.0),
              NodeReboot("node-0007", onset_s=15.0, down_s=60.0),
              LinkFlap("node-0004", "mlx5_6/1", onset_s=20.5, down_s=3.0)]
    _, _, out = simulate(faults, seconds=130)
    flapped = topo.nic("node-0004", "mlx5_6/1")
    assert {(f.kind, f.entity.path()) for f in out if f.state == OPEN} == {
        ("link_flap", "c1/node-0004/mlx5_6/1"), ("link_flap", f"c1/{flapped.switch}/{flapped.switch_port}")}


@pytest.mark.slow
def test_simulated_link_that_lost_codewords_before_dying_says_so():
    _, _, out = simulate([LinkDown("node-0003", "mlx5_2/1", onset_s=40.5, fec_warning_s=20.0)], seconds=80)
    opened = [f for f in out if f.state == OPEN]
    assert [f.kind for f in opened] == ["link_down"]
    ev = {e.name: e.value for e in opened[0].evidence}
    assert ev["fec_uncorrectable"] >= 20


def test_healthy_links_correct_codewords_and_lose_none():
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=2)
    first, last = sim.tick(), sim.run(20)[-1]
    def fec(snaps, name):
        out = []
        for s in snaps:
            for b in s.blocks:
                if name in b.counter_names:
                    m = np.array(b.counters).reshape(len(b.entity_ids), -1)
                    out += m[:, list(b.counter_names).index(name)].tolist()
        return np.array(out, dtype=float)
    corrected = fec(last, "in-fec-correctable-frames") - fec(first, "in-fec-correctable-frames")
    lost = fec(last, "in-fec-uncorrectable-frames") - fec(first, "in-fec-uncorrectable-frames")
    assert (corrected > 0).mean() > 0.9 and (lost > 0).mean() < 0.1
    _, _, out = simulate([], seconds=40)
    assert out == []


@pytest.mark.slow
def test_at_the_collectors_real_cadence_pfc_only_ticks_change_nothing():
    from fabricwatch.simulator.encoding import COLLECTOR_CADENCE
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, cadence=COLLECTOR_CADENCE,
                           faults=[LinkDown("node-0002", "mlx5_5/1", onset_s=10.55, offset_s=60.55)])
    pipeline = DetectionPipeline(topology=topo)
    found = [f for snaps in sim.run(80.0) for snap in snaps for f in pipeline.process(snap)]
    mine = [(f.state, f.entity.path()) for f in found if f.kind in ("link_down", "link_flap")]
    assert mine == [(OPEN, "c1/node-0002/mlx5_5/1"), (RESOLVED, "c1/node-0002/mlx5_5/1")]
    opened = next(f for f in found if f.kind == "link_down")
    assert 40.0 <= (opened.detected_ns - sim.start_unix_ns) / 1e9 <= 43.0


# -- the simulator's phenomena --------------------------------------------------------------------

def _nic_block(snaps, node):
    snap = next(s for s in snaps if s.source == node)
    b = next(b for b in snap.blocks if "state" in {c.name for c in b.labels})
    counters = np.array(b.counters, dtype=float).reshape(len(b.entity_ids), -1)
    gauges = np.array(b.gauges, dtype=float).reshape(len(b.entity_ids), -1)
    labels = {c.name: list(c.values) for c in b.labels}
    return (list(b.entity_ids), counters[:, list(b.counter_names).index("port_xmit_data")] * 4,
            gauges[:, list(b.gauge_names).index("netdev_speed_mbps")], labels)


def test_simulator_failover_sibling_carries_two_rails_and_no_failover_stalls_the_job():
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=1, faults=[LinkDown("node-0002", "mlx5_4/1", onset_s=5.5)])
    ticks = sim.run(40)
    ids, before, _, _ = _nic_block(ticks[9], "node-0002")
    _, after, speed, labels = _nic_block(ticks[-1], "node-0002")
    sent = after - before
    k, sib = ids.index("mlx5_4/1"), ids.index("mlx5_5/1")
    others = np.median([sent[j] for j in range(len(ids)) if j not in (k, sib)])
    assert sent[k] == 0 and 1.8 <= sent[sib] / others <= 2.2
    assert labels["state"][k] == DOWN and labels["phys_state"][k] == "2: Polling" and speed[k] == -1
    assert sim.ground_truth()[0].detail["failover_nic"] == "mlx5_5/1"

    def steps(faults):
        run = ClusterSimulator(topo, seed=1, faults=faults)
        run.run(10)
        return sum(len(s.rank_steps) for snaps in run.run(30) for s in snaps if s.source == "node-0002")
    assert steps([]) > 0
    assert steps([LinkDown("node-0002", "mlx5_4/1", onset_s=5.5, failover=False)]) == 0     # the job hangs
    assert steps([LinkDown("node-0002", "mlx5_4/1", onset_s=5.5)]) > 0                      # it runs on, slower


def test_simulator_nic_shut_on_host_reads_disabled_without_speed():
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=1, faults=[NicAdminDown("node-0003", "mlx5_1/1", onset_s=2.5, down_s=10.0)])
    ids, _, speed, labels = _nic_block(sim.run(5)[-1], "node-0003")
    k = ids.index("mlx5_1/1")
    assert labels["phys_state"][k] == "3: Disabled" and math.isnan(speed[k])
    assert sim.ground_truth()[0].expect_alert is False


def test_one_fec_memory_shared_by_the_link_detectors_counts_a_record_once():
    from fabricwatch.models.fec import FecMemory
    from fabricwatch.models.frames import FrameStack
    from fabricwatch.models.link_downgrade import LinkDowngradeDetector
    from fabricwatch.models.link_flap import LinkFlapDetector
    fec = FecMemory()
    detectors = [LinkDowngradeDetector(fec=fec), LinkFlapDetector(fec=fec), LinkDownDetector(fec=fec)]
    for t in (1, 2):
        s = FrameStack("nic_port", ("mlx5_0/1",), ("rx_pcs_symbol_err_phy", "rx_corrected_bits_phy", "rx_bits_phy"),
                       (), np.array([0]), np.zeros((1, 1, 3), np.uint64), np.empty((1, 1, 0)))
        s.rates, s.dt_s = np.array([[[2.0, 1e7, 4e11]]]), np.array([1.0])   # healthy BER 2.5e-5, 2 lost
        batch = SourceBatch("c1", "node-1", "node", np.array([t * 1_000_000_000]), [s])
        for d in detectors:
            d.update_batch(batch)
    assert [(e.name, e.value) for e in fec.evidence("node-1", "mlx5_0/1", 3_000_000_000)] == [("fec_uncorrectable", 4.0)]
    assert fec.evidence("node-1", "mlx5_0/1", 700_000_000_000) == []              # forgotten after the memory
