"""PFC storm detection and source localisation end to end through the cluster simulator
(protobuf snapshots -> to_view -> RateTracker -> PfcWatchdog -> StormLocator), and on the
worker's path at the real collector cadence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from helpers import INTERVAL_S, MS

from fabricwatch.models.findings import OPEN, RESOLVED, UPDATE
from fabricwatch.models.frames import NIC_PORT
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import (ORPHAN_GRACE_MS, SILENT_SOURCE_CONFIDENCE, StormLocator)
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import AdminToggle, PfcStorm, PinnedCounter, SwitchPfcStorm
from fabricwatch.simulator.host_faults import NodeReboot
from fabricwatch.simulator.workload import Job
from fabricwatch.streams.decode import to_view

DETECT_MS, RESTORE_MS = 200, 400


def N(i: int) -> str:
    return f"node-{i:04d}"


# ----------------------------------------------------------------------- the simulator, end to end
@dataclass
class Run:
    sim: ClusterSimulator
    changes: list = field(default_factory=list)        # (tick time ns, PauseStateChange)
    findings: list = field(default_factory=list)       # (tick time ns, Finding)
    max_nic_rx_duty: float = 0.0
    max_tx_pause_frames: float = 0.0
    duty: dict = field(default_factory=dict)           # entity path -> max pause duty seen (rx or tx)
    resets: int = 0
    open_by_tick: dict = field(default_factory=dict)   # tick time ns -> the locator's open storms then

    def at(self, fault_s: float) -> int:
        return self.sim.start_unix_ns + int(round(fault_s * 1e9))

    def states(self):
        return [(f.state, f.entity.path()) for _, f in self.findings]

    def open_at(self, fault_s: float) -> list:
        """The storms the locator held open at that time (with their victims as known then)."""
        return self.open_by_tick.get(self.at(fault_s), [])


def simulate(faults=(), seconds=6.0, n_nodes=16, nodes_per_unit=8, jobs=None, drop=None, seed=3,
             track=(), **sim_kw) -> Run:
    topo = rail_optimised("sim", n_nodes=n_nodes, nodes_per_unit=nodes_per_unit, n_spines=2)
    sim = ClusterSimulator(topo, seed=seed, interval_s=INTERVAL_S, jobs=jobs, faults=list(faults),
                           rank_steps=False, **sim_kw)
    run = Run(sim)
    rates, wd, loc = RateTracker(), PfcWatchdog(DETECT_MS, RESTORE_MS), StormLocator(topo)
    loc.set_jobs({n: {j.job_id} for j in sim.jobs for n in j.nodes})
    for _ in range(int(round(seconds / INTERVAL_S))):
        snaps = sim.tick()
        now = sim.now_unix_ns                          # the tick's sample time, before clock offsets
        for snap in snaps:
            if drop is not None and snap.source in drop:
                continue
            view = to_view(snap)
            for frame in view.frames:
                rates.update(view.source, frame, view.time_ns)
                if frame.kind == NIC_PORT:
                    rx = frame.rate("rx_prio3_pause_duration")
                    run.max_nic_rx_duty = max(run.max_nic_rx_duty, float(np.nanmax(rx, initial=0.0)))
                    frames = frame.rate("tx_prio3_pause")
                    run.max_tx_pause_frames = max(run.max_tx_pause_frames, float(np.nanmax(frames, initial=0.0)))
                    for i, eid in enumerate(frame.ids):
                        path = f"{view.source}/{eid}"
                        if path in track:
                            d = np.nanmax([rx[i], frame.rate("tx_prio3_pause_duration")[i], 0.0])
                            run.duty[path] = max(run.duty.get(path, 0.0), float(d))
            for c in wd.update(view):
                run.changes.append((now, c))
                run.findings += [(now, f) for f in loc.update(c)]
        run.findings += [(now, f) for f in loc.poll(now)]
        current = loc.open_findings()
        if current:
            run.open_by_tick[now] = current
    run.resets = rates.stats["counter_resets"]
    return run


# Two jobs on unit 0 and unit 1 (their rings cross the spines), idle nodes 7, 8, 15, 16.
JOBS = [Job("job-a", (N(4), N(5), N(6), N(12), N(13))), Job("job-b", (N(1), N(2), N(3), N(9), N(10), N(11)))]
SOURCE = (N(5), "mlx5_2/1")        # on leaf-u0-r2, port Ethernet4


def storm_findings(run):
    return [(t, f) for t, f in run.findings if f.kind == "pfc_storm"]


def test_single_port_storm_names_the_source_not_the_victims():
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=2.0, offset_s=5.0)], jobs=JOBS)
    truth = run.sim.ground_truth()[0]
    assert truth.entity == "node-0005/mlx5_2/1" and truth.expect_alert
    assert [s for s in run.states() if s[0] != UPDATE] == [(OPEN, "sim/node-0005/mlx5_2/1"),
                                                          (RESOLVED, "sim/node-0005/mlx5_2/1")]
    [last] = run.open_at(4.0)
    victims = {r.path() for r in last.related}
    # its leaf port, the NICs on that leaf that had data to send (port_xmit_wait rising, or sent
    # within the lookback: the source's hung ring partners too), the spine port facing the leaf
    assert victims == {"sim/leaf-u0-r2/Ethernet4", "sim/node-0001/mlx5_2/1", "sim/node-0002/mlx5_2/1",
                       "sim/node-0003/mlx5_2/1", "sim/node-0004/mlx5_2/1", "sim/node-0006/mlx5_2/1",
                       "sim/spine-0/Ethernet2"}
    assert victims - {"sim/leaf-u0-r2/Ethernet4"} <= {f"sim/{v}" for v in truth.victims}
    assert "sim/" + truth.related[0] in victims
    assert last.severity == "critical" and last.confidence == 1.0
    assert last.summary == ("PFC storm on prio 3 from node-0005 mlx5_2/1: 7 victim ports behind leaf-u0-r2 "
                            "(spine uplinks paused) on 5 nodes; jobs job-a, job-b")
    ev = {e.name: e for e in last.evidence}
    assert ev["tx_pause_duty"].value > 0.99 and ev["rx_bytes_per_s"].value < 1e6
    assert ev["victim_ports"].value == 7 and ev["victim_nodes"].value == 5 and ev["affected_jobs"].value == 2
    assert ev["leaf_port_rx_pause_duty"].detail == "leaf-u0-r2/Ethernet4"
    assert "stuck host" in last.probable_cause and "isolate the source port" in last.suggested_action
    # the watchdog saw the victims as paused and only the source as pausing
    assert {c.entity.path() for _, c in run.changes if c.role == PAUSING} == {"sim/node-0005/mlx5_2/1"}


@pytest.mark.parametrize("onset_s", [2.0, 2.006, 2.05, 2.099])
def test_detection_within_detection_time_plus_one_interval_and_restoration(onset_s):
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=onset_s, offset_s=onset_s + 2.0)], seconds=5.0, jobs=JOBS)
    opened = [t for t, f in run.findings if f.state == OPEN]
    resolved = [t for t, f in run.findings if f.state == RESOLVED]
    assert len(opened) == 1 and len(resolved) == 1
    delay_ms = (opened[0] - run.at(onset_s)) / MS
    assert 2 * INTERVAL_S * 1000 - 1 <= delay_ms <= DETECT_MS + INTERVAL_S * 1000 + 1e-6
    # the first quiet interval may still hold part of the storm: +- one interval
    restore_ms = (resolved[0] - run.at(onset_s + 2.0)) / MS
    assert RESTORE_MS - INTERVAL_S * 1000 - 1e-6 <= restore_ms <= RESTORE_MS + INTERVAL_S * 1000 + 1e-6


def test_victim_paused_harder_than_the_source():
    victim = "node-0001/mlx5_2/1"
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=1.0, offset_s=4.0, duty=0.96)], seconds=4.5, jobs=JOBS,
                   track=(victim, "node-0005/mlx5_2/1"))
    assert run.duty[victim] > run.duty["node-0005/mlx5_2/1"]
    assert {e for _, e in run.states()} == {"sim/node-0005/mlx5_2/1"}
    assert f"sim/{victim}" in {r.path() for _, f in run.findings for r in f.related}


def test_two_port_storm_names_both_sources():
    srcs = ((N(5), "mlx5_2/1"), (N(12), "mlx5_6/1"))
    run = simulate([PfcStorm(sources=srcs, onset_s=1.0, offset_s=3.0)], seconds=4.0, jobs=JOBS)
    opened = sorted(f.entity.path() for _, f in run.findings if f.state == OPEN)
    assert opened == ["sim/node-0005/mlx5_2/1", "sim/node-0012/mlx5_6/1"]
    assert sorted(f.entity.path() for _, f in run.findings if f.state == RESOLVED) == opened
    for _, f in run.findings:
        assert not {r.path() for r in f.related} & set(opened)     # a source is never another's victim


def test_all_port_storm_names_every_source_and_nothing_else():
    srcs = tuple((N(i), "mlx5_2/1") for i in range(1, 9))          # every NIC on leaf-u0-r2
    run = simulate([PfcStorm(sources=srcs, onset_s=1.0, offset_s=3.0)], seconds=4.0, jobs=JOBS)
    # the idle nodes' NICs have nothing queued for them: their pauses hold nothing
    expected = sorted(f"sim/{t.entity}" for t in run.sim.ground_truth() if t.expect_alert)
    assert len(expected) == len([n for n, _ in srcs if n not in run.sim.idle_nodes]) > 0
    assert sorted(f.entity.path() for _, f in run.findings if f.state == OPEN) == expected
    assert sorted(f.entity.path() for _, f in run.findings if f.state == RESOLVED) == expected
    assert all(f.confidence == 1.0 for _, f in run.findings)


def test_storm_shorter_than_detection_time_does_not_alert():
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=2.0, offset_s=2.15)], seconds=4.0, jobs=JOBS)
    assert not run.sim.ground_truth()[0].expect_alert
    assert run.findings == [] and run.changes == []


def test_storm_with_no_traffic_to_send_is_not_a_storm():
    # The source's node is idle: nothing is queued for it, so no queue is held, there are
    # no victims, and the NIC received nothing on the priority before it paused: its pauses
    # hold nothing (sonic-mgmt test_pfcwd_no_traffic). Must not fire.
    idle_src = (N(7), "mlx5_2/1")
    run = simulate([PfcStorm(sources=(idle_src,), onset_s=1.0, offset_s=3.0)], seconds=4.0, jobs=JOBS)
    truth = run.sim.ground_truth()[0]
    assert truth.detail["traffic_to_source"] is False and not truth.expect_alert
    assert run.changes == [] and run.findings == []


@pytest.mark.parametrize("tx_duration_exported", [False, True])
def test_switch_port_storm_with_a_pinned_victim_port_xmit_wait_names_the_switch_port(tx_duration_exported):
    topo = rail_optimised("sim", n_nodes=16, nodes_per_unit=8, n_spines=2)
    lp = topo.nic(N(1), "mlx5_2/1")                            # leaf-u0-r2 Ethernet0, a busy job-b NIC
    run = simulate([SwitchPfcStorm(lp.switch, lp.switch_port, onset_s=1.0, offset_s=4.0),
                    PinnedCounter(N(1), "mlx5_2/1")], seconds=6.0, jobs=JOBS,
                   switch_tx_pause_duration=tx_duration_exported)
    truth = run.sim.ground_truth()[0]
    assert truth.entity == "leaf-u0-r2/Ethernet0" and truth.expect_alert
    assert run.states() == [(OPEN, "sim/leaf-u0-r2/Ethernet0"), (RESOLVED, "sim/leaf-u0-r2/Ethernet0")]
    t, f = run.findings[0]
    assert f.cause == "switch_port" and [r.path() for r in f.related] == ["sim/node-0001/mlx5_2/1"]
    # the victim's port_xmit_wait is unknown (pinned): its recent traffic said it had data to send
    [victim] = [c for _, c in run.changes if c.role == PAUSED and c.active]
    assert victim.value("recent_traffic") == 1.0
    # switch-rooted storms wait for the locator's grace (the congested-switch picture may be late)
    assert (t - run.at(1.0)) / MS <= DETECT_MS + ORPHAN_GRACE_MS + INTERVAL_S * 1000 + 1e-6
    pausing = {c.entity.path() for _, c in run.changes if c.role == PAUSING}
    assert pausing == ({"sim/leaf-u0-r2/Ethernet0"} if tx_duration_exported else set())


def test_switch_port_storm_towards_an_idle_node_is_not_a_storm():
    topo = rail_optimised("sim", n_nodes=16, nodes_per_unit=8, n_spines=2)
    lp = topo.nic(N(7), "mlx5_2/1")                            # node-0007 runs no job
    run = simulate([SwitchPfcStorm(lp.switch, lp.switch_port, onset_s=1.0, offset_s=4.0),
                    PinnedCounter(N(7), "mlx5_2/1")], seconds=6.0, jobs=JOBS, switch_tx_pause_duration=True)
    assert not run.sim.ground_truth()[0].expect_alert
    assert run.changes == [] and run.findings == []


def test_storm_during_traffic_with_the_host_still_running():
    # stuck_host=False: the source's own job keeps computing; its ring partners on the leaf
    # have data for the source queued behind the held port.
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=1.0, offset_s=4.0, stuck_host=False)], seconds=5.0,
                   jobs=JOBS)
    assert [s for s in run.states() if s[0] != UPDATE] == [(OPEN, "sim/node-0005/mlx5_2/1"),
                                                          (RESOLVED, "sim/node-0005/mlx5_2/1")]
    [storm] = run.open_at(3.0)
    victims = {r.path() for r in storm.related}
    # the source's own ring partners now have data queued for it, and are held too
    assert {"sim/leaf-u0-r2/Ethernet4", "sim/node-0001/mlx5_2/1", "sim/node-0004/mlx5_2/1",
            "sim/node-0006/mlx5_2/1"} <= victims
    assert "sim/node-0005/mlx5_2/1" not in victims


def test_silent_source_node_is_named_through_its_leaf_port():
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=1.0, offset_s=4.0)], seconds=5.0, jobs=JOBS,
                   drop={N(5)})
    opened = [(f.entity.path(), f.confidence) for _, f in run.findings if f.state == OPEN]
    assert opened == [("sim/leaf-u0-r2/Ethernet4", SILENT_SOURCE_CONFIDENCE)]
    f = next(f for _, f in run.findings if f.state == OPEN)
    assert "node-0005 mlx5_2/1" in f.summary
    assert "sim/node-0001/mlx5_2/1" in {r.path() for r in f.related}


def test_nic_storm_prevention_ends_the_storm_early():
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=1.0, offset_s=10.0, nic_watchdog_ms=1000)], seconds=3.0,
                   jobs=JOBS)
    resolved = [t for t, f in run.findings if f.state == RESOLVED]
    assert len(resolved) == 1
    assert (resolved[0] - run.at(2.0)) / MS <= RESTORE_MS + INTERVAL_S * 1000


def test_admin_port_toggle_does_not_alert():
    run = simulate([AdminToggle("leaf-u0-r2", "Ethernet4", onset_s=1.0, down_s=2.0),
                    AdminToggle("leaf-u0-r0", "Ethernet8", onset_s=1.5, down_s=1.0)], seconds=4.0, jobs=JOBS)
    assert run.changes == [] and run.findings == []


def test_xon_flood_does_not_alert():
    run = simulate([PfcStorm(sources=(SOURCE,), onset_s=1.0, offset_s=3.0, xon_only=True)], seconds=4.0, jobs=JOBS)
    assert run.max_tx_pause_frames > 10_000                 # the frames were sent...
    assert run.changes == [] and run.findings == []          # ...but they pause nothing


def test_reboot_counter_reset_does_not_alert():
    run = simulate([NodeReboot(N(5), onset_s=1.0, down_s=1.0, restart_s=1.0)], seconds=4.0, jobs=JOBS)
    assert run.resets > 0
    assert run.changes == [] and run.findings == []


@pytest.mark.parametrize("seconds", [30.0, 180.0])
@pytest.mark.slow
def test_healthy_noisy_cluster_with_incast_does_not_alert(seconds):
    run = simulate(seconds=seconds, n_nodes=8, nodes_per_unit=4, jobs=None, seed=5)
    assert run.max_nic_rx_duty > 0.2                        # incast pauses did happen
    assert run.changes == [] and run.findings == []


# ----------------------------------------------------------------------- the worker's path, real collector cadence
def _pipeline_storms(faults, seconds, **sim_kw):
    """OPEN pfc_storm entity paths from the worker's batched path (`replay` through the
    `DetectionPipeline`: screened stacks, grouped rates) at the collectors' real cadence
    (PFC-only node ticks every 100 ms, full snapshots and switches every second)."""
    from fabricwatch.simulator.encoding import COLLECTOR_CADENCE
    from fabricwatch.protos.v1 import events_pb2 as evpb
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.streams.replay import replay
    topo = rail_optimised("sim", n_nodes=16, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, jobs=JOBS, faults=list(faults), rank_steps=False,
                           cadence=COLLECTOR_CADENCE, **sim_kw)
    snaps = [s for _ in range(int(round(seconds / COLLECTOR_CADENCE.pfc_interval_s))) for s in sim.tick()]
    result = replay(snaps, DetectionPipeline(topology=topo), finish=True)
    return sim, sorted({(e.entity.switch or e.entity.node, e.entity.port if e.entity.switch else e.entity.device)
                        for e in result.events if e.kind == "pfc_storm" and e.lifecycle == evpb.LIFECYCLE_OPEN})


def test_worker_path_at_real_cadence_detects_a_switch_storm_on_a_pinned_victim_and_ignores_idle_nodes():
    topo = rail_optimised("sim", n_nodes=16, nodes_per_unit=8, n_spines=2)
    busy, idle = topo.nic(N(1), "mlx5_2/1"), topo.nic(N(7), "mlx5_3/1")
    faults = [SwitchPfcStorm(busy.switch, busy.switch_port, onset_s=2.0, offset_s=6.0), PinnedCounter(N(1), "mlx5_2/1"),
              SwitchPfcStorm(idle.switch, idle.switch_port, onset_s=2.0, offset_s=6.0), PinnedCounter(N(7), "mlx5_3/1"),
              PfcStorm(((N(8), "mlx5_5/1"),), onset_s=2.0, offset_s=6.0)]          # an idle node's NIC pausing
    for exported in (False, True):
        sim, opened = _pipeline_storms(faults, 9.0, switch_tx_pause_duration=exported)
        assert [g.entity for g in sim.ground_truth() if g.expect_alert] == [f"{busy.switch}/{busy.switch_port}"]
        assert opened == [(busy.switch, busy.switch_port)], exported


def test_checkpoint_written_before_received_traffic_was_tracked_still_loads():
    import pickle

    from fabricwatch.models.pfc_storm import _NEVER, _Cells
    cells = _Cells(("mlx5_0/1", "mlx5_1/1"), 1)
    state = dict(cells.__dict__)
    del state["last_traffic_ns"]
    state["last_tx_ns"] = np.array([[5], [_NEVER]], dtype=np.int64)      # the old [entity, priority] layout
    old = object.__new__(_Cells)
    old.__dict__.update(state)
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.last_traffic_ns.shape == (2, 2, 1) and not hasattr(loaded, "last_tx_ns")
