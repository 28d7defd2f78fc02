"""pfc_deadlock: a loop of switches pausing each other that persists; storms and transients stay silent."""
import pytest

from fabricwatch.evaluation.matching import match
from fabricwatch.evaluation.runs import FABRICWATCH, run_scenario
from fabricwatch.evaluation.scenarios import Scenario
from fabricwatch.models.findings import OPEN, RESOLVED, EntityRef
from fabricwatch.models.pfc_deadlock import DEADLOCK_HOLD_MS, PfcDeadlockDetector, find_cycles
from fabricwatch.models.pfc_storm import PauseStateChange
from fabricwatch.models.storm_locator import SourceProgress, StormLocator
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.fabric_faults import PfcDeadlock, PfcStorm
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.storm_stage import StormStage

MS = 1_000_000
TOPO = rail_optimised("c1", n_nodes=8, nodes_per_unit=4, n_spines=4)
# leaf-u0-r0 -> spine-0 -> leaf-u1-r0 -> spine-1 -> leaf-u0-r0 (a down-up loop after a link failure)
LOOP = (("leaf-u0-r0", "Ethernet4"), ("spine-0", "Ethernet8"), ("leaf-u1-r0", "Ethernet5"), ("spine-1", "Ethernet0"))


def held(sw, port, at_ms, active=True, role="paused"):
    return PauseStateChange(EntityRef("c1", switch=sw, port=port), 3, role, active, at_ms * MS, at_ms * MS)


def nic(node, dev, at_ms, role, active=True):
    return PauseStateChange(EntityRef("c1", node=node, device=dev, port="1"), 3, role, active, at_ms * MS, at_ms * MS)


def feed(det, changes, until_ms=None):
    out = [f for c in changes for f in det.update(c)]
    if until_ms is not None:
        out += det.advance(until_ms * MS)
    return out


def test_a_loop_opens_after_the_hold_names_switches_and_ports_and_resolves_when_an_edge_breaks():
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    closed_ms = 30
    assert feed(det, [held(sw, p, 10 * k) for k, (sw, p) in enumerate(LOOP)], until_ms=closed_ms + DEADLOCK_HOLD_MS - 1) == []
    opened = det.advance((closed_ms + DEADLOCK_HOLD_MS) * MS)
    assert [(f.kind, f.state, f.entity.path()) for f in opened] == [("pfc_deadlock", OPEN, "c1/leaf-u0-r0/Ethernet4")]
    f = opened[0]
    assert "leaf-u0-r0 -> spine-0 -> leaf-u1-r0 -> spine-1 -> leaf-u0-r0" in f.summary
    assert f.onset_ns == closed_ms * MS and f.severity == "critical"
    assert "pfcwd start --action drop" in f.suggested_action
    for sw, p in LOOP:
        assert f"{sw} {p}" in f.suggested_action          # every held port to drop on
    assert {r.path() for r in f.related} >= {"c1/spine-0/Ethernet8", "c1/spine-0/Ethernet0", "c1/leaf-u0-r0/Ethernet5"}
    assert det.advance(5000 * MS) == []                    # open once
    assert [g.state for g in det.update(held("leaf-u1-r0", "Ethernet5", 5100, active=False))] == [RESOLVED]
    assert det.open_findings() == []


def test_a_loop_broken_by_the_next_record_after_the_hold_opens_first_then_resolves():
    """A backlog read at once: nothing moves the clock between the loop closing and the change that breaks it."""
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    out = feed(det, [held(sw, p, 0) for sw, p in LOOP] + [held(*LOOP[1], 3 * DEADLOCK_HOLD_MS, active=False)])
    assert [f.state for f in out] == [OPEN, RESOLVED]
    assert out[0].onset_ns == 0 and out[1].detected_ns == 3 * DEADLOCK_HOLD_MS * MS


def test_changes_redelivered_after_newer_ones_change_nothing():
    """After a takeover the new owner of a telemetry partition re-sends the changes of the records
    after the dead worker's last commit: old ones arrive after newer ones of the same port. They
    must neither break a loop that holds (an old restoration) nor restore one that broke."""
    flap = [held(sw, p, 10 * k) for k, (sw, p) in enumerate(LOOP)]
    flap += [held(*LOOP[1], 40, active=False), held(*LOOP[1], 50)]           # an edge flaps; the loop holds from 50
    redelivered = flap[:5]                                                   # ... up to the restoration, again
    want = feed(PfcDeadlockDetector(TOPO, cluster="c1"), flap, until_ms=50 + DEADLOCK_HOLD_MS)
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    got = feed(det, flap + redelivered, until_ms=50 + DEADLOCK_HOLD_MS)
    assert [(f.state, f.onset_ns) for f in got] == [(f.state, f.onset_ns) for f in want] == [(OPEN, 50 * MS)]
    assert det.stats["stale_changes"] == 2          # the flapping port's old onset and restoration; the rest repeat
    broke = flap + [held(*LOOP[2], 3000, active=False)]                      # the loop breaks for good at 3 s ...
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    out = feed(det, broke + flap, until_ms=6000)                             # ... and its onsets come again
    assert [f.state for f in out] == [OPEN, RESOLVED] and det.open_findings() == []


def test_a_cycle_shorter_than_the_hold_stays_silent():
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    out = feed(det, [held(sw, p, 0) for sw, p in LOOP], until_ms=DEADLOCK_HOLD_MS // 2)
    out += feed(det, [held(*LOOP[2], DEADLOCK_HOLD_MS // 2 + 10, active=False)], until_ms=10 * DEADLOCK_HOLD_MS)
    assert out == []
    # back again: a fresh cycle, timed from when it closed again
    out = feed(det, [held(*LOOP[2], 20_000)], until_ms=20_000 + DEADLOCK_HOLD_MS - 1)
    assert out == [] and len(det.advance((20_000 + DEADLOCK_HOLD_MS) * MS)) == 1


def test_a_storm_tree_is_no_deadlock():
    """A stuck host pauses its leaf; the leaf's uplinks hold the spines, which hold the other leaves:
    a tree of holds rooted at the NIC, every switch congested, no loop."""
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    tree = [nic("node-0001", "mlx5_0", 0, "pausing"), held("leaf-u0-r0", "Ethernet0", 0),
            held("spine-0", "Ethernet0", 10), held("spine-1", "Ethernet0", 10),
            held("leaf-u1-r0", "Ethernet4", 20), held("leaf-u1-r0", "Ethernet5", 20),
            nic("node-0002", "mlx5_0", 20, "paused")]
    assert feed(det, tree, until_ms=60_000) == []
    loc = StormLocator(TOPO, cluster="c1")
    assert [f.kind for c in tree for f in loc.update(c)][:1] == ["pfc_storm"]   # the locator's, not ours


def test_the_pausing_side_closes_a_loop_too_and_a_two_switch_loop_counts():
    """SONiC exports the pauses a port sends: spine-2 pausing leaf-u0-r3 is the same hold."""
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    two = [held("leaf-u0-r3", "Ethernet6", 0), held("spine-2", "Ethernet3", 0, role="pausing")]
    assert feed(det, two) == []      # spine-2 Ethernet3 pausing = leaf-u0-r3 Ethernet6 held: one edge only
    out = feed(det, [held("leaf-u0-r3", "Ethernet6", 5, role="pausing")], until_ms=2000)
    assert [(f.state, f.evidence[0].value) for f in out] == [(OPEN, 2.0)]


def test_nic_ports_and_unknown_ports_are_no_part_of_a_loop_and_never_crash():
    det = PfcDeadlockDetector(TOPO, cluster="c1")
    out = feed(det, [nic("node-0001", "mlx5_0", 0, "paused"), held("leaf-u0-r0", "Ethernet0", 0),
                     held("leaf-u9-r9", "Ethernet99", 0), held("spine-0", "", 0)], until_ms=10_000)
    assert out == [] and det.stats["unknown_port"] == 1
    with pytest.raises(ValueError):
        PfcDeadlockDetector(TOPO, hold_ms=0)


def test_find_cycles_one_per_knot_and_the_shortest_through_its_first_switch():
    holds = {("a", "1"): ("b", "1"), ("b", "2"): ("c", "1"), ("c", "2"): ("a", "2"),   # a -> b -> c -> a
             ("b", "3"): ("a", "3"),                                                    # and a <-> b
             ("x", "1"): ("y", "1")}                                                    # a tail
    cycles = find_cycles(holds)
    assert len(cycles) == 1 and [e[0][0] for e in cycles[0]] == ["a", "b"]


def _partition(at_ms):
    return SourceProgress("", {"t/0": at_ms * MS}, ("t/0",))


def test_the_storm_stage_feeds_the_deadlock_model_on_its_watermark_and_the_locator_is_unchanged():
    stage = StormStage(DetectionPipeline().config, TOPO, DetectionPipeline().facts)
    loc = StormLocator(TOPO, cluster="c1")
    storm = [nic("node-0001", "mlx5_0", 0, "pausing"), held("leaf-u0-r0", "Ethernet0", 0)]
    loop = [held(sw, p, 100) for sw, p in LOOP]
    out = []
    for c in storm + loop:
        out += stage.locate(c)
    assert out == []                                         # held for the watermark
    out += stage.locate(_partition(200))
    out += stage.locate(_partition(100 + DEADLOCK_HOLD_MS + 50))
    kinds = sorted(f.kind for f in out if f.state == OPEN)
    assert kinds == ["pfc_deadlock", "pfc_storm"]
    alone = [f for c in storm + loop for f in loc.update(c)]
    assert [(f.kind, f.entity.path()) for f in out if f.kind == "pfc_storm"][:1] == \
        [(f.kind, f.entity.path()) for f in alone][:1]


def _scenario(faults, seed=5):
    return Scenario("deadlock-test", "pfc_deadlock", seed, 8, 0.1, 25.0, tuple(faults), nodes_per_unit=4, n_spines=4)


@pytest.mark.slow
def test_simulated_deadlock_is_found_and_a_transient_cycle_and_a_storm_are_not():
    sc = _scenario([PfcDeadlock(LOOP, onset_s=5.0, offset_s=15.0),
                    PfcDeadlock((("leaf-u0-r3", "Ethernet6"), ("spine-2", "Ethernet3")), onset_s=16.0, offset_s=16.7),
                    PfcStorm((("node-0002", "mlx5_5/1"),), onset_s=18.0, offset_s=23.0)])
    run = run_scenario(sc, (FABRICWATCH,))
    m = match(run.detections[FABRICWATCH], run.truths, sc.interval_s, run.end_ns)
    deadlock_tps = [t for t in m.tps if t.cls == "pfc_deadlock"]
    assert [t.entity for t in deadlock_tps] == ["leaf-u0-r0/Ethernet4"]
    assert deadlock_tps[0].delay_ns / 1e9 <= DEADLOCK_HOLD_MS / 1e3 + 1.5
    assert [f for f in m.fps if f.cls == "pfc_deadlock"] == [] and m.fns == []


@pytest.mark.slow
def test_through_the_worker_handlers_and_the_wire_codec_over_three_telemetry_partitions():
    """Stage 1 on three telemetry partitions (`StageHandlers`), the pause-states records as JSON, the storm
    stage that reads the cluster's pause-states partition: the loop is found once, on the partitions' watermark."""
    from fabricwatch.simulator.cluster import ClusterSimulator
    from fabricwatch.streams.codec import pause_change_from_json
    from fabricwatch.streams.config import DetectionConfig
    from fabricwatch.streams.decode import pack
    from fabricwatch.streams.facts import FactBook
    from fabricwatch.streams.handlers import PAUSE_STATES, StageHandlers
    from fabricwatch.streams.source_stage import SourceStage

    topo = rail_optimised("sim", n_nodes=8, nodes_per_unit=4, n_spines=4)
    handlers, facts = StageHandlers(1, 2), FactBook(topo)
    stages = [SourceStage(DetectionConfig(), topo, facts, "t", p, 3) for p in range(3)]
    storm = StormStage(DetectionConfig(), topo, facts)   # the one reading pause-states partition 0
    sim = ClusterSimulator(topo, seed=9, interval_s=0.1, rank_steps=False,
                           faults=[PfcDeadlock(LOOP, onset_s=1.0, offset_s=4.0)])
    found = []
    for tick in sim.run(6.0):
        items = [(pack([s]).SerializeToString(), stages[p], p, None)
                 for s in sorted(tick, key=lambda s: s.source) for p in [sum(s.source.encode()) % 3]]
        for r in handlers.on_telemetry_many(items):
            if r.topic == PAUSE_STATES and r.partition in (None, 0):     # keyed by cluster, or progress to 0
                found += storm.locate(pause_change_from_json(r.value))
    got = [(f.kind, f.state, f.entity.path()) for f in found if f.kind == "pfc_deadlock"]
    assert got == [("pfc_deadlock", OPEN, "sim/leaf-u0-r0/Ethernet4"), ("pfc_deadlock", RESOLVED, "sim/leaf-u0-r0/Ethernet4")]
    opened = next(f for f in found if f.kind == "pfc_deadlock")
    assert 1.0 + DEADLOCK_HOLD_MS / 1e3 <= (opened.detected_ns - sim.start_unix_ns) / 1e9 <= 1.0 + DEADLOCK_HOLD_MS / 1e3 + 0.6
    assert not [f for f in found if f.kind == "pfc_storm"]      # every switch congested, no source: no storm
