"""End to end on the real broker: collector -> gRPC -> gateway -> Kafka -> Faust worker -> anomalies.

The worker runs as its own process (`fabricwatch worker`), exactly as deployed.
"""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from google.protobuf.message import DecodeError
from helpers import gateway_and_sender, nic_snapshot

from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams import topics

pytestmark = pytest.mark.kafka
S = 10**9


def start_worker(bootstrap, tmp_path: Path, app_id: str, *extra: str, cwd: Path | None = None) -> subprocess.Popen:
    ready = tmp_path / f"{app_id}.ready"
    ready.unlink(missing_ok=True)
    with open(tmp_path / f"{app_id}.log", "ab") as log:        # the child keeps its own copy
        proc = subprocess.Popen([sys.executable, "-m", "fabricwatch.cli", "worker", "--broker", bootstrap,
                                 "--app-id", app_id, *extra], stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, "FABRICWATCH_WORKER_READY_FILE": str(ready)})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, (tmp_path / f"{app_id}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "worker did not join its group in 120 s"
        time.sleep(0.2)
    return proc


async def collect_anomalies(bootstrap, want, timeout_s, group):
    consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=bootstrap, group_id=group,
                                auto_offset_reset="earliest")
    await consumer.start()
    found = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not want(found):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    try:
                        found.append((r.key, ev.AnomalyEvent.FromString(r.value)))
                    except DecodeError:
                        pass   # other tests put malformed records on the shared topic on purpose
    finally:
        await consumer.stop()
    return found


async def test_downgrade_flows_through_the_whole_pipeline(kafka_bootstrap, tmp_path, unused_tcp_port):
    app_id = f"fw-test-{uuid.uuid4().hex[:8]}"
    worker = start_worker(kafka_bootstrap, tmp_path, app_id)
    node = f"node-{uuid.uuid4().hex[:6]}"
    try:
        async with gateway_and_sender(kafka_bootstrap, unused_tcp_port) as sender:
            t0 = time.time_ns()
            for i in range(6):
                rates = {5: "200 Gb/sec (4X HDR)"} if 2 <= i <= 3 else {}
                snap = nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, rates=rates, cluster="")
                if i == 1:
                    snap.blocks[0].entity_ids[3] = "bad id!"   # malformed entity: dropped, rest kept
                sender.submit(snap)
            assert await sender.drain(30)
            assert sender.stats["dropped_parts"] == 1

            def done(found):
                return any(e.lifecycle == ev.LIFECYCLE_RESOLVED and e.entity.node == node for _, e in found)

            found = await collect_anomalies(kafka_bootstrap, done, 90, group=f"reader-{app_id}")
            mine = [(k, e) for k, e in found if e.entity.node == node]
            assert [(e.kind, e.lifecycle) for _, e in mine] == [("link_downgrade", ev.LIFECYCLE_OPEN),
                                                                ("link_downgrade", ev.LIFECYCLE_RESOLVED)]
            key, opened = mine[0]
            assert key == opened.dedup_key.encode() == f"link_downgrade:it/{node}/mlx5_5/1".encode()
            assert opened.entity.device == "mlx5_5" and opened.entity.cluster == "it"
            assert opened.detected_unix_ns == t0 + 2 * S
            assert {e.name for e in opened.evidence} >= {"rate_gbps", "lanes"}
            assert "200 Gb/sec (4X HDR)" in opened.summary
    finally:
        worker.terminate()
        worker.wait(30)


async def state_manifests(bootstrap: str, app_id: str) -> set[str]:
    """Keys of the checkpoint manifests a worker group wrote on the state topic."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(topics.STATE, p) for p in await topics.partitions_of(bootstrap, topics.STATE)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        keys = set()
        async def behind() -> bool:
            return any([await consumer.position(tp) < end for tp, end in ends.items()])

        while await behind():
            for records in (await consumer.getmany(timeout_ms=500)).values():
                keys |= {r.key.decode() for r in records if r.key and r.key.endswith(b"/manifest")}
        return {k for k in keys if k.startswith(app_id + "/")}
    finally:
        await consumer.stop()


async def test_worker_restart_keeps_open_anomalies(kafka_bootstrap, tmp_path, unused_tcp_port):
    """An anomaly opened before a worker restart is resolved after it, and not opened twice."""
    app_id = f"fw-restart-{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    node = f"node-{uuid.uuid4().hex[:6]}"
    t0 = time.time_ns()
    worker = start_worker(kafka_bootstrap, tmp_path, app_id, "--state-dir", str(state))
    try:
        async with gateway_and_sender(kafka_bootstrap, unused_tcp_port) as sender:
            for i in range(4):   # opens on i=2 and stays open
                sender.submit(nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, cluster="",
                                           rates={1: "200 Gb/sec (4X HDR)"} if i >= 2 else {}))
            assert await sender.drain(30)

            def opened(found):
                return any(e.entity.node == node for _, e in found)

            await collect_anomalies(kafka_bootstrap, opened, 90, group=f"r1-{app_id}")
            worker.terminate()                       # graceful: final checkpoint
            assert worker.wait(60) == 0
            manifests = await state_manifests(kafka_bootstrap, app_id)
            assert any(k.startswith(f"{app_id}/sources/{topics.TELEMETRY}/") for k in manifests), manifests
            worker = start_worker(kafka_bootstrap, tmp_path, app_id, "--state-dir", str(state))
            for i in range(4, 6):                    # the link is back
                sender.submit(nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, cluster=""))
            assert await sender.drain(30)

            def resolved(found):
                return any(e.entity.node == node and e.lifecycle == ev.LIFECYCLE_RESOLVED for _, e in found)

            found = await collect_anomalies(kafka_bootstrap, resolved, 90, group=f"r2-{app_id}")
            mine = [(e.kind, e.lifecycle) for _, e in found if e.entity.node == node]
            assert mine == [("link_downgrade", ev.LIFECYCLE_OPEN), ("link_downgrade", ev.LIFECYCLE_RESOLVED)]
    finally:
        worker.terminate()
        worker.wait(30)
