"""GPU faults after NVIDIA's Xid catalog: hardware XIDs open `gpu_xid`, application XIDs and
XID 45 cleanups do not; cascades are one anomaly with their consequences attached."""
from __future__ import annotations

import math

import pytest

from fabricwatch import xid
from fabricwatch.models.findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING
from fabricwatch.models.frames import DeviceEvent, SourceBatch, SourceView
from fabricwatch.models.gpu_faults import APP_EVIDENCE_S, CASCADE_WINDOW_S, PENDING_S, GpuFaultDetector
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.host_faults import XID_TEXT, ApplicationXid, GpuXid, XidCascade
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import replay

S = 1_000_000_000


def tick(det, t_s, *events, node="node-1"):
    view = SourceView("c1", node, "node", int(t_s * S), 1,
                      events=[DeviceEvent(g, "xid", code, int(t * S)) for g, code, t in events])
    return det.update(view)


# ---------------------------------------------------------------------------- the catalog
@pytest.mark.parametrize("code", [13, 31, 43, 68, 69, 8])
def test_application_xids_are_job_level(code):
    info = xid.lookup(code)
    assert info.category == xid.APPLICATION and not info.is_gpu_fault
    assert info.immediate_action in ("RESTART_APP", "IGNORE")


@pytest.mark.parametrize("code", [48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140])
def test_hardware_and_firmware_xids_are_gpu_faults(code):
    info = xid.lookup(code)
    assert info.is_gpu_fault and info.category in (xid.HARDWARE, xid.FIRMWARE)
    assert info.severity in (xid.CRITICAL, xid.WARNING) and info.action and info.mnemonic


def test_catalog_is_one_source_for_the_simulator_and_the_detector():
    assert xid.lookup(45).category == xid.CONSEQUENCE and not xid.is_gpu_fault(45)
    assert xid.lookup(1234).is_gpu_fault and xid.lookup(1234).severity == xid.WARNING   # unknown: investigate
    assert XID_TEXT[79] == xid.text(79) == "GPU has fallen off the bus"
    assert {48, 94, 95} == xid.UNCORRECTABLE_ECC_XIDS and xid.APPLICATION_XIDS.isdisjoint(xid.HARDWARE_XIDS)
    assert all(x.code == c and x.category in xid.CATEGORIES for c, x in xid.CATALOG.items())


# ---------------------------------------------------------------------------- the detector
def test_hardware_xid_opens_and_repeats_update_then_resolves():
    det = GpuFaultDetector(quiet_s=60)
    [f] = tick(det, 1, ("gpu3", 94, 0.9))
    assert (f.kind, f.state, f.severity) == ("gpu_xid", OPEN, CRITICAL)
    assert "Contained ECC error" in f.summary and "NVIDIA: RESTART_APP" in f.suggested_action
    [f] = tick(det, 2, ("gpu3", 63, 1.9))
    assert f.state == UPDATE and f.evidence[0].value == 2 and "xid=63 x1" in f.evidence[0].detail
    assert tick(det, 30) == []
    [f] = tick(det, 70)
    assert f.state == RESOLVED and det.stats["xid_gpu_fault"] == 2


def test_warning_and_unknown_codes_open_as_warning():
    det = GpuFaultDetector()
    assert [(f.state, f.severity) for f in tick(det, 1, ("gpu0", 92, 0.5))] == [(OPEN, WARNING)]
    [f] = tick(det, 1, ("gpu1", 777, 0.5))
    assert (f.state, f.severity) == (OPEN, WARNING) and "Unknown Xid" in f.summary


def test_application_xids_open_nothing_and_are_cited_by_a_later_fault():
    det = GpuFaultDetector()
    out = [f for t in range(1, 30) for f in tick(det, t, ("gpu2", 13, t - 0.5), ("gpu2", 31, t - 0.4),
                                                   ("gpu4", 43, t - 0.3), ("gpu5", 45, t - 0.2))]
    assert out == [] and 3 * 29 < det.stats["xid_application"] < 4 * 29    # solo 45s counted once let go
    out += [f for t in range(30, 60) for f in tick(det, t)]           # the solo 45s are let go
    assert out == [] and det.stats["xid_application"] == 4 * 29 and det.stats["xid_consequence"] == 0
    [f] = tick(det, 61, ("gpu2", 48, 60.5))
    assert f.state == OPEN
    (app,) = [e for e in f.evidence if e.name == "recent_application_xids"]
    assert app.value == 16 and "XID 13" in app.detail and "job-level" in app.detail   # bounded per GPU
    [f] = tick(det, 62 + APP_EVIDENCE_S, ("gpu2", 48, 61.5 + APP_EVIDENCE_S))
    assert [e.name for e in f.evidence] == ["occurrences"]                 # too old to cite


def test_cascade_is_one_open_with_its_consequences():
    det = GpuFaultDetector()
    out = tick(det, 10, ("gpu1", 79, 9.7), ("gpu0", 45, 9.8))
    out += tick(det, 11, ("gpu3", 45, 10.2), ("gpu6", 45, 10.6), ("gpu7", 45, 10.9))
    out += tick(det, 12)
    assert [(f.state, f.entity.device) for f in out] == [(OPEN, "gpu1"), (UPDATE, "gpu1"), (UPDATE, "gpu1")]
    last = out[-1]
    (cons,) = [e for e in last.evidence if e.name == "consequent_gpus"]
    assert cons.value == 4 and cons.detail == "gpu0 XID 45, gpu3 XID 45, gpu6 XID 45, gpu7 XID 45"
    assert [r.device for r in last.related] == ["gpu0", "gpu3", "gpu6", "gpu7"]
    assert "preemptive cleanup" in last.summary
    assert det.stats["xid_consequence"] == 4 and det.stats["xid_application"] == 0


@pytest.mark.parametrize("order", ["root first", "cleanup first"])
def test_cleanup_before_its_root_in_one_tick_is_attributed_the_same(order):
    events = [("gpu2", 95, 4.9), ("gpu5", 45, 4.8)]
    det = GpuFaultDetector()
    out = tick(det, 5, *(events if order == "root first" else events[::-1]))
    assert [(f.state, f.entity.device) for f in out] == [(OPEN, "gpu2"), (UPDATE, "gpu2")]
    assert "gpu5 XID 45" in out[-1].evidence[-1].detail


def test_cleanup_a_tick_before_its_root_joins_the_open():
    det = GpuFaultDetector()
    assert tick(det, 5, ("gpu5", 45, 4.9)) == []
    [f] = tick(det, 6, ("gpu2", 79, 5.2))
    assert f.state == OPEN and [e.detail for e in f.evidence if e.name == "consequent_gpus"] == ["gpu5 XID 45"]
    assert det.stats["xid_consequence"] == 1 and det.stats["xid_application"] == 0


def test_cleanup_outside_the_window_or_on_another_node_is_application_level():
    det = GpuFaultDetector()
    [f] = tick(det, 1, ("gpu1", 48, 0.5))
    assert tick(det, 1, ("gpu3", 45, 0.6), node="node-2") == []       # another node: its own job
    far = 0.5 + CASCADE_WINDOW_S + 1
    assert tick(det, far + 0.5, ("gpu3", 45, far)) == []
    tick(det, far + PENDING_S + 1)
    tick(det, far + PENDING_S + 1, node="node-2")
    assert det.stats["xid_consequence"] == 0 and det.stats["xid_application"] == 2


def test_a_record_of_many_ticks_is_judged_tick_by_tick():
    det = GpuFaultDetector()
    views = [SourceView("c1", "node-1", "node", k * S, k, [], events)
             for k, events in enumerate([[DeviceEvent("gpu0", "xid", 45, 0)], [],
                                         [DeviceEvent("gpu3", "xid", 74, 2 * S), DeviceEvent("gpu0", "xid", 13, 2 * S)]])]
    out = det.update_batch(SourceBatch.of_views(views))
    assert [(f.state, f.entity.device) for f in out] == [(OPEN, "gpu3")]
    assert "gpu0 XID 45" in out[0].evidence[-1].detail and det.stats["xid_application"] == 1
    with pytest.raises(ValueError):
        GpuFaultDetector(cascade_window_s=0)


# ---------------------------------------------------------------------------- simulator
def topo8():
    return rail_optimised("t", n_nodes=8, nodes_per_unit=4, n_spines=2)


def events_of(sim, ticks):
    return [(s.source, e.entity_id, e.code, (e.time_unix_ns - sim.start_unix_ns) / 1e9)
            for _ in range(ticks) for s in sim.tick() for e in s.events]


def test_simulator_cascade_and_application_xids():
    topo = topo8()
    node = topo.nodes[1]
    faults = [XidCascade(node, 2, 79, onset_s=3.3, offset_s=8.0, victims=(0, 4, 7), delays_s=(0.1, 1.2, 2.9)),
              ApplicationXid(topo.nodes[5], (1, 3), onset_s=2.2, code=31, bursts=2, period_s=4.0, cleanup=(6,),
                             cleanup_delay_s=0.4)]
    sim = ClusterSimulator(topo, seed=3, faults=faults)
    ev = events_of(sim, 10)
    assert [(g, c) for n, g, c, _ in ev if n == node] == [("gpu2", 79), ("gpu0", 45), ("gpu4", 45), ("gpu7", 45)]
    t45 = [t for n, _, c, t in ev if n == node and c == 45]
    assert all(3.3 < t < 6.3 for t in t45)
    app = [(g, c) for n, g, c, _ in ev if n == topo.nodes[5]]
    assert app == [("gpu1", 31), ("gpu3", 31), ("gpu6", 45)] * 2
    root, bug = sorted(sim.ground_truth(), key=lambda g: g.kind)[::-1]
    assert (root.kind, root.entity, root.expect_alert) == ("gpu_xid", f"{node}/gpu2", True)
    assert root.victims == tuple(f"{node}/gpu{g}" for g in (0, 4, 7))
    assert (bug.kind, bug.expect_alert, bug.victims) == ("application_xid", False, (f"{topo.nodes[5]}/gpu6",))


def test_fault_validation():
    with pytest.raises(ValueError):
        XidCascade("n", 1, 13, onset_s=1.0, victims=(2,), delays_s=(0.5,))      # 13 is no GPU fault
    with pytest.raises(ValueError):
        XidCascade("n", 1, 79, onset_s=1.0, victims=(1,), delays_s=(0.5,))      # the root is no victim
    with pytest.raises(ValueError):
        ApplicationXid("n", (1,), onset_s=1.0, code=79)
    with pytest.raises(ValueError):
        ApplicationXid("n", (1,), onset_s=1.0, code=13, cleanup=(1,))
    assert not ClusterSimulator(topo8(), seed=1, faults=[GpuXid(topo8().nodes[0], 1, 13, onset_s=1.0)]
                                ).ground_truth()[0].expect_alert


# ---------------------------------------------------------------------------- replay
def run_replay(faults, seconds=40, seed=4):
    topo = topo8()
    sim = ClusterSimulator(topo, seed=seed, faults=faults)
    snaps = [s for _ in range(seconds) for s in sim.tick()]
    pipeline = DetectionPipeline(topology=topo)
    events = replay(snaps, pipeline).events
    return [e for e in events if e.kind.startswith("gpu_")], pipeline.counters()


def test_replay_cascade_gives_exactly_one_gpu_xid_open():
    node = topo8().nodes[2]
    events, stats = run_replay([XidCascade(node, 5, 95, onset_s=10.4, victims=(0, 1, 2, 3, 4, 6, 7),
                                           delays_s=(0.1, 0.3, 0.5, 0.9, 1.4, 2.2, 2.9))])
    opens = [e for e in events if e.lifecycle == 1 and e.kind == "gpu_xid"]
    assert [(e.entity.node, e.entity.device) for e in opens] == [(node, "gpu5")]
    assert stats["xid_consequence"] == 7 and stats["xid_gpu_fault"] == 1 and stats["xid_application"] == 0


def test_replay_application_xid_bursts_give_no_anomaly():
    nodes = topo8().nodes
    bugs = [ApplicationXid(nodes[0], tuple(range(8)), onset_s=3.4, code=13, bursts=3, period_s=9.0),
            ApplicationXid(nodes[1], (2,), onset_s=5.4, code=31, bursts=2, period_s=12.0, cleanup=(0, 1, 3, 4, 5, 6, 7)),
            ApplicationXid(nodes[2], (6,), onset_s=7.4, code=43, cleanup=(7,), crash=True)]
    events, stats = run_replay(bugs)
    assert events == []
    assert stats["xid_application"] == 8 * 3 + 8 * 2 + 2 and stats["xid_gpu_fault"] == 0
    assert not math.isnan(stats["xid_application"])
