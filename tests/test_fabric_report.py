"""`fabricwatch report`: the fabric summary's totals, the uplink balance, the report from a
recording (storm sources, hints, plots) and from a Kafka window (a real broker)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from fabricwatch import fabric_report
from fabricwatch.models.fabric_summary import FabricSummary
from fabricwatch.models.frames import FrameStack, SourceBatch
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.streams import topics
from fabricwatch.streams.decode import pack
from fabricwatch.recording import RecordingWriter

S = 10**9
T0 = 1_790_000_000 * S


def switch_batch(source, t_s, ports, counters, names=("out-octets", "pfc3-tx-pkts")):
    stack = FrameStack("switch_port", tuple(ports), names, (), np.array([0]),
                       np.array([counters], dtype=np.uint64), np.empty((1, len(ports), 0)))
    return SourceBatch("c1", source, "switch", np.array([T0 + int(t_s * S)]), [stack])


def test_totals_follow_the_counter_semantics_a_reset_adds_nothing():
    summary = FabricSummary()
    summary.add(switch_batch("leaf", 0, ["Ethernet0"], [[1000, 10]]))
    summary.add(switch_batch("leaf", 1, ["Ethernet0"], [[3000, 30]]))
    summary.add(switch_batch("leaf", 2, ["Ethernet0"], [[500, 5]]))       # a reboot: no honest rate
    summary.add(switch_batch("leaf", 3, ["Ethernet0"], [[1500, 15]]))
    port = summary.ports[("c1", "leaf", "Ethernet0")]
    assert (port["tx_bytes"], port["pause_tx_frames"], summary.seconds) == (3000.0, 30.0, 3.0)


def test_uplink_balance_names_the_unequal_leaf_first_and_its_utilisation():
    topo = rail_optimised("c1", n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)
    leaves = sorted(n for n, sw in topo.switches.items() if sw.role == "leaf")
    uplinks = {leaf: [l.a_port for l in topo.links if l.a_switch == leaf] for leaf in leaves}
    summary = FabricSummary(topo)
    per_s = {leaves[0]: [25e9, 25e9], leaves[1]: [45e9, 5e9]}          # bytes/s on each of 2 uplinks
    for t in range(3):
        for leaf, rates in per_s.items():
            summary.add(switch_batch(leaf, t, uplinks[leaf], [[int(r * t), 0] for r in rates]))
    balance = summary.uplink_balance()
    assert [b.leaf for b in balance] == [leaves[1], leaves[0]]
    hot = balance[0]
    assert hot.max_over_mean == pytest.approx(1.8) and hot.coefficient_of_variation == pytest.approx(0.8)
    assert hot.mean_utilisation == pytest.approx(50e9 * 8 / 800e9)      # 2 x 400G uplinks at 50 GB/s in all
    assert balance[1].coefficient_of_variation == pytest.approx(0.0)


@pytest.mark.slow
def test_report_of_a_recorded_storm_names_its_source_with_plots_in_markdown_and_html(tmp_path):
    topo = rail_optimised("sim", n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)
    storm = PfcStorm(sources=(("node-0003", "mlx5_1/1"),), onset_s=2.0, offset_s=8.0)
    sim = ClusterSimulator(topo, seed=5, interval_s=0.1, faults=[storm], rank_steps=False)
    path = tmp_path / "rec.bin"
    with open(path, "wb") as fh:
        writer = RecordingWriter(fh)
        for tick in sim.run(12.0):
            for snap in tick:
                writer.write(snap)
    summary, events = fabric_report.from_recording(path, topo)
    report = fabric_report.build(summary, events)
    md_path, html_path = tmp_path / "r.md", tmp_path / "r.html"
    fabric_report.write(report, md_path, html_path)
    md = md_path.read_text()
    storms = md.split("## PFC storms")[1].split("##")[0]
    assert "node-0003 mlx5_1 1" in storms, storms
    assert (tmp_path / "r_files" / "switch_pause_vs_ecn.png").stat().st_size > 1000
    assert "](r_files/pause_timeline.png)" in md
    page = html_path.read_text()
    assert page.count("data:image/png;base64,") == md.count("](r_files/") >= 2 and "<h2>Tuning hints</h2>" in page
    leaf = topo.nic(*"node-0003 mlx5_1/1".split()).switch
    assert max(t["pause_tx_frames"] for (c, s, _), t in summary.ports.items() if s == leaf) > 0


def test_report_text_from_attacker_chosen_names_is_escaped_in_html():
    e = ev.AnomalyEvent(kind="link_downgrade", dedup_key="k", lifecycle=ev.LIFECYCLE_OPEN,
                        suggested_action="<script>alert(1)</script>", entity=ev.EntityPath(node="<b>n</b>"))
    page = fabric_report.build(FabricSummary(), [e]).html()
    assert "<script>" not in page and "&lt;script&gt;" in page and "<b>n</b>" not in page


def test_report_text_from_attacker_chosen_names_is_inert_in_markdown(tmp_path):
    e = ev.AnomalyEvent(kind="link_downgrade", dedup_key="k", lifecycle=ev.LIFECYCLE_OPEN,
                        suggested_action="drain | ![x](http://evil.example/a.png) **URGENT**\n## forged",
                        entity=ev.EntityPath(node="[n](http://evil.example)"))
    md = fabric_report.build(FabricSummary(), [e]).markdown(None)
    row = next(line for line in md.splitlines() if "URGENT" in line)
    assert "http://" not in md and "**URGENT**" not in md and "![x]" not in md and "\n## forged" not in md
    assert row.count(" | ") == md.splitlines()[md.splitlines().index(row) - 2].count(" | ")   # no extra cell
    assert "\\[n\\]" in row and "\\*\\*URGENT\\*\\*" in row


def test_cli_needs_exactly_one_input():
    out = subprocess.run([sys.executable, "-m", "fabricwatch.cli", "report"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "either --input" in out.stderr


@pytest.mark.kafka
def test_report_from_a_kafka_window_reads_the_telemetry_and_the_anomalies(kafka_bootstrap, tmp_path):
    source = f"leaf-{uuid.uuid4().hex[:6]}"
    now = time.time_ns()
    from fabricwatch.protos.v1 import telemetry_pb2 as pb

    def snap(i):
        s = pb.Snapshot(cluster="c1", source=source, source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=now + i * S, seq=i)
        b = s.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=["Ethernet0"],
                         counter_names=["out-octets", "pfc3-tx-pkts"])
        b.counters.extend([1000 * i, 7 * i])
        return s

    anomaly = ev.AnomalyEvent(kind="pfc_storm", dedup_key=f"pfc_storm:{source}", lifecycle=ev.LIFECYCLE_OPEN,
                              entity=ev.EntityPath(cluster="c1", switch=source, port="Ethernet0"),
                              suggested_action="check the storm source")

    async def write():
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            await topics.ensure_topics(kafka_bootstrap, [topics.SPECS[topics.TELEMETRY], topics.SPECS[topics.ANOMALIES]])
            for i in range(4):
                await producer.send_and_wait(topics.TELEMETRY, pack([snap(i)]).SerializeToString(), key=source.encode())
            await producer.send_and_wait(topics.ANOMALIES, anomaly.SerializeToString(), key=anomaly.dedup_key.encode())
        finally:
            await producer.stop()

    asyncio.run(write())
    summary, events = fabric_report.run_from_kafka(kafka_bootstrap, time.time() - 120, time.time() + 1, None)
    port = summary.ports[("c1", source, "Ethernet0")]
    assert (port["tx_bytes"], port["pause_tx_frames"]) == (3000.0, 21.0)
    assert any(e.dedup_key == anomaly.dedup_key for e in events)
