"""ecmp_imbalance: a leaf's uplinks persistently unequal; jitter, idle leaves, downed and slow uplinks stay silent."""
import numpy as np
import pytest

from fabricwatch.evaluation.matching import match
from fabricwatch.evaluation.runs import FABRICWATCH, run_scenario
from fabricwatch.evaluation.scenarios import Scenario
from fabricwatch.models.ecmp_imbalance import (
    MAX_OVER_MEAN, OPEN_WINDOWS, RESOLVE_WINDOWS, WINDOW_S, EcmpImbalanceDetector,
)
from fabricwatch.models.findings import OPEN, RESOLVED
from fabricwatch.models.frames import EntityFrame, SourceView
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.columns import _SC
from fabricwatch.simulator.fabric_faults import EcmpPolarization, SwitchLinkDown

TOPO = rail_optimised("c1", n_nodes=8, nodes_per_unit=4, n_spines=4)
LEAF = "leaf-u0-r2"
DOWN = ("Ethernet0", "Ethernet1")                      # two NIC-facing ports: never uplinks
UP = ("Ethernet4", "Ethernet5", "Ethernet6", "Ethernet7")


def tick(t_s, gbps, speed=(400.0,) * 4, oper=(1.0,) * 4, nic_gbps=(350.0, 0.0)):
    ids = DOWN + UP
    g = np.array([[400.0, 1.0]] * 2 + [[s, o] for s, o in zip(speed, oper)])
    f = EntityFrame("switch_port", ids, ("out-octets",), np.zeros((6, 1), np.uint64),
                    ("port_speed_gbps", "oper_up"), g, {})
    f.rates, f.dt_s = np.array(list(nic_gbps) + list(gbps), float)[:, None] * 1e9 / 8, 1.0
    return SourceView("c1", LEAF, "switch", int(t_s * 1e9), 0, [f])


def run(det, rates_at, seconds, t0=0):
    return [f for t in range(t0, t0 + seconds) for f in det.update(tick(t, *rates_at(t)))]


def test_polarized_uplinks_open_after_the_persistence_with_hot_and_cold_named_and_resolve():
    det = EcmpImbalanceDetector(TOPO)
    n = int(WINDOW_S) * OPEN_WINDOWS
    assert run(det, lambda t: ([200, 20, 20, 40],), n) == []          # not yet: 2 full windows judged
    opened = run(det, lambda t: ([200, 20, 20, 40],), 1, n)
    assert [(f.kind, f.state, f.entity.path()) for f in opened] == [("ecmp_imbalance", OPEN, "c1/leaf-u0-r2")]
    f = opened[0]
    ev = {e.name: e for e in f.evidence}
    assert ev["max_over_mean"].value == pytest.approx(200 / 70, rel=1e-3) and ev["max_over_mean"].threshold == MAX_OVER_MEAN
    assert ev["utilisation:Ethernet4"].value == pytest.approx(0.5)
    assert "Ethernet4 hot" in f.summary and "cold" in f.summary and "Ethernet5" in f.summary
    assert LEAF in f.suggested_action and "NCCL_IB_QPS_PER_CONNECTION" in f.suggested_action
    assert "UDP source port" in f.suggested_action and "adaptive routing" in f.suggested_action
    assert {r.path() for r in f.related} >= {"c1/leaf-u0-r2/Ethernet4", "c1/spine-0/Ethernet2"}
    balanced = run(det, lambda t: ([70, 70, 70, 70],), int(WINDOW_S) * (RESOLVE_WINDOWS + 1), n + 1)
    assert [g.state for g in balanced] == [RESOLVED]


def test_a_busy_balanced_leaf_with_jitter_stays_silent():
    rng = np.random.default_rng(7)
    det = EcmpImbalanceDetector(TOPO)
    # per-second load swings of +-50 % per uplink (bursts), balanced on average
    assert run(det, lambda t: (150 * rng.lognormal(0, 0.4, 4),), 600) == []


@pytest.mark.parametrize("offset_s", [0, 4])
def test_a_hot_spot_that_moves_from_window_to_window_is_jitter(offset_s):
    """Moving on every window; offset, each window straddles two hot uplinks (both read hot)."""
    det = EcmpImbalanceDetector(TOPO)
    def moving(t):
        rates = [30.0] * 4
        rates[((t + offset_s) // int(WINDOW_S)) % 4] = 250.0   # flows come and go, adaptive routing moves them
        return (rates,)
    assert run(det, moving, 300) == []
    # ... while a spot that stays on one uplink for three windows is polarization
    det = EcmpImbalanceDetector(TOPO)
    assert len(run(det, lambda t: ([250.0 if k == (t // 35) % 4 else 30.0 for k in range(4)],), 300)) >= 1


def test_an_idle_leaf_whose_ratios_are_noise_stays_silent():
    det = EcmpImbalanceDetector(TOPO)
    assert run(det, lambda t: ([2.0, 0.01, 0.0, 0.1],), 300) == []


def test_a_downed_uplink_or_one_trained_slow_is_not_imbalance():
    det = EcmpImbalanceDetector(TOPO)
    # Ethernet7 down (link_down's), the three others balanced
    assert run(det, lambda t: ([100, 100, 100, 0], (400.0,) * 4, (1, 1, 1, 0)),
               300) == []
    det = EcmpImbalanceDetector(TOPO)
    # Ethernet7 trained at 100G (link_downgrade's): ECMP gives it the same bytes, 4x the utilisation
    assert run(det, lambda t: ([60, 60, 60, 60], (400.0, 400.0, 400.0, 100.0)), 300) == []
    det = EcmpImbalanceDetector(TOPO)
    # ... but with the slow member left out, the three others are still judged
    assert len(run(det, lambda t: ([250, 20, 20, 60], (400.0, 400.0, 400.0, 100.0)), 300)) == 1


def test_two_imbalanced_windows_then_balance_is_not_enough_and_ports_facing_nics_are_ignored():
    det = EcmpImbalanceDetector(TOPO)
    n = int(WINDOW_S) * (OPEN_WINDOWS - 1)
    assert run(det, lambda t: ([200, 20, 20, 40],), n + 1) == []
    assert run(det, lambda t: ([70, 70, 70, 70],), 200, n + 1) == []
    # a spine, and a source the topology does not know, are no leaves: nothing judged, no crash
    det = EcmpImbalanceDetector(TOPO)
    v = tick(0, [1, 2, 3, 4])
    assert det.update(SourceView("c1", "spine-0", "switch", 0, 0, v.frames)) == []
    assert det.update(SourceView("c1", "leaf-x", "switch", 0, 0, v.frames)) == []
    assert EcmpImbalanceDetector(None).reads("switch_port", ("out-octets",), (), ()) is False
    with pytest.raises(ValueError):
        EcmpImbalanceDetector(TOPO, window_s=0)


def test_a_gap_in_the_samples_restarts_the_window():
    det = EcmpImbalanceDetector(TOPO)
    out = [f for t in range(0, 20) for f in det.update(tick(t, [200, 20, 20, 40]))]
    out += [f for t in range(100, 115) for f in det.update(tick(t, [200, 20, 20, 40]))]   # 80 s silent
    assert out == []


def _scenario(faults, seed=3, spread=True):
    return Scenario("ecmp-test", "ecmp_imbalance", seed, 8, 1.0, 130.0, tuple(faults), nodes_per_unit=4,
                    n_spines=4, ecmp_spread=spread)


def test_the_simulated_fabric_spreads_evenly_unless_a_leaf_is_polarized():
    topo = _scenario(()).topology()
    sim = ClusterSimulator(topo, seed=3, ecmp_spread=True,
                           faults=[EcmpPolarization(LEAF, ("Ethernet4",), onset_s=0.0)])
    sim.tick()
    before = sim._sw.values.copy()
    for _ in range(10):
        sim.tick()
    out = (sim._sw.values - before)[:, _SC["out-octets"]].astype(float)
    def uplinks(leaf):
        return np.array([out[sim._sp_key[(leaf, p)]] for p in UP])
    hot = uplinks(LEAF)
    assert hot[0] > 0 and hot[1:].sum() < 0.01 * hot[0]
    other = uplinks("leaf-u0-r5")
    assert other.min() > 0 and other.max() / other.mean() < 1.3


@pytest.mark.slow
def test_simulated_polarization_is_found_and_the_negatives_stay_silent():
    sc = _scenario([EcmpPolarization(LEAF, ("Ethernet4", "Ethernet5"), onset_s=20.0, offset_s=120.0),
                    SwitchLinkDown("leaf-u1-r6", "Ethernet5", onset_s=15.0)])
    run_ = run_scenario(sc, (FABRICWATCH,))
    m = match(run_.detections[FABRICWATCH], run_.truths, sc.interval_s, run_.end_ns)
    tps = [t for t in m.tps if t.cls == "ecmp_imbalance"]
    assert [t.entity for t in tps] == [LEAF]
    assert tps[0].delay_ns / 1e9 <= (OPEN_WINDOWS + 1) * WINDOW_S + 2
    assert [f for f in m.fps if f.cls == "ecmp_imbalance"] == []
    assert [x for x in m.fns if x.cls == "ecmp_imbalance"] == []
