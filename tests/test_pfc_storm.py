"""PFC storm detection: the watchdog rule (hand-built frames) and source localisation, end to
end through the cluster simulator (protobuf snapshots -> to_view -> RateTracker ->
PfcWatchdog -> StormLocator)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from fabricwatch.models.findings import OPEN, RESOLVED, UPDATE, EntityRef, Evidence
from fabricwatch.models.frames import NIC_PORT, SWITCH_PORT, EntityFrame, SourceView
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PauseStateChange, PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import (ORPHAN_GRACE_MS, SILENT_SOURCE_CONFIDENCE, SWITCH_SOURCE_CONFIDENCE,
                                              StormLocator)
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import AdminToggle, PfcStorm, PinnedCounter, SwitchPfcStorm
from fabricwatch.simulator.host_faults import NodeReboot
from fabricwatch.simulator.workload import Job
from fabricwatch.streams.decode import to_view

MS = 1_000_000
INTERVAL_S = 0.1
DETECT_MS, RESTORE_MS = 200, 400


def N(i: int) -> str:
    return f"node-{i:04d}"


# ----------------------------------------------------------------------- hand-built frames
NIC_NAMES = ("rx_prio3_pause_duration", "tx_prio3_pause_duration", "rx_prio3_pause", "tx_prio3_pause",
             "rx_prio3_bytes", "tx_prio3_bytes", "port_xmit_wait")
SW_NAMES = ("pfc3-rx-pause-duration-us", "pfc3-rx-pkts", "pfc3-tx-pkts", "queue3-transmit-octets")
SW_GAUGES = ("port_speed_gbps", "oper_up", "admin_up", "queue3-occupancy-bytes")
LINE_BPS = 400e9 / 8
# traffic a NIC received before it stopped draining (a stuck host's peer had data for it)
RX_BEFORE = 1e9


class NicPort:
    """One NIC port's raw totals, advanced interval by interval (duties in s/s, traffic in bytes/s)."""

    def __init__(self, source="node-0003", port="mlx5_2/1", names=NIC_NAMES):
        self.source, self.port, self.names = source, port, names
        self.totals = dict.fromkeys(names, 1_000_000.0)
        self.t_ns = 1_000 * 10**9
        self.tracker, self.wd = RateTracker(), PfcWatchdog()

    def step(self, dt_s=INTERVAL_S, rx_duty=0.0, tx_duty=0.0, rx_bps=0.0, tx_bps=0.0, xmit_wait=0.0,
             pause_frames=0.0, reset=False):
        inc = {"rx_prio3_pause_duration": rx_duty * dt_s * 1e6, "tx_prio3_pause_duration": tx_duty * dt_s * 1e6,
               "rx_prio3_pause": pause_frames * dt_s, "tx_prio3_pause": pause_frames * dt_s,
               "rx_prio3_bytes": rx_bps * dt_s, "tx_prio3_bytes": tx_bps * dt_s, "port_xmit_wait": xmit_wait * dt_s}
        for k in self.totals:
            self.totals[k] = (0.0 if reset else self.totals[k]) + inc.get(k, 0.0)
        self.t_ns += int(round(dt_s * 1e9))
        frame = EntityFrame(NIC_PORT, (self.port,), self.names,
                            np.array([[self.totals[k] for k in self.names]]).astype(np.uint64),
                            ("netdev_speed_mbps",), np.array([[400_000.0]]), [{}])
        self.tracker.update(self.source, frame, self.t_ns)
        return self.wd.update(SourceView("c1", self.source, "node", self.t_ns, 0, [frame]))

    def run(self, n, **kw):
        return [c for _ in range(n) for c in self.step(**kw)]


class SwitchPort(NicPort):
    def __init__(self, source="leaf-u0-r2", port="Ethernet4", names=SW_NAMES):
        super().__init__(source, port, names)

    def step(self, dt_s=INTERVAL_S, rx_duty=0.0, tx_bps=0.0, occupancy=0.0, oper_up=1.0, tx_duty=0.0, rx_bps=0.0,
             **_):
        inc = {"pfc3-rx-pause-duration-us": rx_duty * dt_s * 1e6, "pfc3-rx-pkts": rx_duty * dt_s * 23_000,
               "queue3-transmit-octets": tx_bps * dt_s, "pfc3-tx-pause-duration-us": tx_duty * dt_s * 1e6,
               "pfc3-tx-pkts": tx_duty * dt_s * 23_000, "in-octets": rx_bps * dt_s}
        for k in self.totals:
            self.totals[k] += inc.get(k, 0.0)
        self.t_ns += int(round(dt_s * 1e9))
        frame = EntityFrame(SWITCH_PORT, (self.port,), self.names,
                            np.array([[self.totals[k] for k in self.names]]).astype(np.uint64),
                            SW_GAUGES, np.array([[400.0, oper_up, oper_up, occupancy]]), [{}])
        self.tracker.update(self.source, frame, self.t_ns)
        return self.wd.update(SourceView("c1", self.source, "switch", self.t_ns, 0, [frame]))


def roles(changes):
    return [(c.entity.path(), c.role, c.active) for c in changes]


@pytest.mark.parametrize("kwargs, name", [
    ({"detection_time_ms": 99}, "detection_time_ms"), ({"detection_time_ms": 5001}, "detection_time_ms"),
    ({"restoration_time_ms": 99}, "restoration_time_ms"), ({"restoration_time_ms": 60_001}, "restoration_time_ms"),
    ({"paused_duty_min": 0.0}, "paused_duty_min"), ({"pausing_duty_min": 1.5}, "pausing_duty_min"),
])
def test_configuration_is_validated_with_the_parameter_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PfcWatchdog(**kwargs)


def test_restoration_defaults_to_twice_the_detection_time():
    assert PfcWatchdog()._rest_ns == 400 * MS
    assert PfcWatchdog(detection_time_ms=5000)._rest_ns == 10_000 * MS     # within 100..60000
    assert PfcWatchdog(300, 100)._rest_ns == 100 * MS


def test_locator_validates_grace():
    with pytest.raises(ValueError, match="orphan_grace_ms"):
        StormLocator(rail_optimised("c1", 2, nodes_per_unit=2, n_spines=1), orphan_grace_ms=-1)


def test_stuck_host_confirms_on_the_second_agreeing_sample_and_restores_after_400ms():
    nic = NicPort()
    assert nic.run(3, rx_bps=RX_BEFORE) == []                                   # primes the rates
    assert nic.step(tx_duty=0.999) == []                      # one sample is never enough
    onset = nic.step(tx_duty=0.999)
    assert roles(onset) == [("c1/node-0003/mlx5_2/1", PAUSING, True)]
    assert onset[0].onset_ns == nic.t_ns - 200 * MS and onset[0].at_ns == nic.t_ns
    assert onset[0].value("tx_pause_duty") == pytest.approx(0.999)
    assert nic.run(20, tx_duty=0.999) == []                   # no repeats while it lasts
    assert nic.run(3) == []                                   # 300 ms quiet < restoration
    back = nic.step()
    assert roles(back) == [("c1/node-0003/mlx5_2/1", PAUSING, False)]


def test_a_single_long_sample_does_not_confirm():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    assert nic.step(dt_s=5.0, tx_duty=1.0) == []             # 5 s charged, capped at 199.999 ms
    assert len(nic.step(tx_duty=1.0)) == 1


def test_real_elapsed_time_is_charged_not_sample_counts():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    assert nic.run(3, dt_s=0.05, tx_duty=1.0) == []          # 150 ms in three samples
    assert len(nic.step(dt_s=0.05, tx_duty=1.0)) == 1        # 200 ms


def test_timestamp_jitter_does_not_cost_a_third_sample():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    assert nic.step(dt_s=0.0998, tx_duty=1.0) == []
    assert len(nic.step(dt_s=0.0999, tx_duty=1.0)) == 1      # 199.7 ms: within the 1 % tolerance


def test_burst_shorter_than_detection_time_is_ignored():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    for _ in range(5):
        assert nic.step(tx_duty=1.0) == []
        assert nic.step(tx_duty=0.3) == []


def test_counter_reset_is_no_evidence_and_restarts_the_countdown():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    assert nic.step(tx_duty=1.0) == []
    assert nic.step(tx_duty=1.0, reset=True) == []           # reboot: every total restarts near 0
    assert nic.step(tx_duty=1.0) == []                        # the countdown starts over
    assert len(nic.step(tx_duty=1.0)) == 1
    assert nic.tracker.stats["counter_resets"] > 0


def test_reset_during_a_storm_holds_restoration():
    nic = NicPort()
    nic.run(2, rx_bps=RX_BEFORE)
    assert len(nic.run(2, tx_duty=1.0)) == 1
    assert nic.run(2) == []                                   # 200 ms quiet
    assert nic.step(reset=True) == []                         # NaN: neither quiet nor paused
    assert nic.step() == []                                   # 300 ms quiet
    assert roles(nic.step()) == [("c1/node-0003/mlx5_2/1", PAUSING, False)]


def test_xon_frames_are_not_pauses():
    nic = NicPort()
    nic.run(2)
    assert nic.run(30, pause_frames=20_000.0, xmit_wait=1e6, tx_bps=1e9, rx_bps=1e9) == []


def test_paused_with_data_waiting_is_a_victim_but_paused_with_nothing_to_send_is_not():
    idle = NicPort()
    idle.run(2)
    assert idle.run(10, rx_duty=0.95) == []                   # no port_xmit_wait: nothing queued
    busy = NicPort()
    busy.run(2)
    assert roles(busy.run(3, rx_duty=0.95, xmit_wait=7e6, tx_bps=1e9)) == [("c1/node-0003/mlx5_2/1", PAUSED, True)]


def test_incast_pauses_while_traffic_flows_are_not_a_storm():
    nic = NicPort()
    nic.run(2)
    # heavily paused, yet sending half of line rate: the pause is intermittent congestion
    assert nic.run(30, rx_duty=0.9, xmit_wait=7e6, tx_bps=0.5 * LINE_BPS) == []
    # a receiver that pauses hard but still takes in a third of line rate is slow, not stuck
    assert nic.run(30, tx_duty=0.97, rx_bps=0.3 * LINE_BPS) == []
    # intermittent pausing below the duty thresholds, for a long time
    assert nic.run(50, rx_duty=0.6, tx_duty=0.5, xmit_wait=7e6, tx_bps=1e9) == []


def test_nic_without_xmit_wait_uses_recent_traffic_as_evidence_of_queued_data():
    names = tuple(n for n in NIC_NAMES if n != "port_xmit_wait")
    nic = NicPort(names=names)
    nic.run(3, tx_bps=20e9)                                   # it was sending
    assert roles(nic.run(3, rx_duty=1.0)) == [("c1/node-0003/mlx5_2/1", PAUSED, True)]
    quiet = NicPort(names=names)
    quiet.run(3)
    quiet.run(15)                                              # idle for 1.5 s
    assert quiet.run(5, rx_duty=1.0) == []


def test_switch_queue_needs_occupancy_and_no_transmission():
    empty = SwitchPort()
    empty.run(2)
    assert empty.run(10, rx_duty=1.0, occupancy=0.0) == []    # paused, nothing queued: not a storm
    flowing = SwitchPort()
    flowing.run(2)
    assert flowing.run(10, rx_duty=0.85, occupancy=3e6, tx_bps=0.4 * LINE_BPS) == []
    held = SwitchPort()
    held.run(2)
    assert roles(held.run(2, rx_duty=0.998, occupancy=3e6)) == [("c1/leaf-u0-r2/Ethernet4", PAUSED, True)]


def SwitchPortTx():
    """A SONiC port: also the pauses it sends (SAI PFC_3_TX_PAUSE_DURATION_US) and its ingress."""
    return SwitchPort(names=SW_NAMES + ("pfc3-tx-pause-duration-us", "in-octets"))


def test_switch_port_sending_pauses_while_receiving_nothing_is_pausing():
    port = SwitchPortTx()
    port.run(3, rx_bps=5e9)                                    # its peer was sending to it
    onset = port.run(2, tx_duty=0.999)
    assert roles(onset) == [("c1/leaf-u0-r2/Ethernet4", PAUSING, True)]
    assert onset[0].value("tx_pause_duty") == pytest.approx(0.999)
    assert roles(port.run(5)) == [("c1/leaf-u0-r2/Ethernet4", PAUSING, False)]
    still_flowing = SwitchPortTx()
    still_flowing.run(3, rx_bps=5e9)
    assert still_flowing.run(10, tx_duty=0.97, rx_bps=0.3 * LINE_BPS) == []   # congestion, not stuck
    idle = SwitchPortTx()
    idle.run(15)
    assert idle.run(10, tx_duty=0.999) == []                   # its peer has nothing to send: holds nothing
    # without the column (EOS, Cumulus) the rule is as before: nothing is read from frame counts
    legacy = SwitchPort()
    legacy.run(3)
    assert legacy.run(10, tx_bps=5e9) == []


def test_nic_with_pinned_port_xmit_wait_falls_back_on_its_recent_traffic():
    pinned = 2.0**32 - 1
    busy = NicPort()
    busy.totals["port_xmit_wait"] = pinned
    busy.run(3, tx_bps=20e9)                                   # sending; port_xmit_wait stuck at all-ones
    onset = busy.run(2, rx_duty=0.97)                          # it waits, but the counter cannot move
    assert roles(onset) == [("c1/node-0003/mlx5_2/1", PAUSED, True)]
    assert onset[0].value("recent_traffic") == 1.0 and np.isnan(onset[0].value("port_xmit_wait_per_s"))
    assert busy.tracker.stats["saturated_counters"] == 4            # every interval after the first sample
    idle = NicPort()
    idle.totals["port_xmit_wait"] = pinned
    idle.run(15)
    assert idle.run(10, rx_duty=0.97) == []                    # pinned is unknown, not "waiting"


def test_admin_down_port_is_no_evidence():
    port = SwitchPort()
    port.run(2)
    assert port.run(10, rx_duty=1.0, occupancy=3e6, oper_up=0.0) == []


def test_a_port_list_change_keeps_the_state_of_the_ports_that_remain():
    wd, tracker = PfcWatchdog(), RateTracker()
    names = ("tx_prio3_pause_duration", "rx_prio3_bytes")

    def tick(k, ids):
        f = EntityFrame(NIC_PORT, ids, names, np.array([[k * 100_000, k * 10**8]] * len(ids), np.uint64), (),
                        np.empty((len(ids), 0)), [{}] * len(ids))
        tracker.update("n1", f, k * 100 * MS)
        return wd.update(SourceView("c1", "n1", "node", k * 100 * MS, k, [f]))

    tick(0, ("mlx5_0/1", "mlx5_1/1"))
    assert [c.entity.device for c in tick(1, ("mlx5_0/1", "mlx5_1/1")) + tick(2, ("mlx5_0/1", "mlx5_1/1"))] == [
        "mlx5_0", "mlx5_1"]
    tick(3, ("mlx5_1/1",))                                    # new layout: rates restart, state kept
    assert [(s, e, r) for s, e, _, r in wd.active()] == [("n1", "mlx5_1/1", PAUSING)]


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
    assert loaded.last_traffic_ns[:, 0, 0].tolist() == [5, _NEVER] and (loaded.last_traffic_ns[:, 1] == _NEVER).all()
