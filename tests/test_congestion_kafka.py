"""lossless_drop end to end on the real broker: a switch's gNMI-shaped snapshots -> gRPC gateway ->
Kafka -> the worker process (`fabricwatch worker`) -> an anomaly with its tuning hint."""
import time
import uuid

import pytest
from helpers import gateway_and_sender
from test_pipeline_kafka import collect_anomalies, start_worker

from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.kafka
S = 10**9
PORTS = ("Ethernet0", "Ethernet4")


def switch_snapshot(source: str, t_ns: int, seq: int) -> pb.Snapshot:
    """Queue 3 of Ethernet4 drops 7 packets a second on a live link; queue 0 of both ports drops more (lossy)."""
    snap = pb.Snapshot(source=source, source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=t_ns, seq=seq)
    names = ["queue3-dropped-pkts", "queue0-dropped-pkts", "interface-transitions"]
    block = snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=list(PORTS), counter_names=names,
                            gauge_names=["oper_up"])
    for k, _ in enumerate(PORTS):
        block.counters.extend([1000 + 7 * seq * k, 5000 + 90 * seq, 4])
        block.gauges.append(1.0)
    return snap


async def test_lossless_drops_on_a_switch_port_reach_the_anomalies_topic(kafka_bootstrap, tmp_path, unused_tcp_port):
    app_id = f"fw-test-{uuid.uuid4().hex[:8]}"
    worker = start_worker(kafka_bootstrap, tmp_path, app_id)
    switch = f"leaf-{uuid.uuid4().hex[:6]}"
    try:
        async with gateway_and_sender(kafka_bootstrap, unused_tcp_port) as sender:
            t0 = time.time_ns()
            for i in range(14):
                sender.submit(switch_snapshot(switch, t0 + i * S, i))
            assert await sender.drain(30)

            def done(found):
                return any(e.entity.switch == switch for _, e in found)

            found = await collect_anomalies(kafka_bootstrap, done, 90, group=f"reader-{app_id}")
            mine = [e for _, e in found if e.entity.switch == switch]
            assert [(e.kind, e.lifecycle, e.entity.port, e.entity.device) for e in mine] == [
                ("lossless_drop", ev.LIFECYCLE_OPEN, "Ethernet4", "queue3")]
            assert "PG headroom" in mine[0].suggested_action and "Ethernet4" in mine[0].suggested_action
            assert mine[0].cause_code == "headroom_misconfig"
    finally:
        worker.terminate()
        worker.wait(30)
