"""The gNMI switch collector's vendor profiles: gNMI paths and values to counter names and units.
The tests build gNMI `Notification`s with the stub classes.
"""
from __future__ import annotations

import math

import pytest
from helpers import NS, OC, notif, table, tv

from fabricwatch.collectors.gnmi_profiles import PROFILES, compile_profile, expand_paths, split_path
from fabricwatch.collectors.gnmi_assembler import SwitchAssembler
from fabricwatch.collectors.gnmi_decode import canonical, decode_value, gnmi_pb2, path_elems
from fabricwatch.collectors.gnmi_switch import (
    SwitchSettings,
    auth_metadata,
)
from fabricwatch.streams.validate import validate_snapshot


# ----------------------------------------------------------------------------- helpers


def one_tick(profile, *notifications, priorities=range(8), target="") -> dict[str, dict[str, float]]:
    asm = SwitchAssembler("sw-1", profile, interval_s=1.0, priorities=priorities)
    for n in notifications:
        assert asm.apply(n, 0.0, NS) == []          # nothing leaves before the sync_response
    [snap] = asm.sync(0.01, NS)
    assert validate_snapshot(snap, NS).problems == []
    return table(snap)


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


