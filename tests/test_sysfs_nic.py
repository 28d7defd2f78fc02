"""The node collector's sysfs NIC reader on recorded trees, and how it degrades.

Fixtures (tests/fixtures/):
* ``sysfs/roce_cx7``: a ConnectX-7 RoCE node, 8 ports mlx5_0..7 (``400 Gb/sec (4X NDR)``,
  link_layer Ethernet); mlx5_3's PCIe link trained down to Gen4; mlx5_7 lacks the
  optional roce_accl / ext-PPCNT hw counters.
* ``sysfs/ib_ndr``: an InfiniBand NDR node, 2 ports (mlx5_1 at ``200 Gb/sec (2X NDR)``).
"""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from helpers import IB, ROCE, ROCE_NETDEVS, block_rows, copy_tree, rows_by_id

from fabricwatch.collectors.sysfs_nic import NicReader, rows_to_blocks
from fabricwatch.counters import NIC_GAUGES, NIC_LABELS
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.validate import validate_snapshot

ROCE_BDFS = ["0000:18:00.0", "0000:40:00.0", "0000:4f:00.0", "0000:5e:00.0", "0000:9a:00.0", "0000:c0:00.0",
             "0000:ce:00.0", "0000:dc:00.0"]
OPTIONAL_HW = {"roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
               "roce_slow_restart_trans", "rx_icrc_encapsulated"}


def port_dir(tree: Path, dev: str) -> Path:
    return Path(os.path.realpath(tree / "class" / "infiniband" / dev)) / "ports" / "1"


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


