"""PFC storm source localisation (StormLocator) on hand-built pause-state records.
"""
from __future__ import annotations

from helpers import MS

from fabricwatch.models.findings import OPEN, RESOLVED, UPDATE, EntityRef, Evidence
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PauseStateChange
from fabricwatch.models.storm_locator import (SILENT_SOURCE_CONFIDENCE, SWITCH_SOURCE_CONFIDENCE,
                                              StormLocator)
from fabricwatch.models.topology import rail_optimised

DETECT_MS, RESTORE_MS = 200, 400


# ----------------------------------------------------------------------- locator, hand-built records
TOPO = rail_optimised("c1", n_nodes=8, nodes_per_unit=4, n_spines=2)


def nic_ref(node, rail=2):
    return EntityRef("c1", node=node, device=f"mlx5_{rail}", port="1")


def port_ref(switch, port):
    return EntityRef("c1", switch=switch, port=port)


def change(ref, role, active=True, at_ms=200, onset_ms=0, duty=0.99):
    name = "rx_pause_duty" if role == PAUSED else "tx_pause_duty"
    return PauseStateChange(ref, 3, role, active, onset_ms * MS, at_ms * MS, [Evidence(name, duty, 0.8, "s/s")])


def feed(loc, changes):
    return [f for c in changes for f in loc.update(c)]


def test_the_pausing_nic_is_named_even_when_a_victim_is_paused_harder():
    loc = StormLocator(TOPO)
    out = feed(loc, [
        change(nic_ref("node-0001"), PAUSED, duty=0.999),         # a victim, paused harder...
        change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED, duty=0.96),
        change(nic_ref("node-0003"), PAUSING, duty=0.96),          # ...than the source pauses
        change(nic_ref("node-0002"), PAUSED, at_ms=210, duty=0.99),
    ])
    assert {(f.state, f.entity.path()) for f in out} == {(OPEN, "c1/node-0003/mlx5_2/1"),
                                                         (UPDATE, "c1/node-0003/mlx5_2/1")}
    assert [r.path() for r in out[-1].related] == [
        "c1/leaf-u0-r2/Ethernet2", "c1/node-0001/mlx5_2/1", "c1/node-0002/mlx5_2/1"]
    # nothing is said about the victims themselves, even much later
    assert loc.poll(60_000 * MS) == []


def test_records_in_any_order_give_the_same_answer():
    records = [change(nic_ref("node-0001"), PAUSED), change(nic_ref("node-0002"), PAUSED),
               change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED), change(nic_ref("node-0003"), PAUSING),
               change(port_ref("spine-0", "Ethernet2"), PAUSED)]
    answers = set()
    for order in (records, records[::-1], records[2:] + records[:2]):
        loc = StormLocator(TOPO)
        out = feed(loc, order)
        assert {f.entity.path() for f in out} == {"c1/node-0003/mlx5_2/1"}
        assert out[0].state == OPEN
        answers.add(tuple(r.path() for r in loc.open_findings()[0].related))
    assert answers == {("c1/leaf-u0-r2/Ethernet2", "c1/node-0001/mlx5_2/1", "c1/node-0002/mlx5_2/1",
                        "c1/spine-0/Ethernet2")}


def test_victims_before_their_congested_switch_reports_are_not_a_switch_storm():
    loc = StormLocator(TOPO, orphan_grace_ms=500)
    assert feed(loc, [change(nic_ref("node-0001"), PAUSED, at_ms=200)]) == []
    assert loc.poll(600 * MS) == []                           # within the grace period
    # the leaf's held port arrives: the pausing is propagation
    assert feed(loc, [change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED, at_ms=650)]) == []
    out = loc.poll(5_000 * MS)
    assert [(f.entity.path(), f.confidence) for f in out] == [("c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE)]


def test_silent_source_names_the_held_leaf_port_then_yields_to_the_nic():
    loc = StormLocator(TOPO)
    feed(loc, [change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED, at_ms=200),
               change(nic_ref("node-0001"), PAUSED, at_ms=200)])
    out = loc.poll(1_300 * MS)
    assert [(f.state, f.entity.path(), f.confidence) for f in out] == [
        (OPEN, "c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE)]
    assert "node-0003 mlx5_2/1" in out[0].summary
    assert [r.path() for r in out[0].related] == ["c1/node-0001/mlx5_2/1"]
    out = feed(loc, [change(nic_ref("node-0003"), PAUSING, at_ms=1_400)])
    assert [(f.state, f.entity.path()) for f in out] == [(RESOLVED, "c1/leaf-u0-r2/Ethernet2"),
                                                        (OPEN, "c1/node-0003/mlx5_2/1")]


def test_switch_port_pausing_with_no_congestion_on_its_switch_is_a_switch_root():
    loc = StormLocator(TOPO)
    # spine-0's port facing leaf-u0-r2 is held, but nothing on leaf-u0-r2 is held or pausing
    feed(loc, [change(port_ref("spine-0", "Ethernet2"), PAUSED, at_ms=200)])
    out = loc.poll(1_500 * MS)
    assert [(f.state, f.entity.path(), f.confidence) for f in out] == [
        (OPEN, "c1/leaf-u0-r2/Ethernet4", SWITCH_SOURCE_CONFIDENCE)]
    assert [r.path() for r in out[0].related] == ["c1/spine-0/Ethernet2"]
    out = feed(loc, [change(port_ref("spine-0", "Ethernet2"), PAUSED, active=False, at_ms=2_000)])
    assert [(f.state, f.entity.path()) for f in out] == [(RESOLVED, "c1/leaf-u0-r2/Ethernet4")]


def test_restoring_source_then_victims_does_not_invent_a_switch_root():
    loc = StormLocator(TOPO)
    feed(loc, [change(nic_ref("node-0003"), PAUSING), change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED),
               change(nic_ref("node-0001"), PAUSED)])
    out = feed(loc, [change(nic_ref("node-0003"), PAUSING, active=False, at_ms=5_000),
                     change(port_ref("leaf-u0-r2", "Ethernet2"), PAUSED, active=False, at_ms=5_000)])
    assert [f.state for f in out] == [RESOLVED]
    # node-0001 restores a little later: its leaf pausing it is not a new storm meanwhile
    assert loc.poll(5_500 * MS) == []
    assert feed(loc, [change(nic_ref("node-0001"), PAUSED, active=False, at_ms=5_600)]) == []
    assert loc.poll(20_000 * MS) == []


def test_stale_records_are_ignored():
    loc = StormLocator(TOPO)
    feed(loc, [change(nic_ref("node-0003"), PAUSING, at_ms=200)])
    assert [f.state for f in feed(loc, [change(nic_ref("node-0003"), PAUSING, False, at_ms=900)])] == [RESOLVED]
    assert feed(loc, [change(nic_ref("node-0003"), PAUSING, True, at_ms=300)]) == []   # late duplicate
