"""The gNMI switch collector: profiles, snapshot assembly, config, and real gNMI streams.

Unit tests build gNMI `Notification`s with the stub classes. The end-to-end tests stream
from the openconfig/gnmi fake target (deploy/gnmi/build-fake-server.sh builds it with Go;
skipped only when Go is missing), over TLS/mTLS, through the real gRPC ingest service.
"""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from helpers import RecordingSink, entity_rows

from fabricwatch.collectors.gnmi_profiles import PROFILES, compile_profile, expand_paths, split_path
from fabricwatch.collectors.gnmi_assembler import SwitchAssembler
from fabricwatch.collectors.gnmi_decode import canonical, decode_value, gnmi_pb2, gnmi_pb2_grpc, path_elems, xpath_to_path
from fabricwatch.collectors.gnmi_switch import (
    SwitchCollector,
    SwitchSettings,
    TlsSettings,
    auth_metadata,
    subscribe_request,
)
from fabricwatch.collectors.switch import collect, describe, load_config, parse_config
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.decode import to_view
from fabricwatch.streams.gateway import IngestService
from fabricwatch.streams.validate import validate_snapshot

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "gnmi"
NS = 1_800_000_000_000_000_000


# ----------------------------------------------------------------------------- helpers
def tv(value) -> gnmi_pb2.TypedValue:
    if isinstance(value, bool):
        return gnmi_pb2.TypedValue(bool_val=value)
    if isinstance(value, int):
        return gnmi_pb2.TypedValue(uint_val=value)
    if isinstance(value, float):
        return gnmi_pb2.TypedValue(double_val=value)
    if isinstance(value, str):
        return gnmi_pb2.TypedValue(string_val=value)
    return gnmi_pb2.TypedValue(json_ietf_val=json.dumps(value).encode())


def notif(updates=(), *, target="", deletes=(), ts=1) -> gnmi_pb2.Notification:
    n = gnmi_pb2.Notification(timestamp=ts)
    if target:
        n.prefix.CopyFrom(gnmi_pb2.Path(target=target))
    for path, value in updates:
        n.update.add(path=xpath_to_path(path), val=value if isinstance(value, gnmi_pb2.TypedValue) else tv(value))
    for path in deletes:
        n.delete.append(xpath_to_path(path))
    return n


def table(snap: pb.Snapshot) -> dict[str, dict[str, float]]:
    """{port: {column: value}} over every SWITCH_PORT block (counters and gauges)."""
    out: dict[str, dict[str, float]] = {}
    for block in snap.blocks:
        assert block.entity_kind == pb.ENTITY_KIND_SWITCH_PORT
        for row in entity_rows(block):
            out[row.id] = {**dict(zip(block.counter_names, row.counters)), **dict(zip(block.gauge_names, row.gauges))}
    return out


def one_tick(profile, *notifications, priorities=range(8), target="") -> dict[str, dict[str, float]]:
    asm = SwitchAssembler("sw-1", profile, interval_s=1.0, priorities=priorities)
    for n in notifications:
        assert asm.apply(n, 0.0, NS) == []          # nothing leaves before the sync_response
    [snap] = asm.sync(0.01, NS)
    assert validate_snapshot(snap, NS).problems == []
    return table(snap)


OC = "/interfaces/interface[name={}]"


# ----------------------------------------------------------------------------- path -> name
def test_openconfig_counters_speed_identityref_and_status():
    t = one_tick("openconfig", notif([
        (OC.format("Ethernet0") + "/state/counters/in-octets", 12_345),
        (OC.format("Ethernet0") + "/state/counters/out-pkts", tv("18446744073709551615")),   # JSON_IETF uint64
        (OC.format("Ethernet0") + "/state/oper-status", "UP"),
        (OC.format("Ethernet0") + "/state/admin-status", "UP"),
        (OC.format("Ethernet0") + "/ethernet/state/port-speed", "openconfig-if-ethernet:SPEED_400GB"),
        (OC.format("Ethernet4") + "/state/counters/in-octets", 7),
        (OC.format("Ethernet4") + "/state/counters/out-pkts", 0),
        (OC.format("Ethernet4") + "/state/oper-status", "LOWER_LAYER_DOWN"),
        (OC.format("Ethernet4") + "/ethernet/state/port-speed", "SPEED_2500MB"),
        (OC.format("Ethernet8") + "/state/counters/in-octets", 1),
        (OC.format("Ethernet8") + "/state/counters/out-pkts", 1),
        (OC.format("Ethernet8") + "/ethernet/state/port-speed", "openconfig-if-ethernet:SPEED_UNKNOWN"),
    ]))
    assert t["Ethernet0"] == {"in-octets": 12_345, "out-pkts": 2**64 - 1, "port_speed_gbps": 400.0,
                              "oper_up": 1.0, "admin_up": 1.0}
    assert (t["Ethernet4"]["port_speed_gbps"], t["Ethernet4"]["oper_up"]) == (2.5, 0.0)
    assert math.isnan(t["Ethernet4"]["admin_up"])        # never read
    assert math.isnan(t["Ethernet8"]["port_speed_gbps"])  # SPEED_UNKNOWN: no number


@pytest.mark.parametrize("order", [("interface-transitions", "carrier-transitions"),
                                   ("carrier-transitions", "interface-transitions")])
def test_interface_transitions_win_over_deprecated_carrier_transitions(order):
    values = {"interface-transitions": 4, "carrier-transitions": 9}
    t = one_tick("openconfig", *(notif([(OC.format("Ethernet0") + f"/state/counters/{leaf}", values[leaf])])
                                 for leaf in order))
    assert t["Ethernet0"] == {"interface-transitions": 4}


def test_module_prefixed_json_ietf_container_is_flattened():
    # a device that sends state/counters as one JSON_IETF object with module-prefixed members
    t = one_tick("openconfig", notif([(OC.format("Ethernet0") + "/state/counters",
                                       {"openconfig-interfaces:in-octets": "1000", "in-errors": "3",
                                        "openconfig-interfaces:in-unicast-pkts": "5"})]))
    assert t == {"Ethernet0": {"in-octets": 1000, "in-errors": 3}}


def test_sonic_json_string_values_queues_status_and_name_map():
    counters = {
        "Ethernet0": {"SAI_PORT_STAT_IF_IN_OCTETS": "123", "SAI_PORT_STAT_IF_IN_UCAST_PKTS": "10",
                      "SAI_PORT_STAT_IF_IN_NON_UCAST_PKTS": "5", "SAI_PORT_STAT_PFC_3_RX_PKTS": "7",
                      "SAI_PORT_STAT_PFC_3_TX_PKTS": "0", "SAI_PORT_STAT_PFC_3_RX_PAUSE_DURATION_US": "250",
                      "SAI_PORT_STAT_PFC_4_RX_PKTS": "99", "SAI_PORT_STAT_ETHER_STATS_JABBERS": "0"},
        "Ethernet8": {"SAI_PORT_STAT_IF_IN_OCTETS": "456", "SAI_PORT_STAT_IF_IN_UCAST_PKTS": "1",
                      "SAI_PORT_STAT_IF_IN_NON_UCAST_PKTS": "1", "SAI_PORT_STAT_PFC_3_RX_PKTS": "0",
                      "SAI_PORT_STAT_PFC_3_TX_PKTS": "0", "SAI_PORT_STAT_PFC_3_RX_PAUSE_DURATION_US": "0"},
    }
    queues = {"Ethernet0:3": {"SAI_QUEUE_STAT_PACKETS": "11", "SAI_QUEUE_STAT_BYTES": "2200",
                              "SAI_QUEUE_STAT_CURR_OCCUPANCY_BYTES": "4096", "SAI_QUEUE_STAT_DROPPED_PACKETS": "0"},
              "Ethernet0:12": {"SAI_QUEUE_STAT_PACKETS": "5"}}      # a multicast queue: not a priority
    t = one_tick(
        "sonic",
        notif([("COUNTERS_PORT_NAME_MAP", {"Ethernet0": "oid:0x1000000000002", "Ethernet8": "oid:0x100000000000a"})],
              target="COUNTERS_DB"),
        notif([("COUNTERS/Ethernet*", counters)], target="COUNTERS_DB"),
        notif([("COUNTERS/Ethernet0/Queues", queues)], target="COUNTERS_DB"),
        # one counter as a plain string_val leaf, and one under a raw COUNTERS:oid key
        notif([("COUNTERS/Ethernet8/SAI_PORT_STAT_PFC_3_TX_PKTS", "42"),
               ("COUNTERS/oid:0x100000000000a/SAI_PORT_STAT_IF_OUT_OCTETS", "77")], target="COUNTERS_DB"),
        notif([("PORT_TABLE/Ethernet*", {"Ethernet0": {"oper_status": "up", "admin_status": "up", "speed": "400000"},
                                         "Ethernet8": {"oper_status": "down", "admin_status": "up",
                                                       "speed": "100000"}})], target="APPL_DB"),
        priorities=(3,),
    )
    assert t["Ethernet0"] == {
        "in-octets": 123, "in-pkts": 15, "pfc3-rx-pkts": 7, "pfc3-tx-pkts": 0, "pfc3-rx-pause-duration-us": 250,
        "queue3-transmit-pkts": 11, "queue3-transmit-octets": 2200, "queue3-dropped-pkts": 0,
        "port_speed_gbps": 400.0, "oper_up": 1.0, "admin_up": 1.0, "queue3-occupancy-bytes": 4096.0}
    assert t["Ethernet8"]["pfc3-tx-pkts"] == 42 and t["Ethernet8"]["out-octets"] == 77
    assert (t["Ethernet8"]["in-pkts"], t["Ethernet8"]["oper_up"], t["Ethernet8"]["port_speed_gbps"]) == (2, 0.0, 100.0)
    assert math.isnan(t["Ethernet8"]["queue3-occupancy-bytes"])


def test_sonic_transmit_pause_duration_per_priority_travels_in_us():
    counters = {"Ethernet0": {"SAI_PORT_STAT_PFC_3_TX_PAUSE_DURATION_US": "987654",
                              "SAI_PORT_STAT_PFC_3_RX_PAUSE_DURATION_US": "12",
                              "SAI_PORT_STAT_PFC_4_TX_PAUSE_DURATION_US": "5"},      # priority not configured
                "Ethernet8": {"SAI_PORT_STAT_PFC_3_RX_PAUSE_DURATION_US": "0"}}      # not polled on this port
    t = one_tick("sonic", notif([("COUNTERS/Ethernet*", counters)], target="COUNTERS_DB"), priorities=(3,))
    assert t["Ethernet0"] == {"pfc3-tx-pause-duration-us": 987_654, "pfc3-rx-pause-duration-us": 12}
    assert "pfc3-tx-pause-duration-us" not in t["Ethernet8"]
    m = compile_profile("sonic").match("COUNTERS/Ethernet*/Ethernet4/SAI_PORT_STAT_PFC_7_TX_PAUSE_DURATION_US")
    assert m.rule.output_name(m.binds) == "pfc7-tx-pause-duration-us" and m.rule.convert == "raw"
    from fabricwatch.counters import spec_for
    assert (spec_for("pfc7-tx-pause-duration-us").unit, spec_for("pfc7-tx-pause-duration-us").rate_unit) == ("us",
                                                                                                           "s/s")


def test_queue_ecn_marks_and_drops_per_profile():
    """SONiC's SAI queue stats and Cumulus's queue leaves land as queue<p>-ecn-marked-pkts / -dropped-pkts."""
    queues = {"Ethernet0:3": {"SAI_QUEUE_STAT_WRED_ECN_MARKED_PACKETS": "123456", "SAI_QUEUE_STAT_DROPPED_PACKETS": "7"},
              "Ethernet0:0": {"SAI_QUEUE_STAT_DROPPED_PACKETS": "99"}}           # lossy queue, priority not configured
    t = one_tick("sonic", notif([("COUNTERS/Ethernet0/Queues", queues)], target="COUNTERS_DB"), priorities=(3,))
    assert t == {"Ethernet0": {"queue3-ecn-marked-pkts": 123_456, "queue3-dropped-pkts": 7}}
    q = "/qos/interfaces/interface[interface-id=swp1]/output/queues/queue[name=3]/state/"
    t = one_tick("cumulus", notif([(q + "ecn-marked-pkts", 50), (q + "no-buffer-uc-dropped-pkts", 2),
                                   (q + "wred-dropped-pkts", 1)]), priorities=[3])
    assert t == {"swp1": {"queue3-ecn-marked-pkts": 50, "queue3-no-buffer-dropped-pkts": 2,
                          "queue3-wred-dropped-pkts": 1}}
    t = one_tick("openconfig", notif([(q + "dropped-pkts", 4)]), priorities=[3])
    assert t == {"swp1": {"queue3-dropped-pkts": 4}}


def test_arista_pfc_frames_and_pause_time_converted_from_ns_to_us():
    pfc = ("/openconfig-interfaces:interfaces/interface[name=Ethernet1/1]/openconfig-if-ethernet:ethernet"
           "/arista-intf-augments:pfc/priorities/priority[index={}]/state/{}")
    t = one_tick("arista", notif([
        (pfc.format(3, "in-frames"), 1000), (pfc.format(3, "out-frames"), 10),
        (pfc.format(3, "pfc-on-total-rx-time"), 1_234_567_891),        # ns
        (pfc.format(3, "pfc-on-max-rx-time"), 5),                      # no rule
        (pfc.format(0, "in-frames"), 5),                               # priority not configured
        ("/interfaces/interface[name=Ethernet1/1]/state/counters/carrier-transitions", 6),
    ]), priorities=[3, 4])
    assert t == {"Ethernet1/1": {"interface-transitions": 6, "pfc3-rx-pkts": 1000, "pfc3-tx-pkts": 10,
                                 "pfc3-rx-pause-duration-us": 1_234_567}}


def test_cumulus_switch_priority_pause_packets_numeric_speed_and_basic_auth():
    t = one_tick("cumulus", notif([
        ("/qos/interfaces/interface[interface-id=swp1]/state/switch-priority[priority=3]/counters/out-pause-pkts", 17),
        ("/interfaces/interface[name=swp1]/ethernet/state/counters/in-pfc3-packets", 5),
        ("/interfaces/interface[name=swp1]/ethernet/state/counters/carrier-transitions", 2),
        ("/interfaces/interface[name=swp1]/ethernet/state/port-speed", 400_000),    # Mb/s
        ("/qos/interfaces/interface[interface-id=swp1]/output/queues/queue[name=3]/state/transmit-octets", 9),
    ]), priorities=[3])
    assert t == {"swp1": {"interface-transitions": 2, "pfc3-rx-pkts": 5, "pfc3-tx-pkts": 17,
                          "queue3-transmit-octets": 9, "port_speed_gbps": 400.0}}
    s = SwitchSettings(name="leaf", target="10.0.0.1:9339", profile="cumulus", username="cumulus", password="pw")
    assert auth_metadata(s, compile_profile("cumulus")) == (("authorization", "Basic Y3VtdWx1czpwdw=="),)
    assert auth_metadata(s, compile_profile("arista")) == (("username", "cumulus"), ("password", "pw"))


def test_every_profile_rule_template_compiles_and_has_a_known_converter():
    for name in PROFILES:
        profile = compile_profile(name)
        assert profile.rules and profile.groups
        for group in profile.groups:
            for path, _ in expand_paths(group, [3]):
                assert split_path(path)                    # every subscription path parses


def test_element_form_paths_as_the_fake_target_sends_them():
    path = gnmi_pb2.Path(element=["openconfig-interfaces:interfaces", "interface[name=Ethernet1/1]", "state"])
    assert canonical(path_elems(path)) == "interfaces/interface[name=Ethernet1/1]/state"
    assert decode_value(gnmi_pb2.TypedValue(json_ietf_val=b'"42"')) == "42"
    assert decode_value(gnmi_pb2.TypedValue(decimal_val=gnmi_pb2.Decimal64(digits=125, precision=1))) == 12.5


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


# ----------------------------------------------------------------------------- configuration
def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_config_defaults_credentials_and_check_output(tmp_path, capsys):
    write(tmp_path / "ca.pem", "x")
    write(tmp_path / "creds.yaml", "username: telemetry\npassword: s3cret\n")
    cfg = tmp_path / "switches.yaml"
    cfg.write_text("""
cluster: c1
gateway: {target: "127.0.0.1:50051", token: t0k}
defaults:
  profile: arista
  credentials: creds.yaml
  priorities: [4, 3]
  tls: {ca: ca.pem}
switches:
  - {name: spine-01, target: "10.0.0.1:6030"}
  - {name: leaf-01, target: "10.0.0.2:9339", profile: cumulus, sample_interval_ms: 500,
     tls: {server_name: leaf-01.mgmt}}
""")
    config = load_config(cfg)
    spine, leaf = config.switches
    assert (spine.profile, spine.priorities, spine.username, spine.password) == \
        ("arista", (3, 4), "telemetry", "s3cret")
    assert spine.tls.ca == str(tmp_path / "ca.pem")
    assert (leaf.tls.ca, leaf.tls.server_name, leaf.sample_interval_ms) == \
        (str(tmp_path / "ca.pem"), "leaf-01.mgmt", 500)
    assert "s3cret" not in repr(leaf) and "t0k" not in repr(config.gateway)
    text = describe(config)
    assert "switch leaf-01 10.0.0.2:9339 profile=cumulus TLS auth=basic" in text
    assert "group pfc-ext (optional): 4 paths" in text   # {prio} x priorities [3, 4]


@pytest.mark.parametrize("switch, error", [
    ({"name": "a", "target": "h:1", "skipverify": True}, r"switches\[0\] \(a\): unknown key 'skipverify'"),
    ({"name": "a", "target": "h:1", "tls": {"skip_verfy": True}}, r"\.tls: unknown key 'skip_verfy'"),
    ({"name": "a", "target": "h"}, r"\.target: target 'h' is not host:port"),
    ({"name": "a", "target": "h:1", "profile": "junos"}, r"unknown profile 'junos'"),
    ({"name": "a", "target": "10.0.0.1:1", "tls": {"plaintext": True}}, r"only allowed to a loopback"),
    ({"name": "a", "target": "h:1", "priorities": [3, 9]}, r"priorities\[1\]: expected an integer in 0..7, got 9"),
    ({"name": "a", "target": "h:1", "sample_interval_ms": 0}, r"sample_interval_ms: expected an integer"),
    ({"name": "a", "target": "h:1", "credentials": "nope.yaml"}, r"credentials: no such file"),
    ({"target": "h:1"}, r"missing key 'name'"),
])
def test_config_errors_are_clear(tmp_path, switch, error):
    with pytest.raises(ValueError, match=error):
        parse_config({"switches": [switch]}, tmp_path)


def test_config_refuses_contradictions_and_plaintext_gateway(tmp_path):
    write(tmp_path / "ca.pem", "x")
    with pytest.raises(ValueError, match="skip_verify and ca contradict"):
        parse_config({"switches": [{"name": "a", "target": "h:1", "tls": {"ca": "ca.pem", "skip_verify": True}}]},
                     tmp_path)
    with pytest.raises(ValueError, match="duplicate switch name 'a'"):
        parse_config({"switches": [{"name": "a", "target": "h:1"}, {"name": "a", "target": "h:2"}]}, tmp_path)
    with pytest.raises(ValueError, match="gateway at gw.example needs TLS"):
        parse_config({"gateway": {"target": "gw.example:50051"}, "switches": [{"name": "a", "target": "h:1"}]},
                     tmp_path)
    with pytest.raises(ValueError, match="gateway: the client certificate and its key go together"):
        parse_config({"gateway": {"target": "127.0.0.1:1", "ca": "ca.pem", "client_cert": "ca.pem"},
                      "switches": [{"name": "a", "target": "h:1"}]}, tmp_path)
    with pytest.raises(ValueError, match=r"config: unknown key 'switch'"):
        parse_config({"switch": []}, tmp_path)
    write(tmp_path / "bad.yaml", "username: u\npasswd: p\n")
    with pytest.raises(ValueError, match="unknown key 'passwd'"):
        parse_config({"switches": [{"name": "a", "target": "h:1", "credentials": "bad.yaml"}]}, tmp_path)


def test_example_config_in_deploy_is_valid(tmp_path, monkeypatch):
    text = (REPO / "deploy" / "switch-collector.example.yaml").read_text()
    data = __import__("yaml").safe_load(text)
    # the example points at /etc paths; validate it with those files stubbed under tmp_path
    for section in [data.get("gateway", {}), data.get("defaults", {}), *data["switches"]]:
        for key in ("ca", "ca_cert", "token_file", "credentials"):
            if section.get(key):
                section[key] = str(write(tmp_path / Path(section[key]).name, "u" if key == "token_file" else
                                         "username: u\npassword: p\n" if key == "credentials" else "x"))
        for key in ("ca", "client_cert", "client_key"):
            if section.get("tls", {}).get(key):
                section["tls"][key] = str(write(tmp_path / Path(section["tls"][key]).name, "x"))
    config = parse_config(data, tmp_path)
    assert {s.profile for s in config.switches} == set(PROFILES)


# ----------------------------------------------------------------------------- in-process gNMI target
class ScriptedTarget(gnmi_pb2_grpc.gNMIServicer):
    """A small gNMI target: records metadata and requests, refuses qos paths, streams counters."""

    def __init__(self):
        self.metadata: list[dict] = []
        self.requests: list[gnmi_pb2.SubscribeRequest] = []

    async def Subscribe(self, request_iterator, context):
        self.metadata.append(dict(context.invocation_metadata()))
        request = await request_iterator.__anext__()
        self.requests.append(request)
        paths = [canonical(path_elems(s.path)) for s in request.subscribe.subscription]
        if any(p.startswith("qos") for p in paths):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "qos paths are not supported")
        k = 0
        while True:
            yield gnmi_pb2.SubscribeResponse(update=notif([(OC.format("Ethernet0") + "/state/counters/in-octets", k)]))
            if k == 0:
                yield gnmi_pb2.SubscribeResponse(sync_response=True)
            k += 1
            await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_credentials_metadata_and_a_refused_optional_group_against_a_grpc_target():
    target, port = ScriptedTarget(), free_port()
    server = grpc.aio.server()
    gnmi_pb2_grpc.add_gNMIServicer_to_server(target, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    snaps, stop = [], asyncio.Event()
    settings = SwitchSettings(name="leaf-01", target=f"127.0.0.1:{port}", tls=TlsSettings(plaintext=True),
                              username="telemetry", password="pw", sample_interval_ms=50)
    collector = SwitchCollector(settings, snaps.append)
    task = asyncio.create_task(collector.run(stop))
    try:
        await until(lambda: len(snaps) >= 3, 10, "3 snapshots")
        assert collector.stats["refused_groups"] == 1 and collector.stats["stream_errors"] == 0
        assert all(md["username"] == "telemetry" and md["password"] == "pw" for md in target.metadata)
        sample = target.requests[0].subscribe.subscription[0]
        assert (sample.mode, sample.sample_interval) == (gnmi_pb2.SAMPLE, 50_000_000)
        values = [table(s)["Ethernet0"]["in-octets"] for s in snaps]
        assert values == sorted(values) and [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await server.stop(0)


# ----------------------------------------------------------------------------- the real fake target
@pytest.fixture(scope="session")
def fake_server_bin() -> str:
    """The fake gNMI target, built once (minutes on a cold module cache, then cached)."""
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: cannot build the openconfig/gnmi fake gNMI target "
                    "(deploy/gnmi/build-fake-server.sh)")
    script = REPO / "deploy" / "gnmi" / "build-fake-server.sh"
    built = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800)
    if built.returncode != 0:
        raise RuntimeError(f"deploy/gnmi/build-fake-server.sh failed:\n{built.stderr[-4000:]}")
    return built.stdout.strip().splitlines()[-1]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, str]:
    """A test CA, a server certificate for localhost/127.0.0.1, a client certificate, and a
    self-signed server certificate, all P-256 and valid for a day."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "1",
            "-subj", "/CN=fabricwatch test CA")
    for who, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{who}.ext").write_text(ext + "\n")
        openssl("req", *ec, "-keyout", f"{d}/{who}.key", "-out", f"{d}/{who}.csr", "-subj", f"/CN=fabricwatch-{who}")
        openssl("x509", "-req", "-in", f"{d}/{who}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
                "-CAcreateserial", "-out", f"{d}/{who}.pem", "-days", "1", "-extfile", f"{d}/{who}.ext")
    openssl("req", "-x509", *ec, "-keyout", f"{d}/self.key", "-out", f"{d}/self.pem", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                    "self.pem", "self.key")}


class FakeTarget:
    """One fake_server_loopback process serving a fixture config on 127.0.0.1:port."""

    def __init__(self, binary: str, config: Path, pki: dict, port: int, *, mtls: bool, log_path: Path):
        self.args = [binary, "-config", str(config), "-text", "-listen_addr", "127.0.0.1", "-port", str(port)]
        if mtls:
            self.args += ["-server_crt", pki["server.pem"], "-server_key", pki["server.key"], "-ca_crt", pki["ca.pem"]]
        else:
            self.args += ["-server_crt", pki["self.pem"], "-server_key", pki["self.key"], "-allow_no_client_auth"]
        self.port, self.log_path, self.proc = port, log_path, None

    def start(self) -> FakeTarget:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake gNMI target exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


@contextmanager
def fake_target(binary, config, pki, tmp_path, *, mtls=True, port=None):
    target = FakeTarget(binary, config, pki, port or free_port(), mtls=mtls, log_path=tmp_path / "fake.log").start()
    try:
        yield target
    finally:
        target.kill()


# Fixture values (tests/fixtures/gnmi/openconfig.textproto): port i, sample k.
OC_PORTS = ["Ethernet0", "Ethernet8", "Ethernet16", "Ethernet24"]
OC_COUNTERS = {  # name: (start for port i = base * (i + 1), delta per sample)
    "in-octets": (1_000_000, 125_000_000), "out-octets": (2_000_000, 100_000_000),
    "in-pkts": (1_000, 100_000), "out-pkts": (2_000, 80_000),
}


def sample_index(snap_table: dict) -> int:
    """k of a snapshot, after checking that every counter of every port is at that same k."""
    ks = set()
    for i, port in enumerate(OC_PORTS):
        for name, (base, delta) in OC_COUNTERS.items():
            k, rem = divmod(snap_table[port][name] - base * (i + 1), delta)
            assert rem == 0, (port, name, snap_table[port][name])
            ks.add(k)
    assert len(ks) == 1, f"one snapshot mixes samples {sorted(ks)}"
    return ks.pop()


async def test_end_to_end_fake_target_over_mtls_to_the_gateway(fake_server_bin, pki, tmp_path):
    """mTLS on both sides: to the switch's gNMI server, and to a gateway run with --client-ca
    (the collector presents `gateway.client_cert`, as the node collector and the rank SDK do)."""
    from fabricwatch.streams.gateway import server_credentials

    sink, gw_port = RecordingSink(), free_port()
    gateway = grpc.aio.server()
    # the cluster of every snapshot is the gateway's (or its token's), whatever the collector says
    pb_grpc.add_IngestServicer_to_server(IngestService(sink, cluster="c1"), gateway)
    gateway.add_secure_port(f"127.0.0.1:{gw_port}", server_credentials(pki["server.pem"], pki["server.key"],
                                                                       client_ca_path=pki["ca.pem"]))
    await gateway.start()
    with fake_target(fake_server_bin, FIXTURES / "openconfig.textproto", pki, tmp_path, mtls=True) as fake:
        config = parse_config({
            "cluster": "c1",
            "gateway": {"target": f"127.0.0.1:{gw_port}", "token": "", "ca": pki["ca.pem"],
                        "client_cert": pki["client.pem"], "client_key": pki["client.key"]},
            "switches": [{"name": "leaf-01", "target": f"127.0.0.1:{fake.port}", "profile": "openconfig",
                          "sample_interval_ms": 200, "priorities": [3],
                          "tls": {"ca": pki["ca.pem"], "client_cert": pki["client.pem"],
                                  "client_key": pki["client.key"]}}],
        }, tmp_path)
        stop = asyncio.Event()
        task = asyncio.create_task(collect(config, stop=stop))
        try:
            await until(lambda: len(sink.snapshots()) >= 6, 20, "6 snapshots at the gateway")
        finally:
            stop.set()
            stats = await asyncio.wait_for(task, 20)
    await gateway.stop(0)
    assert stats["drained"] == 1 and stats["sender_rejected"] == 0 and stats["stream_errors"] == 0
    assert {(t, k) for t, k, _ in sink.records} == {(topics.TELEMETRY, b"leaf-01")}
    snaps = sink.snapshots()
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    views = [to_view(s) for s in snaps]
    assert all((v.cluster, v.source, v.source_kind) == ("c1", "leaf-01", "switch") for v in views)
    # every snapshot is exactly one sample of the fake: all counters of all ports at one k,
    # k = 0, 1, 2, ... with none skipped or split, raw values as served
    ks = [sample_index(table(s)) for s in snaps]
    assert ks == list(range(len(ks))), ks
    [frame] = views[-1].frames
    assert frame.kind == "switch_port" and frame.ids == tuple(OC_PORTS)
    assert frame.counter_names == ("in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors",
                                   "interface-transitions")
    assert frame.gauge_names == ("port_speed_gbps", "oper_up", "admin_up")
    assert frame.gauges.tolist() == [[400, 1, 1], [400, 1, 1], [100, 1, 1], [400, 0, 1]]
    assert frame.counters[:, 4].tolist() == [0, 1, 2, 3] and frame.counters[:, 5].tolist() == [2, 2, 2, 4]
    gaps = sorted(b.time_ns - a.time_ns for a, b in zip(views, views[1:]))
    assert 0.15e9 < gaps[len(gaps) // 2] < 0.3e9, f"snapshots about one 200 ms sample apart: {gaps}"


@pytest.mark.parametrize("tls_case", ["no client certificate", "untrusted server certificate"])
async def test_tls_failures_send_nothing_and_keep_retrying(fake_server_bin, pki, tmp_path, tls_case):
    tls = {"no client certificate": TlsSettings(ca=pki["ca.pem"]),
           "untrusted server certificate": TlsSettings(ca=pki["self.pem"], client_cert=pki["client.pem"],
                                                       client_key=pki["client.key"])}[tls_case]
    snaps, stop = [], asyncio.Event()
    with fake_target(fake_server_bin, FIXTURES / "openconfig.textproto", pki, tmp_path, mtls=True) as fake:
        collector = SwitchCollector(SwitchSettings(name="leaf-01", target=f"127.0.0.1:{fake.port}", tls=tls,
                                                   sample_interval_ms=200, backoff_initial_s=0.05,
                                                   backoff_max_s=0.1), snaps.append)
        task = asyncio.create_task(collector.run(stop))
        try:
            await until(lambda: collector.stats["stream_errors"] >= 2, 15, "two failed attempts")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    assert snaps == [] and collector.stats["syncs"] == 0


async def test_arista_profile_pfc_from_the_fake_target_with_skip_verify(fake_server_bin, pki, tmp_path):
    snaps, stop = [], asyncio.Event()
    with fake_target(fake_server_bin, FIXTURES / "arista.textproto", pki, tmp_path, mtls=False) as fake:
        settings = SwitchSettings(name="spine-01", target=f"127.0.0.1:{fake.port}", profile="arista",
                                  tls=TlsSettings(skip_verify=True), sample_interval_ms=200, priorities=(3,))
        collector = SwitchCollector(settings, snaps.append)
        task = asyncio.create_task(collector.run(stop))
        try:
            await until(lambda: len(snaps) >= 4, 20, "4 snapshots")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    first, last = table(snaps[0]), table(snaps[-1])
    assert set(last) == {"Ethernet1/1", "Ethernet1/2"}
    assert set(last["Ethernet1/1"]) == {
        "in-octets", "out-octets", "interface-transitions", "pfc3-rx-pkts", "pfc3-tx-pkts",
        "pfc3-rx-pause-duration-us", "queue3-transmit-pkts", "queue3-transmit-octets", "port_speed_gbps", "oper_up"}
    k = len(snaps) - 1
    e1 = last["Ethernet1/2"]
    assert (e1["pfc3-rx-pkts"], e1["pfc3-tx-pkts"]) == (200 + 1_000 * k, 20 + 10 * k)
    # 6_001_998 ns + 50e6 ns per sample, reported in us (floor)
    assert e1["pfc3-rx-pause-duration-us"] == (6_001_998 + 50_000_000 * k) // 1000
    assert first["Ethernet1/1"]["pfc3-rx-pause-duration-us"] == 3_000
    assert (e1["interface-transitions"], e1["port_speed_gbps"], e1["oper_up"]) == (6, 400.0, 1.0)
    assert collector.stats["unmapped_leaves"] > 0 and collector.stats["other_priorities"] > 0


@pytest.mark.slow
async def test_collector_recovers_when_the_switch_restarts(fake_server_bin, pki, tmp_path):
    snaps, stop = [], asyncio.Event()
    port = free_port()
    settings = SwitchSettings(name="leaf-01", target=f"127.0.0.1:{port}", tls=TlsSettings(ca=pki["self.pem"]),
                              sample_interval_ms=200, backoff_initial_s=0.1, backoff_max_s=0.5)
    collector = SwitchCollector(settings, snaps.append)
    config = FIXTURES / "openconfig.textproto"
    first = FakeTarget(fake_server_bin, config, pki, port, mtls=False, log_path=tmp_path / "fake1.log").start()
    task = asyncio.create_task(collector.run(stop))
    try:
        await until(lambda: len(snaps) >= 3, 20, "3 snapshots before the restart")
        first.kill()                                             # the switch goes away
        await until(lambda: collector.stats["stream_errors"] >= 1, 10, "the stream error")
        before = len(snaps)
        await asyncio.sleep(0.6)                                 # a few failed redials
        assert len(snaps) == before
        second = FakeTarget(fake_server_bin, config, pki, port, mtls=False, log_path=tmp_path / "fake2.log").start()
        try:
            await until(lambda: len(snaps) >= before + 3, 20, "3 snapshots after the restart")
        finally:
            second.kill()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert collector.stats["reconnects"] >= 1 and collector.stats["syncs"] >= 2
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))      # seq continues across streams
    ks = [sample_index(table(s)) for s in snaps]
    assert ks[before] == 0 and ks[before:] == list(range(len(ks) - before))   # a fresh switch: counters restart
    assert all(b.time_unix_ns > a.time_unix_ns for a, b in zip(snaps, snaps[1:]))
