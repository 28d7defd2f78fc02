"""PFC storm detection: the watchdog rule (PfcWatchdog) on hand-built frames.
"""
from __future__ import annotations


import numpy as np
import pytest

from helpers import INTERVAL_S, MS

from fabricwatch.models.frames import NIC_PORT, SWITCH_PORT, EntityFrame, SourceView
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import (StormLocator)
from fabricwatch.models.topology import rail_optimised

DETECT_MS, RESTORE_MS = 200, 400


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
