"""The gNMI switch collector's snapshot assembly: one block per tick, quiet gaps, deletes,
reconnects and the subscribe request. The tests build gNMI `Notification`s with the stub classes.
"""
from __future__ import annotations

import math

import pytest
from helpers import NS, OC, notif, table

from fabricwatch.collectors.gnmi_profiles import compile_profile
from fabricwatch.collectors.gnmi_assembler import SwitchAssembler
from fabricwatch.collectors.gnmi_decode import canonical, gnmi_pb2, path_elems
from fabricwatch.collectors.gnmi_switch import (
    SwitchSettings,
    subscribe_request,
)
from fabricwatch.streams.validate import validate_snapshot


# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- assembly
def counters_of(port, octets):
    return notif([(OC.format(port) + "/state/counters/in-octets", octets),
                  (OC.format(port) + "/state/counters/out-octets", 2 * octets)])


def test_one_block_per_tick_sent_as_soon_as_the_sample_is_complete():
    asm = SwitchAssembler("leaf-01", "openconfig", interval_s=1.0)
    asm.apply(counters_of("Ethernet0", 10), 100.0, NS)
    asm.apply(counters_of("Ethernet8", 20), 100.0, NS)
    asm.apply(notif([(OC.format("Ethernet0") + "/state/oper-status", "UP")]), 100.0, NS)
    [first] = asm.sync(100.01, NS + 10)
    assert (first.seq, first.time_unix_ns, len(first.blocks)) == (1, NS, 1)
    # the next sample; an ON_CHANGE leaf in between neither opens nor closes a tick
    assert asm.apply(counters_of("Ethernet0", 11), 101.0, NS + 1_000_000_000) == []
    assert asm.apply(notif([(OC.format("Ethernet8") + "/state/oper-status", "DOWN")]), 101.05, NS) == []
    [second] = asm.apply(counters_of("Ethernet8", 21), 101.1, NS + 1_100_000_000)   # the last leaf: sent now
    assert (second.seq, second.time_unix_ns) == (2, NS + 1_000_000_000)   # when its first leaf arrived
    [block] = second.blocks
    assert list(block.entity_ids) == ["Ethernet0", "Ethernet8"]
    assert list(block.counter_names) == ["in-octets", "out-octets"]
    assert list(block.counters) == [11, 22, 21, 42]                       # raw, as served
    assert list(block.gauge_names) == ["oper_up"] and list(block.gauges) == [1.0, 0.0]
    assert asm.poll(105.0) == [] and asm.due_in(105.0) is None            # nothing new, nothing sent
    assert asm.stats["ticks_closed_by_complete"] == 1


def test_an_incomplete_tick_closes_after_the_quiet_gap_and_the_new_set_is_learnt():
    asm = SwitchAssembler("leaf-01", "openconfig", interval_s=1.0)       # quiet = 0.5 s
    asm.apply(counters_of("Ethernet0", 1), 0.0, NS)
    asm.apply(counters_of("Ethernet8", 1), 0.0, NS)
    asm.sync(0.0, NS)
    for k in range(1, 4):                                                # Ethernet8 went silent
        assert asm.apply(counters_of("Ethernet0", 1 + k), k, NS + k) == []
        assert asm.due_in(k + 0.1) == pytest.approx(0.4) and asm.poll(k + 0.4) == []
        [snap] = asm.poll(k + 0.5)
        assert table(snap)["Ethernet8"]["in-octets"] == 1                 # last value kept, not invented
    assert asm.stats["ticks_closed_by_quiet"] == 3
    [snap] = asm.apply(counters_of("Ethernet0", 5), 4.0, NS + 4)          # learnt: complete at once
    assert snap.seq == 5


def test_a_repeated_sample_leaf_closes_the_tick_even_without_a_gap():
    asm = SwitchAssembler("leaf-01", "openconfig", interval_s=1.0)
    asm.apply(counters_of("Ethernet0", 1), 0.0, NS)
    asm.apply(counters_of("Ethernet8", 1), 0.0, NS)
    asm.sync(0.0, NS)
    assert asm.apply(counters_of("Ethernet0", 2), 1.0, NS + 1) == []      # Ethernet8 does not come
    # back-to-back bursts: the repeat closes tick 2 (Ethernet0=2); Ethernet8 is taken as gone,
    # so tick 3 (Ethernet0=3) is complete at once
    two, three = asm.apply(counters_of("Ethernet0", 3), 1.01, NS + 2)
    assert (table(two)["Ethernet0"]["in-octets"], table(three)["Ethernet0"]["in-octets"]) == (2, 3)
    assert asm.stats["ticks_closed_by_repeat"] == 1
    # the same leaf from another subscription group (one stream per group) is not a new tick
    assert asm.apply(counters_of("Ethernet0", 4), 2.0, NS + 3, group=1) == []
    [four] = asm.apply(counters_of("Ethernet0", 4), 2.01, NS + 4, group=0)
    assert four.seq == 4


def test_missing_leaves_are_never_invented_and_deletes_remove_ports():
    asm = SwitchAssembler("leaf-01", "arista", interval_s=1.0, priorities=[3])
    pfc = OC.format("Ethernet2") + "/ethernet/pfc/priorities/priority[index=3]/state/in-frames"
    asm.apply(counters_of("Ethernet1", 5), 0.0, NS)
    asm.apply(counters_of("Ethernet2", 6), 0.0, NS)
    asm.apply(notif([(pfc, 9)]), 0.0, NS)
    asm.apply(counters_of("Ethernet3", 7), 0.0, NS)
    asm.apply(notif([(OC.format("Ethernet3") + "/state/oper-status", "UP")]), 0.0, NS)
    [snap] = asm.sync(0.0, NS)
    assert validate_snapshot(snap, NS).problems == []
    # Ethernet2 reports a PFC counter the others lack: its own block, no zero for the others
    assert [(list(b.entity_ids), list(b.counter_names)) for b in snap.blocks] == [
        (["Ethernet1", "Ethernet3"], ["in-octets", "out-octets"]),
        (["Ethernet2"], ["in-octets", "out-octets", "pfc3-rx-pkts"])]
    assert all(list(b.gauge_names) == ["oper_up"] for b in snap.blocks)
    assert math.isnan(table(snap)["Ethernet1"]["oper_up"])
    # a leaf missing from a later sample keeps its last value (gNMI state persists)
    asm.apply(counters_of("Ethernet1", 8), 1.0, NS + 1)
    asm.apply(notif(deletes=[OC.format("Ethernet3")]), 1.0, NS + 1)
    [snap] = asm.poll(2.0)
    t = table(snap)
    assert set(t) == {"Ethernet1", "Ethernet2"}
    assert (t["Ethernet1"]["in-octets"], t["Ethernet2"]["in-octets"]) == (8, 6)


def test_a_reconnect_drops_the_half_tick_and_keeps_seq_and_time_increasing():
    asm = SwitchAssembler("leaf-01", "openconfig", interval_s=1.0)
    asm.apply(counters_of("Ethernet0", 1), 0.0, NS)
    asm.apply(counters_of("Ethernet8", 1), 0.0, NS)
    [a] = asm.sync(0.0, NS)
    asm.apply(counters_of("Ethernet0", 2), 1.0, NS + 5)
    asm.reset()                                          # stream broke mid-tick
    assert asm.stats["partial_ticks_dropped"] == 1 and asm.poll(5.0) == []
    asm.apply(counters_of("Ethernet0", 0), 6.0, NS - 100)   # a clock step back, new stream
    [b] = asm.sync(6.0, NS - 100)
    assert (b.seq, b.time_unix_ns > a.time_unix_ns) == (2, True)
    assert list(b.blocks[0].entity_ids) == ["Ethernet0"]   # the table was rebuilt from the new dump
    assert list(b.blocks[0].counters) == [0, 0]        # raw: the reset is for the worker to see


def test_no_sync_response_falls_back_after_the_sync_timeout():
    asm = SwitchAssembler("leaf-01", "openconfig", interval_s=1.0, sync_timeout_s=3)
    asm.reset(10.0)
    asm.apply(counters_of("Ethernet0", 1), 10.5, NS)
    assert asm.poll(12.0) == [] and asm.due_in(12.0) == pytest.approx(1.0)
    [snap] = asm.poll(13.1)
    assert asm.synced and asm.stats["sync_timeouts"] == 1 and snap.seq == 1


def test_subscribe_request_sample_interval_in_nanoseconds_and_on_change_heartbeat():
    s = SwitchSettings(name="leaf", target="10.0.0.1:6030", profile="arista", sample_interval_ms=250,
                       heartbeat_interval_ms=30_000, priorities=(3, 4))
    profile = compile_profile("arista")
    req = subscribe_request(profile.groups[0], s, profile)
    sl = req.subscribe
    assert sl.mode == gnmi_pb2.SubscriptionList.STREAM and sl.encoding == gnmi_pb2.JSON_IETF
    by_path = {canonical(path_elems(sub.path)): sub for sub in sl.subscription}
    counters = by_path["interfaces/interface[name=*]/state/counters"]
    assert (counters.mode, counters.sample_interval) == (gnmi_pb2.SAMPLE, 250_000_000)
    oper = by_path["interfaces/interface[name=*]/state/oper-status"]
    assert (oper.mode, oper.heartbeat_interval) == (gnmi_pb2.ON_CHANGE, 30_000_000_000)
    assert {p for p in by_path if "pfc" in p} == {
        f"interfaces/interface[name=*]/ethernet/pfc/priorities/priority[index={p}]/state" for p in (3, 4)}
    sonic = compile_profile("sonic")
    req = subscribe_request(sonic.groups[0], SwitchSettings(name="s", target="h:8080", profile="sonic"), sonic)
    assert req.subscribe.prefix.target == "COUNTERS_DB"


