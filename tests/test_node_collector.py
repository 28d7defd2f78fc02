"""The node collector: recorded sysfs trees, ethtool (real ioctl on a veth), NVML degrade logic,
and the whole path to a real in-process gRPC gateway, outage included.

Fixtures (tests/fixtures/):
* ``sysfs/roce_cx7``: a ConnectX-7 RoCE node, 8 ports mlx5_0..7 (``400 Gb/sec (4X NDR)``,
  link_layer Ethernet); mlx5_3's PCIe link trained down to Gen4; mlx5_7 lacks the
  optional roce_accl / ext-PPCNT hw counters.
* ``sysfs/ib_ndr``: an InfiniBand NDR node, 2 ports (mlx5_1 at ``200 Gb/sec (2X NDR)``).
* ``ethtool/mlx5_cx7.txt``: ``ethtool -S`` of a ConnectX-7 netdev, PFC on priority 3.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pynvml
import pytest

from helpers import RecordingSink, free_port, start_server

from fabricwatch.collectors import node as node_mod
from fabricwatch.collectors import node_cli, node_config
from fabricwatch.collectors.ethtool_stats import EthtoolFilter, EthtoolReader, RecordedSource, parse_ethtool_s
from fabricwatch.collectors.node import NodeCollector
from fabricwatch.collectors.node_config import ConfigError, NodeConfig, load_config
from fabricwatch.collectors.nvml_fields import COUNTER_NAMES, GAUGE_NAMES
from fabricwatch.collectors.nvml_gpu import GpuReader
from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.collectors.sysfs_nic import NicReader, rows_to_blocks
from fabricwatch.counters import NIC_GAUGES, NIC_LABELS
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.gateway import IngestService
from fabricwatch.streams.validate import validate_snapshot

FIXTURES = Path(__file__).parent / "fixtures"
ROCE = FIXTURES / "sysfs" / "roce_cx7"
IB = FIXTURES / "sysfs" / "ib_ndr"
ETHTOOL_TXT = FIXTURES / "ethtool" / "mlx5_cx7.txt"
ROCE_NETDEVS = ["enp24s0np0", "enp64s0np0", "enp79s0np0", "enp94s0np0", "enp154s0np0", "enp192s0np0",
                "enp206s0np0", "enp220s0np0"]
ROCE_BDFS = ["0000:18:00.0", "0000:40:00.0", "0000:4f:00.0", "0000:5e:00.0", "0000:9a:00.0", "0000:c0:00.0",
             "0000:ce:00.0", "0000:dc:00.0"]
OPTIONAL_HW = {"roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
               "roce_slow_restart_trans", "rx_icrc_encapsulated"}


def rows_by_id(rows):
    return {r.entity_id: r for r in rows}


def copy_tree(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def port_dir(tree: Path, dev: str) -> Path:
    return Path(os.path.realpath(tree / "class" / "infiniband" / dev)) / "ports" / "1"


def recorded_ethtool() -> RecordedSource:
    return RecordedSource({netdev: str(ETHTOOL_TXT) for netdev in ROCE_NETDEVS})


def block_rows(block):
    m, k = len(block.counter_names), len(block.gauge_names)
    labels = {c.name: list(c.values) for c in block.labels}
    return {eid: SimpleNamespace(counters=dict(zip(block.counter_names, block.counters[i * m:(i + 1) * m])),
                                 gauges=dict(zip(block.gauge_names, block.gauges[i * k:(i + 1) * k])),
                                 labels={n: v[i] for n, v in labels.items()})
            for i, eid in enumerate(block.entity_ids)}


# =========================================================================== sysfs: recorded trees
def test_roce_tree_reads_every_port_with_exact_values_and_labels():
    with NicReader(str(ROCE)) as reader:
        rows = rows_by_id(reader.sample())
    assert list(rows) == [f"mlx5_{i}/1" for i in range(8)]
    r0 = rows["mlx5_0/1"]
    assert r0.labels == {"rate": "400 Gb/sec (4X NDR)", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                         "link_layer": "Ethernet", "netdev": "enp24s0np0", "pci_bdf": "0000:18:00.0"}
    assert tuple(r0.labels) == NIC_LABELS and tuple(r0.gauges) == NIC_GAUGES
    assert r0.gauges == {"netdev_speed_mbps": 400000.0, "pcie_width_current": 16.0, "pcie_width_max": 16.0,
                         "pcie_gen_current": 5.0, "pcie_gen_max": 5.0}
    # counters/ (64-bit PMA on mlx5; data in 4-byte words) and hw_counters/, raw
    assert r0.counters["port_xmit_data"] == 4_519_221_734_810
    assert r0.counters["port_rcv_data"] == 4_521_908_112_455
    assert r0.counters["port_xmit_wait"] == 38_211
    assert r0.counters["np_cnp_sent"] == 12_884 and r0.counters["rp_cnp_handled"] == 12_701
    assert r0.counters["np_ecn_marked_roce_packets"] == 441_882 and r0.counters["resp_cqe_error"] == 1009
    assert "lifespan" not in r0.counters                   # hw_counters/lifespan is the cache time
    assert len(r0.counters) == 21 + 31
    assert rows["mlx5_1/1"].counters["port_xmit_data"] == 4_519_221_734_810 + 1_000_033
    assert rows["mlx5_1/1"].counters["link_downed"] == 1
    # mlx5_3 trained down to PCIe Gen4; mlx5_7 lacks the optional hw counters
    assert rows["mlx5_3/1"].gauges["pcie_gen_current"] == 4.0 and rows["mlx5_3/1"].gauges["pcie_gen_max"] == 5.0
    assert OPTIONAL_HW <= set(rows["mlx5_6/1"].counters)
    assert not OPTIONAL_HW & set(rows["mlx5_7/1"].counters)
    assert [r.labels["netdev"] for r in rows.values()] == ROCE_NETDEVS
    assert [r.labels["pci_bdf"] for r in rows.values()] == ROCE_BDFS
    assert {p.netdev_source for p in reader.ports} == {"device/net"}
    assert not reader.problems.counts


def test_roce_ports_with_equal_columns_share_a_block_that_the_gateway_accepts():
    with NicReader(str(ROCE)) as reader:
        blocks = rows_to_blocks(pb.ENTITY_KIND_NIC_PORT, reader.sample())
    assert [list(b.entity_ids) for b in blocks] == [[f"mlx5_{i}/1" for i in range(7)], ["mlx5_7/1"]]
    for b in blocks:
        assert len(b.counters) == len(b.entity_ids) * len(b.counter_names)
        assert len(b.gauges) == len(b.entity_ids) * len(b.gauge_names)
    snap = pb.Snapshot(cluster="c1", source="node-0001", source_kind=pb.SOURCE_KIND_NODE,
                       time_unix_ns=time.time_ns(), seq=1, blocks=blocks)
    verdict = validate_snapshot(snap, time.time_ns())
    assert verdict.accepted and verdict.problems == []
    assert block_rows(blocks[1])["mlx5_7/1"].labels["netdev"] == "enp220s0np0"


def test_infiniband_tree_reads_ib_ports():
    with NicReader(str(IB)) as reader:
        rows = rows_by_id(reader.sample())
    assert list(rows) == ["mlx5_0/1", "mlx5_1/1"]
    assert rows["mlx5_0/1"].labels == {"rate": "400 Gb/sec (4X NDR)", "state": "4: ACTIVE",
                                       "phys_state": "5: LinkUp", "link_layer": "InfiniBand",
                                       "netdev": "ibp24s0", "pci_bdf": "0000:18:00.0"}
    r1 = rows["mlx5_1/1"]
    assert r1.labels["rate"] == "200 Gb/sec (2X NDR)" and r1.labels["netdev"] == "ibp64s0"
    assert r1.gauges["netdev_speed_mbps"] == 200000.0
    assert r1.counters["port_rcv_data"] == 4_521_908_112_455 + 1_000_003
    assert "np_cnp_sent" not in r1.counters and "rx_icrc_encapsulated" in r1.counters


# =========================================================================== sysfs: degraded
def test_unreadable_counter_is_left_out_reported_once_and_the_rest_read(tmp_path, caplog):
    tree = copy_tree(ROCE, tmp_path)
    bad = port_dir(tree, "mlx5_2") / "counters" / "symbol_error"
    bad.unlink()
    bad.mkdir()                                  # reading it fails (EISDIR), as an unreadable file would
    with NicReader(str(tree)) as reader, caplog.at_level("WARNING"):
        first, second = rows_by_id(reader.sample()), rows_by_id(reader.sample())
    assert "symbol_error" not in first["mlx5_2/1"].counters
    assert first["mlx5_2/1"].counters["port_xmit_data"] == 4_519_221_734_810 + 2 * 1_000_033
    assert "symbol_error" in first["mlx5_1/1"].counters
    assert reader.problems.counts["read_error"] == 2     # counted every time...
    assert sum("symbol_error" in r.message for r in caplog.records) == 1   # ...logged once
    assert second["mlx5_2/1"].labels["rate"] == "400 Gb/sec (4X NDR)"
    blocks = rows_to_blocks(pb.ENTITY_KIND_NIC_PORT, first.values())
    assert ["mlx5_2/1"] in [list(b.entity_ids) for b in blocks]       # its own column set, its own block


def test_admin_down_speed_is_nan_and_an_unreadable_label_is_empty(tmp_path):
    tree = copy_tree(ROCE, tmp_path)
    speed = tree / "class" / "net" / "enp64s0np0" / "speed"
    os.unlink(os.path.realpath(speed))
    os.mkdir(os.path.realpath(speed))            # the kernel answers EINVAL when admin-down: a read that raises
    rate = port_dir(tree, "mlx5_4") / "rate"
    rate.unlink()
    rate.mkdir()
    with NicReader(str(tree)) as reader:
        rows = rows_by_id(reader.sample())
    assert math.isnan(rows["mlx5_1/1"].gauges["netdev_speed_mbps"])
    assert rows["mlx5_1/1"].gauges["pcie_gen_current"] == 5.0
    assert rows["mlx5_0/1"].gauges["netdev_speed_mbps"] == 400000.0
    assert rows["mlx5_4/1"].labels["rate"] == "" and rows["mlx5_4/1"].labels["state"] == "4: ACTIVE"
    assert reader.problems.counts["read_error"] == 2


def test_missing_files_and_trees_degrade_without_failing(tmp_path):
    with NicReader(str(tmp_path)) as empty:
        assert empty.sample() == []                            # no RDMA device at all
    tree = copy_tree(ROCE, tmp_path)
    pci = Path(os.path.realpath(tree / "bus" / "pci" / "devices" / "0000:9a:00.0"))
    (pci / "max_link_speed").unlink()
    shutil.rmtree(port_dir(tree, "mlx5_5") / "hw_counters")  # a whole optional group absent
    net = Path(os.path.realpath(tree / "class" / "infiniband" / "mlx5_6" / "device")) / "net"
    shutil.rmtree(net)                                         # no device/net: GID 0's netdev is used
    with NicReader(str(tree)) as reader:
        rows = rows_by_id(reader.sample())
    assert math.isnan(rows["mlx5_4/1"].gauges["pcie_gen_max"]) and rows["mlx5_4/1"].gauges["pcie_gen_current"] == 5
    assert "np_cnp_sent" not in rows["mlx5_5/1"].counters and "port_xmit_data" in rows["mlx5_5/1"].counters
    assert rows["mlx5_6/1"].labels["netdev"] == "enp206s0np0"
    assert {p.entity_id: p.netdev_source for p in reader.ports}["mlx5_6/1"] == "gid_attrs/ndevs/0"
    assert math.isnan(rows["mlx5_6/1"].gauges["netdev_speed_mbps"])   # its netdev dir went with device/net


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


# =========================================================================== NVML (mocked pynvml)
def nvml_error(code):
    return pynvml.NVMLError(code)


class FakeGpus:
    """Per-GPU answers for the pynvml functions GpuReader calls; each is a MagicMock (call counts)."""

    def __init__(self, n=2, links=(0, 1, 2, 3)):
        self.handles = [SimpleNamespace(i=i) for i in range(n)]
        self.links = links
        self.energy = [1_000_000, 2_000_000]
        self.events: list = []
        idx = lambda h: h.i  # noqa: E731

        def nvlink_state(h, link):
            if link not in self.links:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return 0 if (h.i, link) == (1, 3) else 1

        def nvlink_counter(h, link, counter):
            return {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 10, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 1,
                    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 100, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0}[counter] + link

        def field_values(h, ids):
            """NVLINK_GET_STATE per link and the four error totals, consistent with the per-link calls."""
            totals = {pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                      pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                      pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                      pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_RECOVERY}
            out = []
            for fid in ids:
                if isinstance(fid, tuple):          # (NVML_FI_DEV_NVLINK_GET_STATE, link)
                    value = SimpleNamespace(uiVal=nvlink_state(h, fid[1]))
                    out.append(SimpleNamespace(nvmlReturn=0, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value=value))
                else:
                    total = sum(nvlink_counter(h, link, totals[fid]) for link in self.links)
                    out.append(SimpleNamespace(nvmlReturn=0, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                                               value=SimpleNamespace(ullVal=total)))
            return out

        def wait(es, timeout_ms):
            if self.events:
                return self.events.pop(0)
            time.sleep(0.01)
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

        f = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: n,
            "nvmlDeviceGetHandleByIndex": lambda i: self.handles[i],
            "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{idx(h)}-aaaa-bbbb-cccc-dddddddddddd",
            "nvmlDeviceGetName": lambda h: "NVIDIA H200",
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=f"00000000:{0x1B + 0x28 * idx(h):02X}:00.0".encode()),
            "nvmlDeviceGetNvLinkState": nvlink_state,
            "nvmlDeviceGetNvLinkErrorCounter": nvlink_counter,
            "nvmlDeviceGetFieldValues": field_values,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97 - idx(h), memory=40),
            "nvmlDeviceGetClockInfo": lambda h, t: 1980,
            "nvmlDeviceGetMaxClockInfo": lambda h, t: 1980,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4 if idx(h) else 0,
            "nvmlDeviceGetPowerUsage": lambda h: 612_345,
            "nvmlDeviceGetTemperatureV": lambda h, s: 61 + idx(h),
            "nvmlDeviceGetTemperature": lambda h, s: 99,
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetGpuMaxPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetRemappedRows": lambda h: (2, 0, 0, 0),
            "nvmlDeviceGetTotalEccErrors": lambda h, t, c: 7 if t == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0,
            "nvmlDeviceGetPcieReplayCounter": lambda h: 3,
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: self.energy[idx(h)],
            "nvmlEventSetCreate": lambda: "event-set",
            "nvmlDeviceGetSupportedEventTypes": lambda h: 0x8 | 0x1 | 0x2,
            "nvmlDeviceRegisterEvents": lambda h, types, es: None,
            "nvmlEventSetWait": wait,
            "nvmlEventSetFree": lambda es: None,
        }
        self.mocks = {name: mock.MagicMock(side_effect=fn, name=name) for name, fn in f.items()}

    def fail(self, name, code):
        self.mocks[name].side_effect = lambda *a: (_ for _ in ()).throw(nvml_error(code))

    def patch(self):
        return mock.patch.multiple(pynvml, **self.mocks)


def test_nvml_success_reads_every_column_and_label():
    fake = FakeGpus()
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        rows = rows_by_id(reader.sample())
        reader.close()
    g0, g1 = rows["gpu0"], rows["gpu1"]
    assert tuple(g0.gauges) == GAUGE_NAMES and tuple(g0.counters) == COUNTER_NAMES
    assert g0.labels == {"uuid": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", "pci_bdf": "0000:1b:00.0",
                         "name": "NVIDIA H200"}
    assert g1.labels["pci_bdf"] == "0000:43:00.0"
    assert g0.gauges["utilization_gpu_pct"] == 97 and g1.gauges["utilization_gpu_pct"] == 96
    assert g0.gauges["power_mw"] == 612_345 and g0.gauges["temperature_c"] == 61
    assert g1.gauges["clocks_event_reasons"] == 4 and g0.gauges["sm_clock_max_mhz"] == 1980
    assert (g0.gauges["pcie_gen_current"], g0.gauges["pcie_gen_max"], g0.gauges["pcie_width_max"]) == (5, 5, 16)
    assert g0.gauges["remapped_rows_correctable"] == 2 and g0.gauges["remapped_rows_pending"] == 0
    assert g0.counters["ecc_corrected_volatile_total"] == 7 and g0.counters["ecc_uncorrected_volatile_total"] == 0
    assert g0.counters["energy_mj"] == 1_000_000 and g0.counters["pcie_replay_total"] == 3
    # NVLink: 4 links found; sums over links (value + link number in the fake)
    assert g0.counters["nvlink_crc_flit_errors_total"] == 4 * 10 + 6
    assert g0.counters["nvlink_replay_errors_total"] == 4 * 100 + 6
    assert (g0.gauges["nvlink_links_active"], g1.gauges["nvlink_links_active"], g0.gauges["nvlink_links"]) == (4, 3, 4)
    assert not fake.mocks["nvmlDeviceGetTemperature"].called   # the deprecated call only where V is missing
    assert not reader.problems.counts
    # one field-values call per GPU, no per-link counter calls; iterating links gives the same numbers
    assert fake.mocks["nvmlDeviceGetFieldValues"].call_count == 2
    assert not fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].called
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        per_link = rows_by_id(reader.sample())
        reader.close()
    assert per_link["gpu0"].counters == g0.counters and per_link["gpu1"].gauges["nvlink_links_active"] == 3
    assert fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].call_count == 2 * 4 * 4
    blocks = rows_to_blocks(pb.ENTITY_KIND_GPU, rows.values())
    snap = pb.Snapshot(source="node-0001", source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=time.time_ns(), blocks=blocks)
    assert validate_snapshot(snap, time.time_ns()).problems == []


def test_nvml_maxima_are_cached_and_energy_is_optional():
    fake = FakeGpus(n=2, links=())
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=False)
        assert reader.open()
        rows = [reader.sample() for _ in range(3)]
        reader.close()
    assert all(r.gauges["sm_clock_max_mhz"] == 1980 and r.gauges["pcie_width_max"] == 16 for s in rows for r in s)
    assert fake.mocks["nvmlDeviceGetMaxClockInfo"].call_count == 2          # once per GPU, not per sample
    assert fake.mocks["nvmlDeviceGetGpuMaxPcieLinkGeneration"].call_count == 2
    assert fake.mocks["nvmlDeviceGetClockInfo"].call_count == 6              # the current clock every sample
    assert not fake.mocks["nvmlDeviceGetTotalEnergyConsumption"].called
    assert "energy_mj" not in rows[0][0].counters
    assert NodeConfig.from_dict({}).nvml.energy is False                      # the collector's default


SLOW_COUNTERS = ("ecc_corrected_volatile_total", "ecc_uncorrected_volatile_total", "pcie_replay_total",
                 "nvlink_crc_flit_errors_total", "nvlink_crc_data_errors_total", "nvlink_replay_errors_total",
                 "nvlink_recovery_errors_total")


def test_nvml_slow_fields_are_read_every_nth_sample_and_carried_or_left_out_between():
    fake = FakeGpus(n=2)
    remapped = {0: (2, 0, 0, 0), 1: (0, 0, 0, 0)}
    fake.mocks["nvmlDeviceGetRemappedRows"].side_effect = lambda h: remapped[h.i]
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=True, slow_every=4)
        assert reader.open()
        samples = []
        for i in range(9):
            if i == 2:
                remapped[0] = (3, 0, 1, 0)               # a row remapped between two slow reads
            if i == 6:
                fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_UNKNOWN)
            samples.append(rows_by_id(reader.sample()))
        reader.close()
    slow = [i for i, rows in enumerate(samples) if "pcie_replay_total" in rows["gpu0"].counters]
    assert slow == [0, 4, 8]
    for i, rows in enumerate(samples):
        for row in rows.values():
            assert tuple(row.gauges) == GAUGE_NAMES                   # gauges: same layout every sample
            want = COUNTER_NAMES if i in slow else ("energy_mj",)      # slow counters only when read
            assert tuple(row.counters) == want, (i, row.counters)
            assert row.gauges["utilization_gpu_pct"] > 0 and row.gauges["nvlink_links_active"] >= 3
    carried = [rows["gpu0"].gauges["remapped_rows_correctable"] for rows in samples]
    assert carried[:4] == [2.0] * 4 and carried[4:8] == [3.0] * 4     # the last reading until the next
    assert math.isnan(carried[8])                                       # a failed read: NaN
    assert samples[5]["gpu0"].gauges["remapped_rows_pending"] == 1.0
    m = fake.mocks
    assert m["nvmlDeviceGetUtilizationRates"].call_count == m["nvmlDeviceGetPowerUsage"].call_count == 2 * 9
    assert m["nvmlDeviceGetCurrPcieLinkGeneration"].call_count == 2 * 9    # compared with utilisation: fast
    assert m["nvmlDeviceGetTotalEccErrors"].call_count == 2 * 2 * 3
    assert m["nvmlDeviceGetPcieReplayCounter"].call_count == 2 * 3
    assert m["nvmlDeviceGetRemappedRows"].call_count == 2 * 3
    # NVLink: the link states every sample, the four error totals only with the slow fields
    fields_asked = [len(c.args[1]) for c in m["nvmlDeviceGetFieldValues"].call_args_list]
    assert fields_asked == [4 + 4, 4 + 4] + [4, 4] * 3 + [8, 8] + [4, 4] * 3 + [8, 8]
    assert samples[4]["gpu0"].counters["nvlink_replay_errors_total"] == 4 * 100 + 6
    with pytest.raises(ValueError, match="slow_every"):
        GpuReader(slow_every=0)


def test_nvml_slow_fields_on_the_per_link_fallback_read_error_counters_only_when_due():
    fake = FakeGpus(n=1)
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=False, slow_every=3)
        assert reader.open()
        samples = [reader.sample()[0] for _ in range(4)]
        reader.close()
    assert [tuple(r.counters) for r in samples] == [COUNTER_NAMES[:3] + COUNTER_NAMES[4:], (), (),
                                                    COUNTER_NAMES[:3] + COUNTER_NAMES[4:]]
    assert all(r.gauges["nvlink_links_active"] == 4 for r in samples)
    assert fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].call_count == 2 * 4 * 4      # 2 slow samples
    assert fake.mocks["nvmlDeviceGetNvLinkState"].call_count == pynvml.NVML_NVLINK_MAX_LINKS + 4 * 4   # discovery, then every sample


def test_slow_nvml_counters_keep_exact_deltas_through_the_worker_pipeline():
    """Snapshots of the node collector (GPU blocks with and without the slow counters) through
    the worker's per-source stage: the rate state is kept per layout, so the ECC increase
    between two slow reads is seen once, with its full size, on the next read."""
    from fabricwatch.streams.pipeline import DetectionPipeline

    config = NodeConfig.from_dict({"node_name": "gpu-node-1", "cluster": "c1",
                                   "sources": {"sysfs": False, "ethtool": False}, "nvml": {"slow_fields_s": 5.0}})
    assert config.nvml_slow_every == 5
    fake = FakeGpus(n=2)
    uncorrected = {0: 0, 1: 0}
    fake.mocks["nvmlDeviceGetTotalEccErrors"].side_effect = \
        lambda h, t, c: 7 if t == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else uncorrected[h.i]
    pipeline = DetectionPipeline()
    found, layouts = [], []
    t0 = time.time_ns() - 60 * 10**9
    with fake.patch():
        collector = NodeCollector(config, gpu_reader=GpuReader(xid_events=False, energy=False,
                                                               slow_every=config.nvml_slow_every))
        for tick in range(16):
            if tick == 7:
                uncorrected[1] = 2                       # two uncorrectable errors between reads
            snap = collector.collect({"nvml"})
            snap.time_unix_ns = t0 + tick * 10**9
            assert validate_snapshot(snap, time.time_ns()).problems == []
            layouts.append(tuple(snap.blocks[0].counter_names))
            found += [(tick, f) for f in pipeline.observe(snap).findings]
        collector.close()
    assert [i for i, names in enumerate(layouts) if names] == [0, 5, 10, 15]
    assert set(layouts) == {(), tuple(n for n in COUNTER_NAMES if n != "energy_mj")}
    ecc = [(tick, f) for tick, f in found if f.kind == "gpu_ecc_uncorrectable"]
    assert [(tick, f.entity.device, f.evidence[0].value) for tick, f in ecc] == [(10, "gpu1", 2.0)]


def test_nvml_not_supported_degrades_one_column_reported_once_and_not_called_again(caplog):
    fake = FakeGpus()
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)    # per-link NVLink calls
    fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail("nvmlDeviceGetPcieReplayCounter", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].side_effect = lambda h, link, c: (
        (_ for _ in ()).throw(nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED))
        if c == pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA else 5)
    with fake.patch(), caplog.at_level("INFO", logger="fabricwatch.collectors.nvml"):
        reader = GpuReader(xid_events=False)
        assert reader.open()
        first = rows_by_id(reader.sample())
        second = rows_by_id(reader.sample())
        reader.close()
    for rows in (first, second):
        g = rows["gpu0"]
        assert math.isnan(g.gauges["remapped_rows_correctable"]) and math.isnan(g.gauges["remapped_rows_failure"])
        assert "pcie_replay_total" not in g.counters and "nvlink_crc_data_errors_total" not in g.counters
        assert g.counters["nvlink_crc_flit_errors_total"] == 20 and g.gauges["power_mw"] == 612_345
    assert fake.mocks["nvmlDeviceGetRemappedRows"].call_count == 2             # once per GPU, never again
    assert fake.mocks["nvmlDeviceGetPcieReplayCounter"].call_count == 2
    logged = [r.message for r in caplog.records if "nvmlDeviceGetRemappedRows" in r.message]
    assert len(logged) == 2                                                   # one line per GPU
    assert sum("nvlink_crc_data_errors_total" in r.message for r in caplog.records) == 2   # not one per link


def test_nvlink_field_values_that_do_not_answer_every_field_fall_back_to_per_link_calls():
    fake = FakeGpus(n=1)
    good = fake.mocks["nvmlDeviceGetFieldValues"].side_effect

    def partial(h, ids):
        out = good(h, ids)
        out[-1] = SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=3, value=None)
        return out

    fake.mocks["nvmlDeviceGetFieldValues"].side_effect = partial
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        first, second = reader.sample()[0], reader.sample()[0]
        reader.close()
    assert first.counters["nvlink_recovery_errors_total"] == 6 == second.counters["nvlink_recovery_errors_total"]
    assert fake.mocks["nvmlDeviceGetFieldValues"].call_count == 1       # tried once, per link after that
    assert reader.problems.counts["nvml_not_supported"] == 1


def test_nvml_function_not_found_falls_back_for_temperature_and_nans_the_rest():
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetTemperatureV", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.fail("nvmlDeviceGetGpuMaxPcieLinkGeneration", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        g = reader.sample()[0]
        g2 = reader.sample()[0]
        reader.close()
    assert g.gauges["temperature_c"] == 99 == g2.gauges["temperature_c"]     # nvmlDeviceGetTemperature
    assert fake.mocks["nvmlDeviceGetTemperatureV"].call_count == 1
    assert math.isnan(g.gauges["clocks_event_reasons"]) and math.isnan(g.gauges["pcie_gen_max"])
    assert math.isnan(g.gauges["nvlink_links_active"]) and "nvlink_crc_flit_errors_total" not in g.counters
    assert reader.problems.counts["nvml_not_supported"] >= 4

    # a sensor that is NOT_SUPPORTED by the V call is not asked of the deprecated one
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetTemperatureV", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        reader.open()
        assert math.isnan(reader.sample()[0].gauges["temperature_c"])
        reader.close()
    assert not fake.mocks["nvmlDeviceGetTemperature"].called


def test_nvml_transient_error_is_retried_and_a_missing_binding_function_degrades():
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_GPU_IS_LOST)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        reader.open()
        assert math.isnan(reader.sample()[0].gauges["power_mw"])
        fake.mocks["nvmlDeviceGetPowerUsage"].side_effect = lambda h: 500_000
        assert reader.sample()[0].gauges["power_mw"] == 500_000
        with mock.patch.object(pynvml, "nvmlDeviceGetTotalEnergyConsumption", new=None):
            assert "energy_mj" not in reader.sample()[0].counters            # an older nvidia-ml-py
        reader.close()
    assert reader.problems.counts["nvml_error"] == 1


def test_no_driver_gives_one_clear_line_and_the_node_keeps_its_nic_sources(caplog):
    with mock.patch.object(pynvml, "nvmlInit", side_effect=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        reader = GpuReader()
        with caplog.at_level("WARNING"):
            assert reader.open() is False
        assert "libnvidia-ml.so.1 not found" in reader.unavailable and "\n" not in reader.unavailable
        assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
        config = NodeConfig.from_dict({"node_name": "node-0001", "sysfs_root": str(ROCE)})
        collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()))
    assert collector.gpu is None and "nvml" not in collector.enabled_sources()
    assert "libnvidia-ml.so.1" in collector.nvml_unavailable
    snap = collector.collect()
    assert [b.entity_kind for b in snap.blocks] == [pb.ENTITY_KIND_NIC_PORT] * 2
    collector.close()


def test_xid_events_are_queued_by_the_thread_and_sent_with_the_next_snapshot():
    fake = FakeGpus()
    xid = pynvml.nvmlEventTypeXidCriticalError
    fake.events = [SimpleNamespace(device=fake.handles[1], eventType=xid, eventData=79),
                   SimpleNamespace(device=fake.handles[1], eventType=xid, eventData=79),   # a repeat is a new event
                   SimpleNamespace(device=fake.handles[0], eventType=xid, eventData=48)]
    with fake.patch():
        reader = GpuReader(event_wait_ms=20)
        assert reader.open() and reader.events_running
        assert reader.event_status["registered"] == ["gpu0", "gpu1"]
        config = NodeConfig.from_dict({"node_name": "node-0001", "sysfs_root": str(ROCE)})
        collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=reader)
        deadline = time.monotonic() + 5
        while len(reader._events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = collector.collect({"nvml"})
        collector.close()
        assert not reader.events_running
    assert [(e.entity_id, e.kind, e.code) for e in snap.events] == [("gpu1", "xid", 79), ("gpu1", "xid", 79),
                                                                    ("gpu0", "xid", 48)]
    assert all(e.time_unix_ns > 0 and "Xid" in e.detail for e in snap.events)
    assert [b.entity_kind for b in snap.blocks] == [pb.ENTITY_KIND_GPU]
    fake.mocks["nvmlDeviceRegisterEvents"].assert_called()
    fake.mocks["nvmlEventSetFree"].assert_called_once()


def test_xid_not_registered_where_the_gpu_does_not_support_it():
    fake = FakeGpus(n=1)
    fake.mocks["nvmlDeviceGetSupportedEventTypes"].side_effect = lambda h: 0x1 | 0x2     # ECC only
    with fake.patch():
        reader = GpuReader(event_wait_ms=20)
        assert reader.open()
        assert not reader.events_running and reader.event_status["registered"] == []
        assert "lack XID" in reader.event_status["not_supported"][0]
        assert reader.sample()[0].gauges["power_mw"] == 612_345      # sampling unaffected
        reader.close()
    fake.mocks["nvmlDeviceRegisterEvents"].assert_not_called()


def test_gpu_check_report_and_exit_codes(capsys):
    from fabricwatch.collectors import gpu_check

    fake = FakeGpus(n=1)
    fake.mocks["nvmlSystemGetDriverVersion"] = mock.MagicMock(return_value="580.159.04")
    with fake.patch(), mock.patch.object(pynvml, "nvmlSystemGetDriverVersion", fake.mocks["nvmlSystemGetDriverVersion"]):
        report, code = gpu_check.build_report(gap_s=0.01)
    assert code == 0 and report["ok"]
    gpu = report["gpus"][0]
    assert gpu["fields"]["power_mw"] == {"call": "nvmlDeviceGetPowerUsage", "value": 612_345, "us": mock.ANY}
    assert gpu["nvlink_links_found"] == [0, 1, 2, 3] and report["nvml"]["driver_version"] == "580.159.04"
    assert report["xid_events"]["registered"] == ["gpu0"]
    json.dumps(report)                                   # JSON-clean (NaN written as null)
    with mock.patch.object(pynvml, "nvmlInit", side_effect=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        assert gpu_check.main(["--gap", "0"]) == 3
    assert json.loads(capsys.readouterr().out)["exit_status"] == 3


# =========================================================================== collector: ticks and config
def roce_collector(**config) -> NodeCollector:
    cfg = NodeConfig.from_dict({"node_name": "node-0001", "cluster": "c1", "sysfs_root": str(ROCE), **config})
    return NodeCollector(cfg, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=False)


def test_ticks_carry_the_due_sources_and_the_pfc_layout_never_changes():
    collector = roce_collector()
    assert collector.enabled_sources() == ["ethtool_pfc", "ethtool", "sysfs"]
    plan = {s.source: (s.interval_s, s.next_s) for s in collector.schedule(100.0)}
    assert plan == {"ethtool_pfc": (0.1, 100.0), "ethtool": (1.0, 100.05), "sysfs": (1.0, 100.05)}
    fast1 = collector.collect({"ethtool_pfc"})
    slow = collector.collect({"sysfs", "ethtool"})
    fast2 = collector.collect({"ethtool_pfc"})
    assert [s.seq for s in (fast1, slow, fast2)] == [1, 2, 3]
    [b1], [b2] = fast1.blocks, fast2.blocks
    assert (list(b1.counter_names), list(b1.gauge_names)) == (list(b2.counter_names), list(b2.gauge_names))
    assert list(b1.gauge_names) == ["netdev_speed_mbps"] and math.isnan(b1.gauges[0])   # before any sysfs read
    assert set(b2.gauges) == {400000.0}
    rows = block_rows(b2)
    assert rows["mlx5_0/1"].counters["tx_prio3_pause_duration"] == 48_211
    assert rows["mlx5_0/1"].labels == {"netdev": "enp24s0np0"} and "port_xmit_data" not in rows["mlx5_0/1"].counters
    slow_rows = {}
    for b in slow.blocks:
        slow_rows.update(block_rows(b))
    merged = slow_rows["mlx5_7/1"]          # sysfs and slow ethtool columns of one port: one row
    assert merged.counters["port_xmit_data"] == 4_519_221_734_810 + 7 * 1_000_033
    assert merged.counters["link_down_events_phy"] == 2 and "rx_prio3_pause" not in merged.counters
    assert validate_snapshot(slow, time.time_ns()).problems == []
    assert validate_snapshot(fast2, time.time_ns()).problems == []
    collector.close()


class PausesFrom(RecordedSource):
    """The recorded mlx5 statistics of a port that starts pausing at its ``start``-th read
    (``rx_prio3_pause`` and 90 ms of ``rx_prio3_pause_duration`` per read from then on), and
    whose per-priority traffic counters move on every read, as on any loaded link."""

    def __init__(self, netdev: str, start: int) -> None:
        super().__init__({n: str(ETHTOOL_TXT) for n in ROCE_NETDEVS})
        self.netdev, self.start, self.reads = netdev, start, 0

    def values(self, ifname, n):
        if ifname == self.netdev:
            self.reads += 1
            names, values = self._load(ifname)
            values[names.index("rx_prio3_bytes")] += 4096 * 1000       # traffic alone is not urgent
            values[names.index("rx_prio3_pause_duration")] += 50        # nor a 50 us incast pause
            if self.reads >= self.start:
                values[names.index("rx_prio3_pause")] += 1000
                values[names.index("rx_prio3_pause_duration")] += 90_000
        return super().values(ifname, n)


async def test_quiet_ticks_linger_but_moving_pause_counters_go_out_at_once():
    """Grouping saves CPU (one gRPC batch per linger_s), but a storm must not wait for it:
    the first tick in which a port paused is handed over with its group at once."""
    source = PausesFrom(ROCE_NETDEVS[2], start=10)
    collector = NodeCollector(NodeConfig.from_dict({"node_name": "node-0001", "cluster": "c1", "sysfs_root": str(ROCE)}),
                              ethtool_reader=EthtoolReader(source=source), gpu_reader=False)
    handed: list[tuple[float, pb.Snapshot]] = []
    stop = asyncio.Event()
    try:
        stats = await asyncio.wait_for(collector.run(stop, on_snapshot=lambda snap: handed.append(
            (time.time(), snap)), max_snapshots=16, linger_s=2.0), 20)
    finally:
        collector.close()
    pauses = []                    # (delay to hand-over, rx_prio3_pause of the port) per PFC tick
    for at, snap in handed:
        for block in snap.blocks:
            if "rx_prio3_pause" in block.counter_names and "port_xmit_data" not in block.counter_names:
                pauses.append((at - snap.time_unix_ns / 1e9, block_rows(block)["mlx5_2/1"].counters["rx_prio3_pause"]))
    moved = next(i for i in range(1, len(pauses)) if pauses[i][1] != pauses[i - 1][1])
    assert pauses[0][0] > 0.5                        # quiet: the first tick waited with its group
    assert all(delay < 1.0 for delay, _ in pauses[moved:]), pauses   # moving: each tick out at once (linger 2 s)
    assert stats["urgent_ticks"] == len(pauses) - moved


def test_a_link_that_changes_state_or_rate_makes_its_tick_urgent(tmp_path):
    """A link going down or retraining must not wait for the linger; a steady one waits."""
    root = tmp_path / "sysfs"
    shutil.copytree(IB, root, symlinks=True)
    collector = NodeCollector(NodeConfig.from_dict({"node_name": "ib-node", "sysfs_root": str(root)}), gpu_reader=False)
    try:
        collector.collect({"sysfs"})
        assert not collector.take_link_change()              # the first read has nothing to compare with
        collector.collect({"sysfs"})
        assert not collector.take_link_change()
        state = next(root.rglob("mlx5_0/ports/1/state"))
        state.write_text("1: DOWN\n")
        collector.collect({"sysfs"})
        assert collector.take_link_change() and not collector.take_link_change()   # taken once
        collector.collect({"sysfs"})
        assert not collector.take_link_change()              # still down: no change
        assert collector.stats["link_change_ticks"] == 1
    finally:
        collector.close()


def test_ib_node_sends_no_pfc_ticks():
    cfg = NodeConfig.from_dict({"node_name": "ib-node", "sysfs_root": str(IB)})
    collector = NodeCollector(cfg, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=False)
    assert collector.collect({"ethtool_pfc"}) is None and collector.seq == 0
    snap = collector.collect({"sysfs", "ethtool"})
    assert snap.seq == 1 and [len(b.entity_ids) for b in snap.blocks] == [2]
    collector.close()


def test_config_refuses_unknown_keys_and_bad_values_with_clear_errors(tmp_path):
    def load(text):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return load_config(str(path))

    with pytest.raises(ConfigError, match=r"config: unknown key 'node' \(allowed: node_name"):
        load("node: x\n")
    with pytest.raises(ConfigError, match=r"intervals: unknown key 'pfc' \(allowed: ethtool_pfc, ethtool"):
        load("intervals:\n  pfc: 0.1\n")
    with pytest.raises(ConfigError, match=r"intervals.sysfs: expected a number in 0.01..3600, got 0.001"):
        load("intervals:\n  sysfs: 0.001\n")
    with pytest.raises(ConfigError, match=r"sources.nvml: expected true or false"):
        load("sources:\n  nvml: 'yes'\n")
    with pytest.raises(ConfigError, match=r"not loopback: set gateway.ca_cert"):
        load("gateway:\n  target: gw.example:50051\n  token_file: /t\n")
    with pytest.raises(ConfigError, match=r"not loopback: set gateway.token_file"):
        load("gateway:\n  target: gw.example:50051\n  ca_cert: /ca.pem\n")
    with pytest.raises(ConfigError, match=r"node_name 'bad name'"):
        load("node_name: bad name\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load("intervals: [\n")
    with pytest.raises(ConfigError, match=r"nvml.slow_fields_s = 0.5: must be intervals.nvml \(1.0\)"):
        load("nvml:\n  slow_fields_s: 0.5\n")
    assert load("intervals:\n  nvml: 2.0\nnvml:\n  slow_fields_s: 2.0\n").nvml_slow_every == 1
    assert load("intervals:\n  nvml: 3.0\n").nvml_slow_every == 3              # 10 s in 3 s samples
    config = load("")
    assert config.intervals.ethtool_pfc == 0.1 and config.gateway.max_buffered == node_config.DEFAULT_MAX_BUFFERED
    assert (config.nvml.slow_fields_s, config.nvml_slow_every) == (10.0, 10)
    assert config.source_name == socket.gethostname()


def test_example_config_loads_and_builds_the_sender_config(tmp_path):
    example = Path(__file__).parent.parent / "deploy" / "collector.example.yaml"
    config = load_config(str(example))
    assert config.gateway.ca_cert and config.gateway.token_file and config.sources.nvml
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    sender = NodeConfig.from_dict({"gateway": {"token_file": str(token), "max_buffered": 500}}).sender_config()
    assert (sender.token, sender.max_buffered) == ("s3cret", 500)


def test_cli_once_print_prints_one_snapshot_as_json(tmp_path, capsys):
    import argparse

    from google.protobuf import json_format

    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "default.txt").write_text(ETHTOOL_TXT.read_text())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"node_name: node-0001\ncluster: c1\nsysfs_root: {ROCE}\nsources:\n  nvml: false\n"
                   f"ethtool:\n  recorded_dir: {rec}\n")
    parser = argparse.ArgumentParser()
    node_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["collect", "--config", str(cfg), "--once", "--print"])
    assert args.func(args) == 0
    snap = json_format.Parse(capsys.readouterr().out.strip(), pb.Snapshot())
    rows = {}
    for b in snap.blocks:
        rows.update(block_rows(b))
    assert snap.source == "node-0001" and snap.seq == 1 and len(rows) == 8
    assert rows["mlx5_0/1"].counters["rx_prio3_pause"] == 123                 # fast, slow and sysfs in one row
    assert rows["mlx5_0/1"].counters["link_down_events_phy"] == 2
    assert rows["mlx5_0/1"].labels["rate"] == "400 Gb/sec (4X NDR)"


# =========================================================================== end to end over gRPC






async def test_end_to_end_recorded_roce_node_to_the_real_gateway():
    sink, port = RecordingSink(), free_port()
    service = IngestService(sink, cluster="c1")   # the gateway (or the token) decides the cluster
    server = await start_server(service, port)
    config = NodeConfig.from_dict({"node_name": "node-0001", "cluster": "c1", "sysfs_root": str(ROCE),
                                   "gateway": {"target": f"127.0.0.1:{port}"}})
    with mock.patch.object(pynvml, "nvmlInit", side_effect=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()))
    assert collector.gpu is None                                    # NVML absent: NIC sources only
    sender = GatewaySender(config.sender_config())
    stop, sender_stop = asyncio.Event(), asyncio.Event()
    sender_task = asyncio.create_task(sender.run(sender_stop))
    try:
        stats = await asyncio.wait_for(collector.run(stop, sender=sender, max_snapshots=13), 20)
        assert await sender.drain(10)
    finally:
        sender_stop.set()
        await sender_task
        await server.stop(0)
        collector.close()
    snaps = sink.snapshots()
    assert [s.seq for s in snaps] == list(range(1, 14)) and stats["snapshots"] == 13
    assert service.stats.rejected == 0 and not service.stats.problems
    assert all(s.source == "node-0001" and s.cluster == "c1" and s.source_kind == pb.SOURCE_KIND_NODE for s in snaps)
    full = [s for s in snaps if any("port_xmit_data" in b.counter_names for b in s.blocks)]
    fast = [s for s in snaps if s not in full]
    assert len(full) in (1, 2) and len(fast) >= 11
    rows = {}
    for b in full[0].blocks:
        rows.update(block_rows(b))
    assert rows["mlx5_0/1"].counters["port_xmit_data"] == 4_519_221_734_810
    assert rows["mlx5_0/1"].counters["np_cnp_sent"] == 12_884
    assert rows["mlx5_0/1"].counters["link_down_events_phy"] == 2
    assert rows["mlx5_3/1"].gauges["pcie_gen_current"] == 4.0
    assert rows["mlx5_7/1"].labels == {"rate": "400 Gb/sec (4X NDR)", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                                       "link_layer": "Ethernet", "netdev": "enp220s0np0", "pci_bdf": "0000:dc:00.0"}
    fast_rows = block_rows(fast[-1].blocks[0])
    assert fast_rows["mlx5_5/1"].counters["rx_prio3_pause"] == 123
    times = [s.time_unix_ns for s in snaps]
    assert times == sorted(times)
    gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:])]
    assert 0.03 < min(gaps) and max(gaps) < 0.5                    # 100 ms PFC ticks, the 1 s tick between two


@pytest.mark.slow
async def test_gateway_outage_loses_nothing_and_keeps_order():
    sink, port = RecordingSink(), free_port()
    service = IngestService(sink, cluster="c1")   # the gateway (or the token) decides the cluster
    server = await start_server(service, port)
    config = NodeConfig.from_dict({"node_name": "node-0001", "cluster": "c1", "sysfs_root": str(ROCE),
                                   "intervals": {"ethtool_pfc": 0.05, "ethtool": 0.25, "sysfs": 0.25},
                                   "gateway": {"target": f"127.0.0.1:{port}", "max_batch": 8, "linger_s": 0.2}})
    collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=False)
    sender = GatewaySender(SenderConfig(target=config.gateway.target, max_batch=8, backoff_initial_s=0.05,
                                        backoff_max_s=0.2))
    stop, sender_stop = asyncio.Event(), asyncio.Event()
    sender_task = asyncio.create_task(sender.run(sender_stop))
    run_task = asyncio.create_task(collector.run(stop, sender=sender))
    try:
        await asyncio.sleep(0.6)
        await server.stop(0)                                        # outage
        before = collector.seq
        await asyncio.sleep(1.2)
        assert collector.seq > before + 10                          # sampling went on...
        assert sender.buffered > 10                                 # ...into the buffer
        server = await start_server(service, port)                  # back
        await asyncio.sleep(0.6)
        stop.set()
        await run_task
        assert await sender.drain(15)
    finally:
        stop.set()
        sender_stop.set()
        await sender_task
        await server.stop(0)
        collector.close()
    seqs = [s.seq for s in sink.snapshots()]
    assert seqs == list(range(1, collector.seq + 1))                # nothing lost, nothing reordered
    assert sender.stats["dropped_buffer_full"] == 0 and sender.stats["reconnects"] >= 1


