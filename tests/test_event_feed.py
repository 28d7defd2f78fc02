"""The event feed (streams/feed.py) on the real broker: CloudEvents records in, filtered gRPC streams out.

Records are produced with plain aiokafka, with the headers of `streams.cloudevents`; the
feed server runs in-process with TLS (a self-signed certificate) and bearer tokens, and the
subscribers are real gRPC clients. Each test uses its own cluster name, so records other
tests write to the same topics never match its filters.
"""
import asyncio
import contextlib
import time
import uuid

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from helpers import nic_snapshot, telemetry_value, wait_caught_up

from fabricwatch.localtls import ensure_self_signed
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import feed_pb2 as fpb
from fabricwatch.protos.v1 import feed_pb2_grpc as fpb_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.auth import Collector, TokenAuth, new_token, token_digest
from fabricwatch.streams.cloudevents import (anomaly_headers, decision_headers, entity_key, entity_path,
                                             format_time, parse)
from fabricwatch.streams.feed import Delivery, FeedServer, Outbox, Subscription

S = 10**9


# ---------------------------------------------------------------------- helpers
def anomaly(cluster, kind="pfc_storm", severity=ev.SEVERITY_CRITICAL, node="node-0001", job="", related_job="",
            summary=""):
    entity = ev.EntityPath(cluster=cluster, job=job, rank="3") if job else ev.EntityPath(
        cluster=cluster, node=node, device="mlx5_0", port="1")
    return ev.AnomalyEvent(id=uuid.uuid4().hex[:24], kind=kind, severity=severity, lifecycle=ev.LIFECYCLE_OPEN,
                           dedup_key=f"{kind}:{entity_path(entity)}", entity=entity, detected_unix_ns=time.time_ns(),
                           emitted_unix_ns=time.time_ns(), summary=summary,
                           related=[ev.EntityPath(cluster=cluster, job=related_job)] if related_job else [])


def decision(cluster, job="", anomaly_kind="straggler"):
    return ev.ActionDecision(idempotency_key=uuid.uuid4().hex, anomaly_kind=anomaly_kind, rule="requeue",
                             action="requeue_jobs", outcome=ev.OUTCOME_SHADOW, shadow=True,
                             decided_unix_ns=time.time_ns(),
                             target=ev.EntityPath(cluster=cluster, node="node-0002", job=job))


@contextlib.asynccontextmanager
async def producer(bootstrap):
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def send_anomaly(p, event, headers=True):
    await p.send_and_wait(topics.ANOMALIES, key=event.dedup_key.encode(), value=event.SerializeToString(),
                          headers=anomaly_headers(event) if headers else None)


async def send_decision(p, d, topic_kind):
    topic = topics.ACTIONS if topic_kind == "action" else topics.AUDIT
    await p.send_and_wait(topic, key=entity_key(entity_path(d.target)), value=d.SerializeToString(),
                          headers=decision_headers(d, topic_kind))


@pytest.fixture
def credentials(tmp_path):
    cert, key = ensure_self_signed(tmp_path / "tls")
    token = new_token()
    auth = TokenAuth([Collector("feed-reader", token_digest(token), ("*",))])
    return cert, key, token, auth


@contextlib.asynccontextmanager
async def feed_server(bootstrap, credentials, **options):
    cert, key, _, auth = credentials
    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    async with FeedServer(bootstrap, "127.0.0.1:0", tls=(str(cert), str(key)), auth=auth, **options) as feed:
        yield feed


@contextlib.asynccontextmanager
async def channel(feed, credentials, **options):
    cert = credentials[0]
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{feed.port}", creds, options=list(options.items())) as ch:
        yield fpb_grpc.EventFeedStub(ch)


class Reader:
    """Reads one subscription in the background into `events`."""

    def __init__(self, stub, request, token):
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.call = stub.Subscribe(request, metadata=metadata)
        self.events: list[fpb.FeedEvent] = []
        self.task = None

    def start(self):
        self.task = asyncio.create_task(self._read())
        return self

    async def _read(self):
        async for event in self.call:
            self.events.append(event)

    async def until(self, n, timeout_s=30.0, settle_s=1.5):
        """Wait for `n` events, then `settle_s` more so that extra ones would show."""
        deadline = time.monotonic() + timeout_s
        while len(self.events) < n and time.monotonic() < deadline:
            assert not self.task.done() or self.task.exception() is None, self.task.exception()
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle_s)
        return self.events

    def close(self):
        self.call.cancel()


async def subscribed(feed, n, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while feed.stats.subscriptions < n:
        assert time.monotonic() < deadline, f"{feed.stats.subscriptions} of {n} subscriptions registered"
        await asyncio.sleep(0.02)


def received(events):
    return sorted((e.ce_type, e.ce_id) for e in events)


def expected(*pairs):
    return sorted(pairs)


def anomaly_type(event):
    lifecycle = ev.Lifecycle.Name(event.lifecycle).removeprefix("LIFECYCLE_").lower()
    return f"io.fabricwatch.anomaly.v1.{event.kind}.{lifecycle}"


# ---------------------------------------------------------------------- without Kafka
def test_outbox_drops_the_oldest_and_counts():
    box = Outbox(2)
    items = [Delivery("t", 0, i, None) for i in range(5)]
    assert [box.offer(item) for item in items] == [True, True, False, False, False]
    assert box.dropped == 3 and len(box) == 2

    async def drain():
        return [(await box.get()).offset for _ in range(2)]

    assert asyncio.run(drain()) == [3, 4]


def test_subscription_filters():
    from fabricwatch.streams.cloudevents import FeedEvent

    def wrap(message, topic_kind="anomaly"):
        return FeedEvent({"type": f"io.fabricwatch.{topic_kind}.v1.x"}, message)

    sub = Subscription(kinds=frozenset({"pfc_storm"}), min_severity=ev.SEVERITY_WARNING, cluster="c1", job="j1",
                       include_audit=True)
    assert sub.matches(wrap(anomaly("c1", severity=ev.SEVERITY_WARNING, related_job="j1")))
    assert not sub.matches(wrap(anomaly("c1", severity=ev.SEVERITY_INFO, related_job="j1")))
    assert not sub.matches(wrap(anomaly("c2", related_job="j1")))
    assert not sub.matches(wrap(anomaly("c1", kind="straggler", job="j1")))
    assert not sub.matches(wrap(anomaly("c1")))                              # no job
    assert sub.matches(wrap(decision("c1", job="j1", anomaly_kind="pfc_storm"), "audit"))
    assert not sub.matches(wrap(decision("c1", job="j1", anomaly_kind="pfc_storm"), "action"))
    assert sub.topics() == [topics.ANOMALIES, topics.AUDIT]


def test_a_tokens_source_globs_scope_what_it_reads():
    from fabricwatch.streams.cloudevents import FeedEvent

    rack = Subscription(include_actions=True, scope=("node-00*",))
    assert rack.matches(FeedEvent({}, anomaly("c1", node="node-0001")))
    assert not rack.matches(FeedEvent({}, anomaly("c1", node="node-0101")))
    switch_storm = anomaly("c1")
    switch_storm.entity.CopyFrom(ev.EntityPath(cluster="c1", switch="leaf-1", port="Ethernet4"))
    assert not rack.matches(FeedEvent({}, switch_storm))
    assert Subscription(scope=("leaf-*",)).matches(FeedEvent({}, switch_storm))
    assert not rack.matches(FeedEvent({}, anomaly("c1", job="j1")))        # no node named: only "*" sees it
    assert Subscription().matches(FeedEvent({}, anomaly("c1", job="j1")))
    assert rack.matches(FeedEvent({"type": "io.fabricwatch.action.v1.x"}, decision("c1")))   # target node-0002


def test_records_are_parsed_by_topic_and_bad_ones_are_counted_and_skipped():
    from types import SimpleNamespace

    from fabricwatch.streams.feed import FeedStats, _delivery

    def record(value, headers=(), offset=0):
        return SimpleNamespace(key=b"k", value=value, headers=tuple(headers), offset=offset)

    a, d = anomaly("c1"), decision("c1")
    stats = FeedStats()
    good = _delivery(stats, topics.ANOMALIES, 2, record(a.SerializeToString(), anomaly_headers(a), offset=7))
    assert (good.topic, good.partition, good.offset, good.event.message) == (topics.ANOMALIES, 2, 7, a)
    legacy = _delivery(stats, topics.AUDIT, 0, record(d.SerializeToString()))     # an older writer: no headers
    assert legacy.event.type == "io.fabricwatch.audit.v1.shadow" and legacy.event.message == d
    assert _delivery(stats, topics.ANOMALIES, 0, record(b"\xff\xff", [("ce_specversion", b"1.0")])) is None
    assert _delivery(stats, topics.ANOMALIES, 0, record(b"\xff\xff")) is None            # headerless junk
    assert _delivery(stats, topics.ACTIONS, 0,                                         # an audit event on actions
                     record(d.SerializeToString(), decision_headers(d, "audit"))) is None
    assert (stats.malformed_records, stats.headerless_records) == (3, 1)


def test_bad_requests_and_open_listeners_are_refused():
    with pytest.raises(ValueError, match="min_severity 9"):
        Subscription.from_request(fpb.SubscribeRequest(min_severity=9), max_replay_s=60)
    with pytest.raises(ValueError, match="over this server's limit of 60"):
        Subscription.from_request(fpb.SubscribeRequest(replay_seconds=61), max_replay_s=60)
    with pytest.raises(ValueError, match="empty string"):
        Subscription.from_request(fpb.SubscribeRequest(kinds=[""]), max_replay_s=60)
    with pytest.raises(ValueError, match="without TLS"):
        FeedServer("127.0.0.1:9092", "0.0.0.0:50071")
    with pytest.raises(ValueError, match="without tokens"):
        FeedServer("127.0.0.1:9092", "10.0.0.1:50071", tls=("cert.pem", "key.pem"))


# ---------------------------------------------------------------------- on the broker
@pytest.mark.kafka
async def test_two_subscribers_receive_exactly_what_matches(kafka_bootstrap, credentials):
    cluster, other = f"feed-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    token = credentials[2]
    async with feed_server(kafka_bootstrap, credentials) as feed, channel(feed, credentials) as stub:
        storms = Reader(stub, fpb.SubscribeRequest(kinds=["pfc_storm"], min_severity=ev.SEVERITY_WARNING,
                                                   cluster=cluster), token).start()
        job = Reader(stub, fpb.SubscribeRequest(cluster=cluster, job="j1", include_actions=True,
                                                include_audit=True), token).start()
        await subscribed(feed, 2)
        a1 = anomaly(cluster)                                                # storms
        a2 = anomaly(cluster, severity=ev.SEVERITY_INFO)                     # neither: below warning, no job
        a3 = anomaly(cluster, kind="link_downgrade", severity=ev.SEVERITY_WARNING)   # neither
        a4 = anomaly(cluster, kind="straggler", severity=ev.SEVERITY_WARNING, job="j1")  # job
        a5 = anomaly(cluster, severity=ev.SEVERITY_WARNING, related_job="j1")          # both: a victim job
        a6 = anomaly(other)                                                  # neither: other cluster
        a7 = anomaly(cluster, kind="straggler", job="j2")                    # neither: other job
        legacy = anomaly(cluster, summary="written without headers")        # storms, attributes derived
        d1, d2 = decision(cluster, job="j1"), decision(cluster)
        async with producer(kafka_bootstrap) as p:
            for event in (a1, a2, a3, a4, a5, a6, a7):
                await send_anomaly(p, event)
            await send_anomaly(p, legacy, headers=False)
            for d in (d1, d2):
                await send_decision(p, d, "action")
                await send_decision(p, d, "audit")
        d1_id = f"{d1.idempotency_key}:shadow:{d1.decided_unix_ns}"
        want_storms = expected((anomaly_type(a1), a1.id), (anomaly_type(a5), a5.id), (anomaly_type(legacy), legacy.id))
        want_job = expected((anomaly_type(a4), a4.id), (anomaly_type(a5), a5.id),
                            ("io.fabricwatch.action.v1.shadow", d1_id), ("io.fabricwatch.audit.v1.shadow", d1_id))
        assert received(await storms.until(len(want_storms))) == want_storms
        assert received(await job.until(len(want_job), settle_s=0)) == want_job
        by_id = {e.ce_id: e for e in storms.events}
        assert by_id[a1.id].anomaly == a1 and by_id[a1.id].WhichOneof("payload") == "anomaly"
        assert by_id[a1.id].ce_subject == f"{cluster}/node-0001/mlx5_0/1"
        assert by_id[a1.id].ce_source == f"fabricwatch/{cluster}/worker"
        assert by_id[a1.id].time_unix_ns == a1.detected_unix_ns
        assert by_id[legacy.id].anomaly.summary == "written without headers"
        decisions = [e for e in job.events if e.WhichOneof("payload") == "decision"]
        assert [e.decision for e in decisions] == [d1, d1]
        assert {e.ce_source for e in decisions} == {f"fabricwatch/{cluster}/actions", f"fabricwatch/{cluster}/audit"}
        assert all(e.dropped == 0 for e in storms.events + job.events)
        assert feed.stats.headerless_records >= 1
        storms.close()
        job.close()


@pytest.mark.kafka
async def test_a_scoped_token_reads_only_its_own_nodes_events(kafka_bootstrap, credentials):
    cert, key, everything, _ = credentials
    rack_token = new_token()
    auth = TokenAuth([Collector("platform", token_digest(everything), ("*",)),
                      Collector("rack-1", token_digest(rack_token), ("node-0001",))])
    cluster = f"scope-{uuid.uuid4().hex[:8]}"
    async with feed_server(kafka_bootstrap, (cert, key, everything, auth)) as feed, \
            channel(feed, credentials) as stub:
        platform = Reader(stub, fpb.SubscribeRequest(cluster=cluster), everything).start()
        rack = Reader(stub, fpb.SubscribeRequest(cluster=cluster), rack_token).start()
        await subscribed(feed, 2)
        own, other = anomaly(cluster, node="node-0001"), anomaly(cluster, node="node-0002")
        async with producer(kafka_bootstrap) as p:
            for event in (own, other):
                await send_anomaly(p, event)
        assert received(await platform.until(2)) == expected((anomaly_type(own), own.id),
                                                             (anomaly_type(other), other.id))
        assert received(await rack.until(1, settle_s=0)) == expected((anomaly_type(own), own.id))
        platform.close()
        rack.close()


@pytest.mark.kafka
async def test_subscribers_without_a_valid_token_or_with_bad_filters_are_refused(kafka_bootstrap, credentials):
    async with feed_server(kafka_bootstrap, credentials, max_replay_s=60) as feed, \
            channel(feed, credentials) as stub:
        for token in ("", "not-the-token"):
            reader = Reader(stub, fpb.SubscribeRequest(), token)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await reader.call.read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reader = Reader(stub, fpb.SubscribeRequest(replay_seconds=3600), credentials[2])
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await reader.call.read()
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit of 60" in invalid.value.details()
        assert feed.stats.refused_unauthenticated == 2 and feed.stats.refused_invalid == 1
        assert feed.stats.subscriptions == 0


@pytest.mark.kafka
async def test_a_slow_subscriber_loses_its_oldest_events_and_the_other_one_does_not(kafka_bootstrap, credentials):
    cluster = f"slow-{uuid.uuid4().hex[:8]}"
    token = credentials[2]
    rounds, per_round, queue = 30, 40, 200
    padding = "x" * 2000   # big events: the slow client's HTTP/2 window holds only a few dozen
    async with feed_server(kafka_bootstrap, credentials, queue_events=queue) as feed, \
            channel(feed, credentials) as fast_stub, \
            channel(feed, credentials, **{"grpc.http2.bdp_probe": 0}) as slow_stub:
        request = fpb.SubscribeRequest(cluster=cluster)
        fast = Reader(fast_stub, request, token).start()
        slow = Reader(slow_stub, request, token)          # subscribed, but nobody reads it yet
        await subscribed(feed, 2)
        async with producer(kafka_bootstrap) as p:
            for _ in range(rounds):
                for _ in range(per_round):
                    event = anomaly(cluster, node=f"node-{uuid.uuid4().hex[:4]}", summary=padding)
                    await p.send(topics.ANOMALIES, key=event.dedup_key.encode(), value=event.SerializeToString(),
                                 headers=anomaly_headers(event))
                await p.flush()
                await asyncio.sleep(0.2)        # the fast reader keeps up between bursts
        total = rounds * per_round
        await fast.until(total, timeout_s=60, settle_s=0)
        assert len(fast.events) == total and fast.events[-1].dropped == 0
        slow.start()
        slow_events = await slow.until(total, timeout_s=10, settle_s=2)
        dropped = slow_events[-1].dropped
        assert dropped > 0
        assert len(slow_events) + dropped == total          # every event is either delivered or counted
        assert len({e.ce_id for e in slow_events}) == len(slow_events)
        # The oldest went: what the slow reader got last is what everyone got last.
        assert slow_events[-1].ce_id == fast.events[-1].ce_id
        assert feed.stats.dropped_events >= dropped
        fast.close()
        slow.close()


@pytest.mark.kafka
async def test_a_replay_window_joins_the_live_stream_without_gaps_or_repeats(kafka_bootstrap, credentials):
    cluster = f"replay-{uuid.uuid4().hex[:8]}"
    token = credentials[2]
    async with feed_server(kafka_bootstrap, credentials) as feed, channel(feed, credentials) as stub:
        async with producer(kafka_bootstrap) as p:
            before = [anomaly(cluster, node=f"node-{i:04d}") for i in range(5)]
            for event in before:
                await send_anomaly(p, event)
            d = decision(cluster)
            await send_decision(p, d, "audit")
            live_only = Reader(stub, fpb.SubscribeRequest(cluster=cluster), token).start()
            replaying = Reader(stub, fpb.SubscribeRequest(cluster=cluster, replay_seconds=600, include_audit=True),
                               token).start()
            await subscribed(feed, 2)
            after = [anomaly(cluster, node=f"node-{i:04d}") for i in range(5, 8)]
            for event in after:
                await send_anomaly(p, event)
        want = expected(*((anomaly_type(e), e.id) for e in before + after),
                        ("io.fabricwatch.audit.v1.shadow", f"{d.idempotency_key}:shadow:{d.decided_unix_ns}"))
        assert received(await replaying.until(len(want))) == want
        assert received(await live_only.until(len(after), settle_s=0)) == expected(
            *((anomaly_type(e), e.id) for e in after))
        live_only.close()
        replaying.close()


@pytest.mark.kafka
async def test_the_worker_writes_cloudevents_headers_that_the_feed_serves(kafka_bootstrap, credentials, tmp_path):
    """Telemetry -> real worker process (agents + handlers) -> anomalies topic: headers as plain aiokafka sees
    them, and the same anomalies through the feed."""
    from test_pipeline_kafka import start_worker

    cluster, node = f"ce-{uuid.uuid4().hex[:8]}", f"node-{uuid.uuid4().hex[:6]}"
    await topics.ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    # Plain aiokafka, no group: every partition, from its end.
    reader = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=kafka_bootstrap, group_id=None,
                              auto_offset_reset="latest")
    await reader.start()
    for tp in reader.assignment():
        await reader.position(tp)
    group = f"fw-ce-{uuid.uuid4().hex[:8]}"
    worker = start_worker(kafka_bootstrap, tmp_path, group)
    try:
        # a fresh group reads the session broker's whole history first: drained before the 90 s below
        await wait_caught_up(kafka_bootstrap, group, [], 600)
        async with feed_server(kafka_bootstrap, credentials) as feed, channel(feed, credentials) as stub:
            subscriber = Reader(stub, fpb.SubscribeRequest(kinds=["link_downgrade"], cluster=cluster),
                                credentials[2]).start()
            await subscribed(feed, 1)
            t0 = time.time_ns()
            async with producer(kafka_bootstrap) as p:
                for i in range(6):
                    rates = {5: "200 Gb/sec (4X HDR)"} if 2 <= i <= 3 else {}
                    snap = nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, rates=rates, cluster=cluster)
                    await p.send_and_wait(topics.TELEMETRY, key=node.encode(), value=telemetry_value(snap))
            records, ids = [], set()
            deadline = time.monotonic() + 90
            while len(records) < 2 and time.monotonic() < deadline:
                for batch in (await reader.getmany(timeout_ms=500)).values():
                    for r in batch:
                        # At least once: a redelivered anomaly is the same CloudEvent (same ce_id), skipped.
                        ce_id = dict(r.headers).get("ce_id")
                        if ev.AnomalyEvent.FromString(r.value).entity.node == node and ce_id not in ids:
                            ids.add(ce_id)
                            records.append(r)
            assert len(records) == 2, "the worker did not emit the open and resolved link_downgrade in 90 s"
            path = f"{cluster}/{node}/mlx5_5/1"
            for record, lifecycle in zip(records, ("open", "resolved")):
                event = ev.AnomalyEvent.FromString(record.value)
                headers = dict(record.headers)
                assert headers == {
                    "ce_specversion": b"1.0", "ce_id": event.id.encode(),
                    "ce_source": f"fabricwatch/{cluster}/worker".encode(),
                    "ce_type": f"io.fabricwatch.anomaly.v1.link_downgrade.{lifecycle}".encode(),
                    "ce_time": format_time(event.detected_unix_ns).encode(),
                    "ce_subject": path.encode(), "ce_partitionkey": path.encode(),
                    "content-type": b"application/protobuf",
                }
                assert record.key == event.dedup_key.encode()
                assert parse(record.headers, record.key, record.value).message == event
            served = list({e.ce_id: e for e in await subscriber.until(2, settle_s=0.5)}.values())
            assert [(e.ce_id, e.anomaly.lifecycle) for e in served] == [
                (dict(records[0].headers)["ce_id"].decode(), ev.LIFECYCLE_OPEN),
                (dict(records[1].headers)["ce_id"].decode(), ev.LIFECYCLE_RESOLVED)]
            subscriber.close()
    finally:
        await reader.stop()
        worker.terminate()
        worker.wait(30)


# ---------------------------------------------------------------------- #13: scoped by cluster, a fair share
def test_a_tokens_cluster_scopes_what_it_reads_whatever_the_source_names():
    from fabricwatch.streams.cloudevents import FeedEvent

    rack = Subscription(include_actions=True, scope=("node-00*",), cluster_scope="east")
    assert rack.matches(FeedEvent({}, anomaly("east", node="node-0001")))
    assert not rack.matches(FeedEvent({}, anomaly("west", node="node-0001")))      # same name, other cluster
    assert not rack.matches(FeedEvent({"type": "io.fabricwatch.action.v1.x"}, decision("west")))
    assert Subscription(scope=("*",), cluster_scope="east").matches(FeedEvent({}, anomaly("east", job="j1")))
    assert not Subscription(scope=("*",), cluster_scope="east").matches(FeedEvent({}, anomaly("west", job="j1")))


@pytest.mark.kafka
async def test_a_token_reads_only_its_cluster_and_holds_only_its_share_of_subscriptions(kafka_bootstrap, credentials):
    """#13: the feed's token scope ignored the cluster; and one token could hold every slot."""
    cert, key, everything, _ = credentials
    tag = uuid.uuid4().hex[:8]
    east, west = f"east-{tag}", f"west-{tag}"
    rack_token, greedy = new_token(), new_token()
    auth = TokenAuth([Collector("platform", token_digest(everything), ("*",)),
                      Collector("rack-1", token_digest(rack_token), ("node-0001",), cluster=east),
                      Collector("greedy", token_digest(greedy), ("*",))])
    async with feed_server(kafka_bootstrap, (cert, key, everything, auth), max_subscriptions_per_token=2) as feed, \
            channel(feed, credentials) as stub:
        rack = Reader(stub, fpb.SubscribeRequest(), rack_token).start()      # no cluster filter asked for
        hogs = [Reader(stub, fpb.SubscribeRequest(cluster=west), greedy).start() for _ in range(2)]
        await subscribed(feed, 3)
        third = Reader(stub, fpb.SubscribeRequest(cluster=west), greedy)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in third.call:
                pass
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share of 2" in refused.value.details()
        platform = Reader(stub, fpb.SubscribeRequest(cluster=east), everything).start()   # others still get in
        await subscribed(feed, 4)
        own, same_name_elsewhere = anomaly(east, node="node-0001"), anomaly(west, node="node-0001")
        async with producer(kafka_bootstrap) as p:
            for event in (own, same_name_elsewhere):
                await send_anomaly(p, event)
        assert received(await rack.until(1)) == expected((anomaly_type(own), own.id))
        assert received(await platform.until(1, settle_s=0)) == expected((anomaly_type(own), own.id))
        assert received(await hogs[0].until(1, settle_s=0)) == expected(
            (anomaly_type(same_name_elsewhere), same_name_elsewhere.id))
        for reader in (rack, platform, *hogs):
            reader.close()
    assert feed.stats.refused_over_share == 1
