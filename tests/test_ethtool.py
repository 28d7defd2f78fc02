"""The node collector's ethtool reader: the ``ethtool -S`` parser on a recorded ConnectX-7 output
(``tests/fixtures/ethtool/mlx5_cx7.txt``, PFC on priority 3), its sampling thread, and the real
ioctl on a veth pair in a network namespace.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ETHTOOL_TXT, ROCE, ROCE_NETDEVS, copy_tree, recorded_ethtool

from fabricwatch.collectors import node as node_mod
from fabricwatch.collectors.ethtool_stats import EthtoolFilter, EthtoolReader, parse_ethtool_s
from fabricwatch.collectors.node import NodeCollector
from fabricwatch.collectors.node_config import NodeConfig


# =========================================================================== ethtool
def test_ethtool_text_parser_and_selection_on_the_recorded_mlx5_output():
    stats = parse_ethtool_s(ETHTOOL_TXT.read_text())
    assert len(stats) == 228
    assert stats["rx_prio3_pause"] == 123 and stats["tx_prio3_pause_duration"] == 48_211
    flt = EthtoolFilter()
    fast = flt.select(stats, "fast")
    assert set(fast) == ({f"{d}_prio{p}_{x}" for d in ("rx", "tx") for p in range(8) for x in ("bytes", "packets")}
                         | {"rx_prio3_pause", "rx_prio3_pause_duration", "tx_prio3_pause", "tx_prio3_pause_duration",
                            "rx_prio3_pause_transition", "tx_pause_storm_warning_events",
                            "tx_pause_storm_error_events"})
    slow = flt.select(stats, "slow")
    assert {"link_down_events_phy", "rx_symbol_err_phy", "rx_pcs_symbol_err_phy", "rx_corrected_bits_phy",
            "rx_discards_phy", "rx_crc_errors_phy", "rx_err_lane_0_phy", "rx_prio3_marked", "rx_out_of_buffer",
            "rx_pci_signal_integrity"} <= set(slow)
    assert slow["link_down_events_phy"] == 2 and slow["rx_prio3_marked"] == 441_882
    assert not {"rx_packets", "rx_64_bytes_phy", "ch0_events", "outbound_pci_stalled_rd"} & (set(fast) | set(slow))
    assert parse_ethtool_s("NIC statistics:\n     weird line\n     a: b\n     ok: 1\n") == {"ok": 1}


def test_ethtool_reader_groups_allow_list_and_a_changing_layout():
    reader = EthtoolReader(allow=["rx_vport_rdma_unicast_*"], allow_fast=["tx_mac_control_phy"],
                           source={"eth0": str(ETHTOOL_TXT)})
    fast, slow = reader.read("eth0", "fast"), reader.read("eth0", "slow")
    assert fast["tx_mac_control_phy"] == 402_118 and fast["rx_prio3_pause"] == 123
    assert slow["rx_vport_rdma_unicast_bytes"] == 4_571_217_911_225
    assert set(reader.read("eth0", "all")) == set(fast) | set(slow)
    assert reader.read("eth9", "fast") is None and reader.problems.counts["ethtool_error"] == 1

    class Growing:
        """A driver that adds statistics between two reads (mlx5 opening more channels)."""
        def __init__(self):
            self.names_ = ["rx_prio3_pause", "tx_prio3_pause"]
            self.vals = [1, 2]

        def count(self, ifname):
            return len(self.names_)

        def names(self, ifname, n):
            return list(self.names_)

        def values(self, ifname, n):
            got = len(self.vals)
            if self.grow:                       # grows after the count was taken
                self.names_.insert(0, "ch9_events")
                self.vals.insert(0, 7)
                self.grow = False
            return got + (len(self.vals) - got), memoryview(__import__("array").array("Q", self.vals))

        def close(self):
            pass

    src = Growing()
    src.grow = False
    reader = EthtoolReader(source=src)
    assert reader.read("eth0", "fast") == {"rx_prio3_pause": 1, "tx_prio3_pause": 2}
    src.grow = True
    assert reader.read("eth0", "fast") == {"rx_prio3_pause": 1, "tx_prio3_pause": 2}   # re-read names, retried
    assert reader.problems.counts["ethtool_layout_changed"] == 1


def test_ethtool_columns_are_the_named_read_for_many_one_or_no_kept_names(tmp_path):
    """`read_columns` (the PFC path) picks the same values as `read`, whatever the number kept."""
    reader = EthtoolReader(source={"eth0": str(ETHTOOL_TXT)})
    for group in ("fast", "slow", "all"):
        names, values = reader.read_columns("eth0", group)
        assert dict(zip(names, values)) == reader.read("eth0", group) and len(names) == len(values) > 1
    one = tmp_path / "one.txt"
    one.write_text("NIC statistics:\n     tx_bytes: 9\n     rx_prio3_pause: 5\n")
    none = tmp_path / "none.txt"
    none.write_text("NIC statistics:\n     tx_bytes: 9\n")
    reader = EthtoolReader(source={"one0": str(one), "none0": str(none)})
    assert reader.read_columns("one0", "fast") == (("rx_prio3_pause",), (5,))
    assert reader.read_columns("none0", "fast") == ((), ())
    assert reader.read_columns("gone0", "fast") is None and reader.problems.counts["ethtool_error"] == 1


def test_pfc_ticks_follow_a_rediscovery(tmp_path):
    """The PFC tick's list of RoCE ports is made once per discovery: a port that goes away leaves it."""
    tree = copy_tree(ROCE, tmp_path)
    cfg = NodeConfig.from_dict({"node_name": "roce-node", "sysfs_root": str(tree)})
    collector = NodeCollector(cfg, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=False)
    assert list(collector.collect({"ethtool_pfc"}).blocks[0].entity_ids) == [f"mlx5_{i}/1" for i in range(8)]
    (tree / "class" / "infiniband" / "mlx5_5").unlink()        # the driver unbound one NIC
    collector.nic.discover()
    [block] = collector.collect({"ethtool_pfc"}).blocks
    assert list(block.entity_ids) == [f"mlx5_{i}/1" for i in range(8) if i != 5]
    assert list(block.labels[0].values) == [n for i, n in enumerate(ROCE_NETDEVS) if i != 5]
    collector.close()


def test_sampling_thread_sleeps_until_due_and_wakes_at_once_when_halted():
    import threading

    halt = node_mod._Halt()
    t0 = time.monotonic()
    assert halt.wait(0.05) is False and time.monotonic() - t0 >= 0.05       # never early
    threading.Timer(0.05, halt.set).start()
    t0 = time.monotonic()
    assert halt.wait(5.0) is True and time.monotonic() - t0 < 1.0
    assert halt.is_set() and halt.wait(5.0) is True                          # stays set
    halt.set()                                                               # idempotent
    halt.close()


def _have_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip"):
        return "needs iproute2's `ip`"
    return None


@pytest.mark.skipif(_have_netns() is not None, reason=_have_netns() or "")
def test_ethtool_ioctl_for_real_on_a_veth_pair_in_a_network_namespace():
    """The SIOCETHTOOL path against the kernel: veth reports peer_ifindex and per-queue stats."""
    ns = f"fwtest{os.getpid()}"

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def in_ns(code: str) -> dict:
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        ip("-n", ns, "link", "add", "fwv0", "type", "veth", "peer", "name", "fwv1")
        ip("-n", ns, "link", "set", "fwv0", "up")
        ip("-n", ns, "link", "set", "fwv1", "up")
        got = in_ns(
            "import json, shutil, subprocess\n"
            "from fabricwatch.collectors.ethtool_stats import EthtoolReader, parse_ethtool_s, read_ethtool_stats\n"
            "from fabricwatch.collectors.sysfs_nic import read_netdev_speed\n"
            "allstats = read_ethtool_stats('fwv0')\n"
            "reader = EthtoolReader(allow=['peer_ifindex', 'rx_queue_?_drops'])\n"
            "out = {'all': allstats, 'slow': reader.read('fwv0', 'slow'), 'fast': reader.read('fwv0', 'fast'),\n"
            "       'lo': reader.read('lo', 'slow'), 'problems': dict(reader.problems.counts),\n"
            "       'peer_ifindex': int(open('/sys/class/net/fwv1/ifindex').read()),\n"
            "       'speed_up': read_netdev_speed('/sys', 'fwv0')}\n"
            "if shutil.which('ethtool'):\n"
            "    out['text'] = parse_ethtool_s(subprocess.run(['ethtool', '-S', 'fwv0'], capture_output=True,\n"
            "                                                 text=True).stdout)\n"
            "print(json.dumps(out))\n")
        assert got["all"]["peer_ifindex"] == got["peer_ifindex"]
        assert any(k.startswith("rx_queue_0_") for k in got["all"])
        assert got["slow"] == {"peer_ifindex": got["peer_ifindex"], "rx_queue_0_drops": got["all"]["rx_queue_0_drops"]}
        assert got["fast"] == {}
        assert got["lo"] is None and got["problems"].get("no_ethtool_stats") == 1   # lo has no ethtool stats
        assert got["speed_up"] == 10000.0                   # veth reports 10 Gb/s when running
        if "text" in got:                                   # the ioctl and `ethtool -S` agree
            assert got["text"] == got["all"]
        ip("-n", ns, "link", "set", "fwv0", "down")         # admin-down: the kernel answers EINVAL
        down = in_ns("import json, math\nfrom fabricwatch.collectors.sysfs_nic import Problems, read_netdev_speed\n"
                     "import logging\np = Problems(logging.getLogger('t'))\n"
                     "v = read_netdev_speed('/sys', 'fwv0', p)\n"
                     "print(json.dumps({'nan': math.isnan(v), 'problems': dict(p.counts)}))\n")
        assert down == {"nan": True, "problems": {"netdev_admin_down": 1}}
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


