"""Gateway service and collector sender over real gRPC (Kafka replaced by a recording sink).

The end-to-end path with the real broker is in test_pipeline_kafka.py; here the gRPC
contract, authentication, rejection and the sender's outage buffer are tested in isolation.
"""
import asyncio
import time

import grpc
import pytest
from helpers import RecordingSink, free_port, gpu_block, nic_snapshot, start_server

from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.auth import Collector, TokenAuth, token_digest
from fabricwatch.streams.gateway import IngestService








def sources(sink):
    return [s.source for s in sink.snapshots()]


async def test_batch_is_acked_with_counts_and_valid_parts_kept():
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    try:
        good = nic_snapshot(source="node-0001")
        partly_bad = nic_snapshot(source="node-0002")
        gpu_block(partly_bad)
        del partly_bad.blocks[1].counters[:]     # the GPU block is broken, the NIC block kept
        bad = nic_snapshot(source="")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            ack = await pb_grpc.IngestStub(ch).Send(pb.IngestBatch(batch_id=7, snapshots=[good, partly_bad, bad]))
        assert (ack.batch_id, ack.accepted, ack.rejected, ack.dropped_parts) == (7, 2, 1, 1)
        assert dict(ack.problems_by_reason) == {"bad_counter_count": 1, "bad_source": 1}
        assert [r.index for r in ack.rejections] == [1, 2]
        assert sources(sink) == ["node-0001", "node-0002"]
        kept = sink.snapshots()[1]
        assert [b.entity_kind for b in kept.blocks] == [pb.ENTITY_KIND_NIC_PORT]
    finally:
        await server.stop(0)


async def test_records_are_keyed_by_source_and_rank_steps_by_job():
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    try:
        snap = nic_snapshot(source="node-0003")
        for rank, job in ((0, "job-a"), (1, "job-a"), (2, "job-b")):
            snap.rank_steps.add(job_id=job, rank=rank, world_size=4, node="node-0003", step=1,
                                start_unix_ns=snap.time_unix_ns - 10**9, step_seconds=1, busy_seconds=0.5,
                                collective_wait_seconds=0.5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await pb_grpc.IngestStub(ch).Send(pb.IngestBatch(snapshots=[snap]))
        keys = sorted((t, k) for t, k, v in sink.records)
        assert keys == [(topics.RANK_STEPS, b"job-a"), (topics.RANK_STEPS, b"job-b"), (topics.TELEMETRY, b"node-0003")]
        telemetry, = sink.snapshots()
        assert len(telemetry.rank_steps) == 0
    finally:
        await server.stop(0)


async def test_unknown_token_is_refused_and_a_collector_cannot_speak_for_another_node():
    auth = TokenAuth([Collector("rack-1", token_digest("s3cret"), ("node-1*",))])
    sink, port = RecordingSink(), free_port()
    service = IngestService(sink, auth)
    server = await start_server(service, port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.IngestStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Send(pb.IngestBatch(snapshots=[nic_snapshot(source="node-10")]),
                                metadata=(("authorization", "Bearer wrong"),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ack = await stub.Send(pb.IngestBatch(snapshots=[nic_snapshot(source="node-10"),
                                                            nic_snapshot(source="node-20")]),
                                  metadata=(("authorization", "Bearer s3cret"),))
        assert (ack.accepted, ack.rejected) == (1, 1)
        assert dict(ack.problems_by_reason) == {"source_not_allowed": 1}
        assert sources(sink) == ["node-10"]
        assert service.stats.unauthenticated_streams == 1
    finally:
        await server.stop(0)


async def test_sender_buffers_across_a_gateway_outage_and_resends_in_order():
    sink, port = RecordingSink(), free_port()
    service = IngestService(sink)
    server = await start_server(service, port)
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", max_batch=5, backoff_initial_s=0.05,
                                        backoff_max_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    t0 = time.time_ns()
    try:
        for i in range(20):
            sender.submit(nic_snapshot(source="node-0001", t_ns=t0 + i, seq=i))
        assert await sender.drain(10)
        await server.stop(0)                      # outage
        for i in range(20, 60):
            sender.submit(nic_snapshot(source="node-0001", t_ns=t0 + i, seq=i))
        await asyncio.sleep(0.5)
        assert sender.buffered == 40
        server = await start_server(service, port)  # back
        assert await sender.drain(15)
        seqs = [s.seq for s in sink.snapshots()]
        assert seqs == list(range(60))            # nothing lost, nothing reordered
        assert sender.stats["dropped_buffer_full"] == 0
    finally:
        stop.set()
        await task
        await server.stop(0)


async def test_broker_failure_leaves_the_batch_unacked_for_resend():
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", backoff_initial_s=0.05, backoff_max_s=0.1))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        sink.fail = True
        sender.submit(nic_snapshot(source="node-0001", seq=1))
        await asyncio.sleep(0.5)
        assert sink.records == [] and sender.buffered == 1
        sink.fail = False
        assert await sender.drain(10)
        assert sources(sink) == ["node-0001"]
    finally:
        stop.set()
        await task
        await server.stop(0)


def test_bounded_buffer_drops_oldest_and_counts():
    sender = GatewaySender(SenderConfig(max_buffered=10))
    for i in range(25):
        sender.submit(nic_snapshot(seq=i))
    assert sender.buffered == 10
    assert sender.stats["dropped_buffer_full"] == 15
    assert [s.seq for s in sender._pending] == list(range(15, 25))


async def test_sender_recovers_when_the_gateway_dies_with_the_window_full():
    class StuckSink(RecordingSink):
        async def write(self, records):
            if self.fail:
                await asyncio.sleep(3600)   # Kafka hangs: no ack ever comes
            self.records.extend(records)

    sink, port = StuckSink(), free_port()
    sink.fail = True
    service = IngestService(sink)
    server = await start_server(service, port)
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", max_batch=2, max_in_flight=1,
                                        backoff_initial_s=0.05, backoff_max_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        for i in range(10):
            sender.submit(nic_snapshot(source="node-0001", seq=i))
        await asyncio.sleep(0.5)                  # one batch on the wire, the window is full
        await server.stop(0)                      # the gateway dies without acking
        sink.fail = False
        server = await start_server(service, port)
        assert await sender.drain(15), sender.stats
        assert sorted(s.seq for s in sink.snapshots()) == list(range(10))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)          # and it stops when asked
        await server.stop(0)
