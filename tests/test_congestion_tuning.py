"""ecn_pfc_misorder and lossless_drop: the rules, the simulator's faults, and the pipeline end to end."""
import numpy as np
import pytest

from fabricwatch.models import ecn_pfc_misorder as emo
from fabricwatch.models import lossless_drop as ldm
from fabricwatch.models.ecn_pfc_misorder import EcnPfcMisorderDetector
from fabricwatch.models.findings import OPEN, RESOLVED
from fabricwatch.models.frames import FrameStack, SourceBatch
from fabricwatch.models.lossless_drop import LosslessDropDetector
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import EcnAfterPause, Incast, LinkFlap, NicLosslessDrops, QueueDrops
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import replay

SW = ("pfc3-tx-pkts", "queue3-ecn-marked-pkts", "pfc3-rx-pause-duration-us")


def sw_tick(source, t_s, values, names=SW, ports=("Ethernet0", "Ethernet1"), gauges=(), gauge_values=None,
            kind="switch_port", source_kind="switch"):
    """One tick of ``source``: ``values[port][counter]`` as rates (per second), dt 1 s."""
    n, m = len(ports), len(names)
    g = np.array(gauge_values, float).reshape(1, n, len(gauges)) if gauges else np.empty((1, n, 0))
    s = FrameStack(kind, tuple(ports), tuple(names), tuple(gauges), np.array([0]), np.zeros((1, n, m), np.uint64), g)
    s.rates, s.dt_s = np.array(values, float).reshape(1, n, m), np.array([1.0])
    return SourceBatch("c1", source, source_kind, np.array([int(t_s * 1e9)]), [s])


def drive(det, seconds, per_switch):
    """``per_switch[name](t) -> values`` every second; every finding."""
    out = []
    for t in range(1, seconds + 1):
        for name, values in per_switch.items():
            out += det.update_batch(sw_tick(name, t, values(t)))
    return out


def healthy(t):           # two sender ports pause, the receiver's port marks ten times as many packets first
    return [[10_000, 0, 0.0], [10_000, 200_000, 0.0]]


def misordered(t):
    return [[10_000, 10, 0.0], [10_000, 50, 0.0]]


# ---------------------------------------------------------------- ecn_pfc_misorder

def test_a_switch_that_pauses_without_marking_opens_against_peers_that_mark():
    det = EcnPfcMisorderDetector()
    out = drive(det, 61, {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy, "leaf-4": misordered})
    assert [(f.kind, f.state, f.entity.switch, f.entity.device) for f in out] == [
        ("ecn_pfc_misorder", OPEN, "leaf-4", "queue3")]
    f = out[0]
    ev = {e.name: e for e in f.evidence}
    assert ev["ecn_marks_per_pause_frame"].value == pytest.approx(60 / 20_000, rel=1e-3)
    assert ev["peer_ecn_marks_per_pause_frame"].value == pytest.approx(200_000 / 20_000, rel=1e-3)
    assert "lower the ECN (WRED) min/max marking thresholds of queue 3 on leaf-4" in f.suggested_action
    assert "XOFF" in f.suggested_action and "Ethernet0" in f.suggested_action
    assert f.cause == "ecn_threshold_above_xoff" and f.related[0].port == "Ethernet0"   # the most pauses


def test_it_resolves_once_the_switch_marks_again():
    det = EcnPfcMisorderDetector()
    peers = {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy}
    out = drive(det, 61, {**peers, "leaf-4": misordered})
    out += [f for t in range(62, 110) for name, v in {**peers, "leaf-4": healthy}.items()
            for f in det.update_batch(sw_tick(name, t, v(t)))]
    assert [f.state for f in out] == [OPEN, RESOLVED]


def test_no_incast_no_evidence_and_marks_first_is_healthy():
    det = EcnPfcMisorderDetector()
    quiet = lambda t: [[10, 0, 0.0], [10, 0, 0.0]]         # a few stray pauses, no marks at all
    out = drive(det, 200, {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy, "leaf-4": quiet})
    assert out == []


def test_back_pressure_from_a_paused_peer_is_no_evidence():
    det = EcnPfcMisorderDetector()
    held = lambda t: [[10_000, 50, 0.0], [10_000, 10, 0.5]]  # a port is held half the time (a storm next door)
    assert drive(det, 200, {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy, "spine-0": held}) == []


def test_within_an_order_of_magnitude_of_healthy_peers_is_like_them():
    det = EcnPfcMisorderDetector()
    peer = lambda t: [[10_000, 40_000, 0.0], [10_000, 0, 0.0]]     # 2 marks per pause
    low = lambda t: [[10_000, 16_000, 0.0], [10_000, 0, 0.0]]      # 0.8: under the floor, but like the peers
    assert drive(det, 200, {"leaf-1": peer, "leaf-2": peer, "leaf-3": peer, "leaf-4": low}) == []


def test_an_order_of_magnitude_under_healthy_peers_opens_above_the_floor_too():
    det = EcnPfcMisorderDetector()
    high = lambda t: [[10_000, 0, 0.0], [10_000, 300_000, 0.0]]     # 15 marks per pause
    late = lambda t: [[10_000, 0, 0.0], [10_000, 24_000, 0.0]]      # 1.2: over the floor, 12x under its peers
    out = drive(det, 61, {"leaf-1": high, "leaf-2": high, "leaf-3": high, "leaf-4": late})
    assert [(f.state, f.entity.switch) for f in out] == [(OPEN, "leaf-4")]


def test_a_fleet_that_all_marks_late_is_judged_on_the_floor():
    det = EcnPfcMisorderDetector()
    out = drive(det, 61, {f"leaf-{k}": misordered for k in range(1, 5)})
    assert sorted(f.entity.switch for f in out) == ["leaf-1", "leaf-2", "leaf-3", "leaf-4"]


def test_a_lone_switch_is_judged_on_the_dcqcn_floor_alone():
    det = EcnPfcMisorderDetector()
    out = drive(det, 61, {"leaf-4": misordered})
    assert [(f.state, f.confidence) for f in out] == [(OPEN, 0.7)]
    assert "no peers" in f"{out[0].summary}"


def test_a_chance_window_does_not_persist():
    det = EcnPfcMisorderDetector()
    flicker = lambda t: misordered(t) if (t - 1) // 10 % 3 != 2 else healthy(t)   # two bad windows, one good
    assert drive(det, 300, {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy, "leaf-4": flicker}) == []
    assert emo.PERSIST_WINDOWS == 3


def test_one_port_carrying_the_pauses_is_a_storm_not_incast():
    det = EcnPfcMisorderDetector()
    storm = lambda t: [[24_000, 10, 0.0], [2_000, 50, 0.0]]       # one port pauses continuously (pfc_storm's)
    assert drive(det, 200, {"leaf-1": healthy, "leaf-2": healthy, "leaf-3": healthy, "leaf-4": storm}) == []
    assert emo.MAX_TOP_PORT_SHARE == 0.5


def test_the_exported_pause_duration_counts_as_pausing():
    det = EcnPfcMisorderDetector()
    names = ("pfc3-tx-pkts", "queue3-ecn-marked-pkts", "pfc3-tx-pause-duration-us")
    # few (long) pause frames, but each port paused 5 % of the time, and hardly any marks
    slow = [[300, 1, 0.05], [300, 1, 0.05]]
    out = [f for t in range(1, 62) for f in det.update_batch(sw_tick("leaf-4", t, slow, names=names))]
    assert [f.state for f in out] == [OPEN]
    det = EcnPfcMisorderDetector()
    rare = [[300, 1, 0.001], [300, 1, 0.001]]
    assert [f for t in range(1, 62) for f in det.update_batch(sw_tick("leaf-4", t, rare, names=names))] == []


def test_without_the_counters_nothing_is_read():
    det = EcnPfcMisorderDetector()
    out = [f for t in range(1, 100) for f in det.update_batch(sw_tick("leaf-1", t, [[20_000], [0]],
                                                                            names=("pfc3-tx-pkts",)))]
    assert out == []


# ---------------------------------------------------------------- lossless_drop

DROPS = ("queue3-dropped-pkts", "queue0-dropped-pkts", "interface-transitions")


def drops(det, seconds, values, start=1, gauges=(), gauge_values=None):
    return [f for t in range(start, start + seconds)
            for f in det.update_batch(sw_tick("leaf-1", t, values(t), names=DROPS, gauges=gauges,
                                              gauge_values=gauge_values(t) if gauge_values else None))]


def test_lossless_drops_on_a_live_port_open_and_name_the_headroom():
    det = LosslessDropDetector()
    out = drops(det, 30, lambda t: [[0, 100, 0], [2 if t > 12 else 0, 0, 0]])
    assert [(f.kind, f.state, f.entity.switch, f.entity.port, f.entity.device) for f in out] == [
        ("lossless_drop", OPEN, "leaf-1", "Ethernet1", "queue3")]
    assert "PG headroom (xoff size)" in out[0].suggested_action and "priority 3" in out[0].suggested_action
    assert out[0].evidence[0].value > 0 and out[0].cause == "headroom_misconfig"
    out = drops(det, 6 * 10 + 5, lambda t: [[0, 0, 0], [0, 0, 0]], start=31)
    assert [(f.state, f.entity.port) for f in out] == [(RESOLVED, "Ethernet1")]


def test_lossy_drops_and_drops_with_a_link_event_are_the_links_or_normal():
    det = LosslessDropDetector()
    assert drops(det, 60, lambda t: [[0, 500, 0], [0, 500, 0]]) == []          # queue 0: lossy
    flap = lambda t: [[0, 0, 0], [10 if t in (70, 71, 90) else 0, 0, 2 if t == 70 else 0]]
    assert drops(det, 60, flap, start=61) == []                                 # with, then 20 s after, the flap
    down = lambda t: [[0, 0, 0], [10, 0, 0]]
    assert drops(det, 20, down, start=121, gauges=("oper_up",), gauge_values=lambda t: [[1], [0]]) == []


def test_nic_lossless_discards_open_with_the_mlnx_qos_hint():
    det = LosslessDropDetector()
    names = ("rx_prio3_buf_discard", "rx_prio0_discards", "link_down_events_phy")
    tick = lambda t, v: sw_tick("node-0001", t, v, names=names, ports=("mlx5_0/1", "mlx5_1/1"), kind="nic_port",
                                source_kind="node")
    out = [f for t in range(1, 30) for f in det.update_batch(tick(t, [[3, 50, 0], [0, 50, 0]]))]
    assert [(f.entity.node, f.entity.device, f.entity.port) for f in out] == [("node-0001", "mlx5_0", "1")]
    assert "mlnx_qos" in out[0].suggested_action
    det = LosslessDropDetector()
    assert [f for t in range(1, 30) for f in det.update_batch(tick(t, [[3, 0, 1 if t == 1 else 0], [0, 0, 0]]))
            if t < 30] == []           # the first window holds a link down: its drops are the link's


def test_the_lossless_priorities_and_thresholds_are_named():
    assert ldm.LOSSLESS_PRIORITIES == emo.LOSSLESS_PRIORITIES == (3, 4)
    assert ldm.MIN_DROPPED_PKTS == 1.0 and ldm.LINK_EVENT_GRACE_S >= ldm.WINDOW_S


# ---------------------------------------------------------------- simulator

def _sim(faults, seed=2, n=8):
    topo = rail_optimised("sim", n_nodes=n, nodes_per_unit=n, n_spines=2)
    return ClusterSimulator(topo, seed=seed, interval_s=1.0, faults=faults)


def _switch_totals(snaps, switch, name):
    for s in snaps:
        if s.source == switch:
            block = s.blocks[0]
            j = list(block.counter_names).index(name)
            return np.array(block.counters, dtype=np.uint64).reshape(len(block.entity_ids), -1)[:, j].astype(float)
    raise AssertionError(switch)


def test_simulator_misordered_leaf_marks_a_hundredth_and_drops_where_told():
    sim = _sim([EcnAfterPause("leaf-u0-r2", onset_s=5.0, incast=0.5), Incast("leaf-u0-r3", onset_s=5.0),
                QueueDrops("leaf-u0-r4", "Ethernet1", onset_s=5.0, drops_per_s=40.0)])
    first = sim.run(5)[-1]
    last = sim.run(30)[-1]
    marks = {sw: (_switch_totals(last, sw, "queue3-ecn-marked-pkts") - _switch_totals(first, sw, "queue3-ecn-marked-pkts")).sum()
             for sw in ("leaf-u0-r2", "leaf-u0-r3")}
    assert marks["leaf-u0-r2"] < 0.05 * marks["leaf-u0-r3"]
    dropped = _switch_totals(last, "leaf-u0-r4", "queue3-dropped-pkts") - _switch_totals(first, "leaf-u0-r4",
                                                                                        "queue3-dropped-pkts")
    assert 800 < dropped[1] < 1600 and dropped[[0, 2, 3]].sum() == 0
    kinds = {(g.kind, g.entity, g.expect_alert) for g in sim.ground_truth()}
    assert kinds == {("ecn_pfc_misorder", "leaf-u0-r2", True), ("incast", "leaf-u0-r3", False),
                     ("lossless_drop", "leaf-u0-r4/Ethernet1", True)}


def test_simulator_nic_discards_on_priority_3_and_at_its_link_flap():
    sim = _sim([NicLosslessDrops("node-0002", "mlx5_1/1", onset_s=5.0, drops_per_s=30.0),
                LinkFlap("node-0003", "mlx5_0/1", onset_s=10.5, down_s=2.0)])
    def discards(snaps, node):
        s = next(x for x in snaps if x.source == node)
        nic = s.blocks[1]
        j = list(nic.counter_names).index("rx_prio3_buf_discard")
        return np.array(nic.counters, dtype=float).reshape(len(nic.entity_ids), -1)[:, j]
    first = sim.run(5)[-1]
    last = sim.run(20)[-1]
    d2 = discards(last, "node-0002") - discards(first, "node-0002")
    d3 = discards(last, "node-0003") - discards(first, "node-0003")
    assert 400 < d2[1] < 800 and d2[[0, 2, 3, 4, 5, 6, 7]].sum() == 0
    assert d3[0] > 0 and d3[1:].sum() == 0                    # the frames in flight as the link went down
    assert [(g.kind, g.entity) for g in sim.ground_truth()][0] == ("lossless_drop", "node-0002/mlx5_1/1")


def test_simulator_refuses_unknown_switches_and_labels_the_negatives():
    with pytest.raises(ValueError):
        _sim([EcnAfterPause("leaf-9", onset_s=1.0)])
    with pytest.raises(ValueError):
        _sim([QueueDrops("leaf-u0-r1", "Ethernet99", onset_s=1.0)])
    with pytest.raises(ValueError):
        QueueDrops("leaf-u0-r1", "Ethernet1", onset_s=1.0, priority=5)
    truth = _sim([EcnAfterPause("leaf-u0-r1", onset_s=1.0, quiet=True),
                  QueueDrops("leaf-u0-r1", "Ethernet1", onset_s=1.0, priority=0)]).ground_truth()
    assert [g.expect_alert for g in truth] == [False, False]


# ---------------------------------------------------------------- end to end (replay through the real stages)

def test_pipeline_names_the_misordered_leaf_and_the_dropping_port_and_not_the_negatives():
    topo = rail_optimised("sim", n_nodes=8, nodes_per_unit=8, n_spines=2)
    faults = [EcnAfterPause("leaf-u0-r2", onset_s=5.3, incast=0.5), Incast("leaf-u0-r3", onset_s=5.3),
              EcnAfterPause("leaf-u0-r5", onset_s=5.3, quiet=True),
              QueueDrops("leaf-u0-r4", "Ethernet1", onset_s=20.3), QueueDrops("leaf-u0-r4", "Ethernet2", onset_s=20.3,
                                                                              priority=0, drops_per_s=300.0),
              LinkFlap("node-0004", "mlx5_4/1", onset_s=30.3, down_s=2.0)]
    sim = ClusterSimulator(topo, seed=5, interval_s=1.0, faults=faults)
    pipeline = DetectionPipeline(topology=topo)
    events = []
    for k in range(4):
        events += replay([s for _ in range(20) for s in sim.tick()], pipeline, finish=k == 3).events
    opened = sorted({(e.kind, e.entity.switch, e.entity.port) for e in events if e.lifecycle == 1
                     and e.kind in ("ecn_pfc_misorder", "lossless_drop")})
    assert opened == [("ecn_pfc_misorder", "leaf-u0-r2", ""), ("lossless_drop", "leaf-u0-r4", "Ethernet1")]
    hint = next(e for e in events if e.kind == "ecn_pfc_misorder")
    assert "leaf-u0-r2" in hint.suggested_action and "XOFF" in hint.suggested_action
