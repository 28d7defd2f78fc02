"""The node collector as a whole: ticks and configuration, and the whole path to a real
in-process gRPC gateway, outage included (recorded sysfs tree ``tests/fixtures/sysfs/roce_cx7``
and ethtool output ``tests/fixtures/ethtool/mlx5_cx7.txt``).
"""
from __future__ import annotations

import asyncio
import math
import shutil
import socket
import time
from pathlib import Path
from unittest import mock

import pynvml
import pytest

from helpers import (ETHTOOL_TXT, IB, ROCE, ROCE_NETDEVS, RecordingSink, block_rows, free_port, nvml_error,
                     recorded_ethtool, start_server)

from fabricwatch.collectors import node_cli, node_config
from fabricwatch.collectors.ethtool_stats import EthtoolReader, RecordedSource
from fabricwatch.collectors.node import NodeCollector
from fabricwatch.collectors.node_config import ConfigError, NodeConfig, load_config
from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.gateway import IngestService
from fabricwatch.streams.validate import validate_snapshot


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


