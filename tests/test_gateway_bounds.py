"""Issue #13 at the gateway: everything in a snapshot is bound to its sender's token, one
bad item never blocks its batch, and one token cannot take the gateway's memory.

Against the real broker where Kafka decides (the record size limit, what lands on the
topics); over real gRPC with a recording sink where only the gateway is under test.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from helpers import (RecordingSink, free_port, nic_snapshot, read_topic, running, running_gateway, start_server,
                     telemetry_snapshots)

from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.admission import TokenBudgets, TokenLimits
from fabricwatch.streams.auth import Collector, TokenAuth, token_digest
from fabricwatch.streams.gateway import IngestService
from fabricwatch.streams.kafka_limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, topic_max_message_bytes

S = 10**9
RACK = TokenAuth([Collector("rack", token_digest("one"), ("node-*",))])


def big_snapshot(source: str, approx_bytes: int, seq: int = 1) -> pb.Snapshot:
    """A valid node snapshot of about `approx_bytes` (GPU counters with large values)."""
    snap = nic_snapshot(source=source, seq=seq, n_ports=2)
    n_counters = 100
    n = min(4096, approx_bytes // (n_counters * 9))
    snap.blocks.add(entity_kind=pb.ENTITY_KIND_GPU, entity_ids=[f"gpu{i}" for i in range(n)],
                    counter_names=[f"c{j}" for j in range(n_counters)], counters=[2**62 + i for i in range(n * n_counters)])
    return snap


def rank_step(node: str, job: str = "job-1", rank: int = 0, start_ns: int | None = None, **extra) -> dict:
    return dict(job_id=job, rank=rank, world_size=8, node=node, step=5,
                start_unix_ns=time.time_ns() - S if start_ns is None else start_ns,
                step_seconds=1.0, busy_seconds=0.8, collective_wait_seconds=0.2, **extra)


# ---------------------------------------------------------------------- one bad item never blocks a batch
@pytest.mark.kafka
async def test_the_broker_limit_is_read_from_the_broker_not_assumed(kafka_bootstrap):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    name = f"fw-limit-{uuid.uuid4().hex[:6]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs={"max.message.bytes": "200000"})])
    finally:
        await admin.close()
    await topics.ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    assert await topic_max_message_bytes(kafka_bootstrap, [name]) == 200_000
    assert await topic_max_message_bytes(kafka_bootstrap, [topics.TELEMETRY, name]) == 200_000
    assert await topic_max_message_bytes(kafka_bootstrap, [topics.TELEMETRY]) == KAFKA_DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.kafka
async def test_an_over_size_snapshot_is_refused_alone_and_its_batch_written_once(kafka_bootstrap):
    """A 1.6 MB snapshot used to pass validation and fail its whole batch at Kafka's limit: the
    sender resent the batch forever and its other snapshots were written again each time."""
    tag, started_s = uuid.uuid4().hex[:6], time.time() - 1
    small_a, big, small_b = f"node-{tag}-a", f"node-{tag}-big", f"node-{tag}-b"
    async with running_gateway(kafka_bootstrap) as listen, \
            running(GatewaySender(SenderConfig(target=listen, backoff_initial_s=0.05, backoff_max_s=0.2))) as sender:
        for source in (small_a, big, small_b):
            sender.submit(big_snapshot(source, 1_600_000) if source == big else nic_snapshot(source=source))
        assert await sender.drain(20), sender.stats
        await asyncio.sleep(1.0)            # a resend would show up now
        ack = sender.last_ack
    assert (ack.accepted, ack.rejected) == (2, 1) and dict(ack.problems_by_reason) == {"too_large_for_kafka": 1}
    assert [r.index for r in ack.rejections] == [1] and "bytes" in ack.rejections[0].detail
    assert sender.stats["batches_sent"] == 1 and sender.stats["stream_errors"] == 0
    written = await read_topic(kafka_bootstrap, topics.TELEMETRY, {small_a, big, small_b}, started_s)
    assert sorted(key for key, _ in written) == sorted([small_a, small_b])   # once each, the big one never


# ---------------------------------------------------------------------- bound to the sender
@pytest.mark.kafka
async def test_cluster_is_the_tokens_and_rank_steps_only_for_its_nodes_through_the_real_gateway(kafka_bootstrap):
    """A node-a* token sent its own XID plus forged rank steps for jobs elsewhere and one dated
    2^62; all were written, and the payload's cluster decided the guard rails' domain."""
    tag, started_s = uuid.uuid4().hex[:6], time.time() - 1
    own, other = f"node-{tag}-a1", f"node-{tag}-b1"
    token = f"t-{tag}"
    auth = TokenAuth([Collector("rack-a", token_digest(token), (f"node-{tag}-a*",), cluster=f"east-{tag}"),
                      Collector("rack-c", token_digest(token + "c"), (f"node-{tag}-c*",))])
    snap = nic_snapshot(source=own, cluster=f"invented-{tag}")
    jobs = {"own": f"{tag}-own", "forged": f"{tag}-forged", "future": f"{tag}-future", "elsewhere": f"{tag}-else"}
    snap.rank_steps.add(**rank_step(own, jobs["own"]))
    snap.rank_steps.add(**rank_step(other, jobs["forged"]))
    snap.rank_steps.add(**rank_step(own, jobs["future"], start_ns=2**62))
    snap.rank_steps.add(**rank_step(f"node-{tag}-c1", jobs["elsewhere"]))
    no_cluster = nic_snapshot(source=f"node-{tag}-c1", cluster=f"west-{tag}")
    async with running_gateway(kafka_bootstrap, cluster=f"default-{tag}", auth=auth) as listen:
        async with grpc.aio.insecure_channel(listen) as channel:
            stub = pb_grpc.IngestStub(channel)
            ack = await stub.Send(pb.IngestBatch(batch_id=1, snapshots=[snap]),
                                  metadata=(("authorization", f"Bearer {token}"),))
            ack_c = await stub.Send(pb.IngestBatch(batch_id=2, snapshots=[no_cluster]),
                                    metadata=(("authorization", f"Bearer {token}c"),))
    assert ack.accepted == 1 and dict(ack.problems_by_reason) == {
        "rank_step_not_allowed": 2, "rank_step_time_out_of_range": 1}
    assert ack_c.accepted == 1
    telemetry = {k: telemetry_snapshots(v)[0] for k, v in
                 await read_topic(kafka_bootstrap, topics.TELEMETRY, {own, f"node-{tag}-c1"}, started_s)}
    assert telemetry[own].cluster == f"east-{tag}"                    # the token's cluster
    assert telemetry[f"node-{tag}-c1"].cluster == f"default-{tag}"     # no cluster in the token: the gateway's
    steps = {k: pb.Snapshot.FromString(v) for k, v in
             await read_topic(kafka_bootstrap, topics.RANK_STEPS, set(jobs.values()), started_s)}
    assert set(steps) == {jobs["own"]} and steps[jobs["own"]].cluster == f"east-{tag}"


def test_tokens_file_cluster_is_optional_and_validated(tmp_path):
    from fabricwatch.streams.auth import AuthConfigError

    path = tmp_path / "tokens.yaml"
    TokenAuth.write(path, "rack-1", "s3cret", ["node-1*"])
    assert TokenAuth.load(path).identify("s3cret").cluster == ""       # an old file keeps working
    TokenAuth.write(path, "rack-1", "s3cret", ["node-1*"], cluster="east")
    assert TokenAuth.load(path).identify("s3cret").cluster == "east"
    path.write_text(f"collectors: [{{token_sha256: {token_digest('x')}, sources: ['*'], cluster: 'a b'}}]")
    with pytest.raises(AuthConfigError, match=r"collectors\[0\].cluster"):
        TokenAuth.load(path)


# ---------------------------------------------------------------------- per-token bounds
class GatedSink(RecordingSink):
    """Holds every write until released: batches stay in flight as long as the test wants."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def write(self, records):
        await self.gate.wait()
        await super().write(records)


async def test_one_token_is_bounded_in_batches_and_bytes_in_flight_others_are_not():
    auth = TokenAuth([Collector("rack-1", token_digest("one"), ("node-1*",)),
                      Collector("rack-2", token_digest("two"), ("node-2*",))])
    sink, port = GatedSink(), free_port()
    service = IngestService(sink, auth, limits=TokenLimits(max_concurrent_batches=2, max_bytes_in_flight=400_000,
                                                           max_wait_s=0))
    server = await start_server(service, port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.IngestStub(channel)

            def send(token, source, size=0):
                snap = big_snapshot(source, size) if size else nic_snapshot(source=source)
                return asyncio.ensure_future(stub.Send(pb.IngestBatch(snapshots=[snap]),
                                                       metadata=(("authorization", f"Bearer {token}"),)))

            first, second = send("one", "node-11"), send("one", "node-12")
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as third:          # a third batch at once
                await send("one", "node-13")
            assert third.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            other = send("two", "node-21")                              # another token is not held up
            await asyncio.sleep(0.3)
            assert not other.done()            # admitted (waiting on the gated write), not refused
            sink.gate.set()
            assert [(await f).accepted for f in (first, second, other)] == [1, 1, 1]
            sink.gate.clear()
            held = send("one", "node-14", size=300_000)
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as too_big:        # the bytes bound
                await send("one", "node-15", size=300_000)
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            sink.gate.set()
            assert (await held).accepted == 1
            resent = await send("one", "node-15", size=300_000)         # once room is back, it goes
            assert resent.accepted == 1
    finally:
        await server.stop(0)
    assert dict(service.stats.resource_exhausted) == {"batches": 1, "bytes": 1}
    assert service.budgets.in_flight("rack-1") == (0, 0)               # nothing left held
    assert sorted(s.source for s in sink.snapshots()) == ["node-11", "node-12", "node-14", "node-15", "node-21"]


async def test_a_stream_over_its_bound_is_ended_not_acked_and_its_batches_resent():
    """A refused batch must never be acked as rejected: the sender keeps it and resends it."""
    sink, port = GatedSink(), free_port()
    service = IngestService(sink, RACK, limits=TokenLimits(max_concurrent_batches=1, max_bytes_in_flight=10**9,
                                                           max_wait_s=0))
    server = await start_server(service, port)
    blocker = asyncio.ensure_future(_send_one(port, "node-0", "one"))   # holds the token's budget
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", token="one", backoff_initial_s=0.05,
                                        backoff_max_s=0.2))
    try:
        async with running(sender):
            await asyncio.sleep(0.3)
            for i in range(5):
                sender.submit(nic_snapshot(source="node-1", seq=i))
            await asyncio.sleep(1.0)
            assert sender.stats["stream_errors"] >= 1 and sender.buffered == 5     # refused, kept
            sink.gate.set()
            assert await sender.drain(10)
        await blocker
    finally:
        await server.stop(0)
    assert sorted(s.seq for s in sink.snapshots() if s.source == "node-1") == list(range(5))
    assert service.stats.resource_exhausted["batches"] >= 1


async def test_a_burst_waits_briefly_for_room_instead_of_being_refused():
    """Collectors that share a token tick in step: a short burst queues, it is not refused."""
    sink, port = GatedSink(), free_port()
    service = IngestService(sink, RACK, limits=TokenLimits(max_concurrent_batches=1, max_wait_s=5))
    server = await start_server(service, port)
    try:
        sends = [asyncio.ensure_future(_send_one(port, f"node-{i}", "one")) for i in range(4)]
        await asyncio.sleep(0.3)
        sink.gate.set()                      # room comes back within the wait
        assert [(await s).accepted for s in sends] == [1, 1, 1, 1]
    finally:
        await server.stop(0)
    assert not service.stats.resource_exhausted


async def test_a_unary_call_is_admitted_before_its_bytes_are_read():
    """Send is read only once its token has a read slot: a token's concurrent large calls queue
    instead of all sitting in memory at once (16 x 16 MiB took the gateway to 1.2 GB)."""
    auth = TokenAuth([Collector("rack-1", token_digest("one"), ("node-1*",)),
                      Collector("rack-2", token_digest("two"), ("node-2*",))])
    sink, port = RecordingSink(), free_port()
    service = IngestService(sink, auth, limits=TokenLimits(max_concurrent_reads=1, max_wait_s=0))
    server = await start_server(service, port)
    release = asyncio.Event()

    async def slow_request():
        await release.wait()                 # the call is open, its message not sent yet
        yield pb.IngestBatch(snapshots=[nic_snapshot(source="node-11")]).SerializeToString()

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw_send = channel.stream_unary("/fabricwatch.v1.Ingest/Send", request_serializer=None,
                                            response_deserializer=pb.IngestAck.FromString)
            slow = asyncio.ensure_future(raw_send(slow_request(), metadata=(("authorization", "Bearer one"),)))
            await asyncio.sleep(0.3)
            stub = pb_grpc.IngestStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Send(pb.IngestBatch(snapshots=[nic_snapshot(source="node-12")]),
                                metadata=(("authorization", "Bearer one"),))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            other = await stub.Send(pb.IngestBatch(snapshots=[nic_snapshot(source="node-21")]),
                                    metadata=(("authorization", "Bearer two"),))
            release.set()
            assert (await slow).accepted == 1 and other.accepted == 1
    finally:
        await server.stop(0)
    assert dict(service.stats.resource_exhausted) == {"reads": 1}


async def _send_one(port: int, source: str, token: str = "") -> pb.IngestAck:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await pb_grpc.IngestStub(channel).Send(pb.IngestBatch(snapshots=[nic_snapshot(source=source)]),
                                                      metadata=metadata)


def test_tokens_together_are_held_to_the_gateways_byte_budget_and_no_token_only_to_that():
    budgets = TokenBudgets(TokenLimits(max_concurrent_batches=1, max_bytes_in_flight=100, max_bytes_in_flight_total=150))
    assert budgets.try_acquire("rack-1", 100) == "" and budgets.try_acquire("rack-2", 100) == "gateway_bytes"
    assert budgets.try_acquire("rack-3", 40) == ""                      # what is left of the total
    assert [budgets.try_acquire("", 1) for _ in range(3)] == ["", "", ""]   # no token: no per-token bound
    budgets.release("rack-1", 100)
    assert budgets.try_acquire("rack-2", 100) == "" and budgets.total_bytes == 143


async def test_garbage_bytes_are_refused_before_parsing_as_invalid_argument():
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            send = channel.unary_unary("/fabricwatch.v1.Ingest/Send", request_serializer=None,
                                       response_deserializer=pb.IngestAck.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send(b"\xff\xff\xff\xff garbage")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await _send_one(port, "node-1")).accepted == 1      # and the gateway serves on
    finally:
        await server.stop(0)
