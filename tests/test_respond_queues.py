"""Issue #13: alerts never delay actions. The real responder service on the real broker, with
a Slack sink (its own rate limit: 3 at once, then one a second) posting to a local Slack
stand-in, and an executor that records when it is called.

Before: alerts were sent inside the responder's only loop, waiting on each sink's rate
limit; 60 downgrade alerts delayed an unrelated storm's drain by 118 s, and 250 anomalies
kept the loop from polling Kafka until the consumer group evicted it.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from fabricwatch.actions.alerts.slack import SlackSink
from fabricwatch.actions.base import DONE, DRAIN_NODE, ActionRequest, ExecutionResult
from fabricwatch.actions.policy import parse_policy
from fabricwatch.actions.responder import Responder
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams import topics
from fabricwatch.streams.cloudevents import anomaly_headers
from fabricwatch.streams.respond import ResponderService

pytestmark = pytest.mark.kafka
S = 10**9

POLICY = """
mode: execute
execute: [drain_node]
guards: {{breaker: {{min_count: 5}}}}
rules:
  - {{name: downgrades, match: {{kind: link_downgrade, cluster: {cluster}}}, actions: [alert]}}
  - {{name: storms, match: {{kind: pfc_storm, cluster: {cluster}}}, actions: [alert, drain_node]}}
"""


class RecordingExecutor:
    name, handles = "recorder", frozenset({DRAIN_NODE})

    def __init__(self, domain: str) -> None:
        # its own domain: the guard state restored from the shared audit topic is not another test's
        self.domain = domain
        self.calls: list[tuple[float, ActionRequest]] = []

    async def execute(self, request: ActionRequest) -> ExecutionResult:
        self.calls.append((time.monotonic(), request))
        return ExecutionResult(DONE, "recorded")


class SlackStandIn:
    """Answers like Slack's incoming webhook ("ok"), a little slowly; counts what it got."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.posts = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(self.delay_s)
        self.posts += 1
        return web.Response(text="ok")

    async def __aenter__(self) -> SlackStandIn:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/hook"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


def anomaly(cluster: str, kind: str, node: str, now_ns: int) -> ev.AnomalyEvent:
    dedup = f"{kind}:{cluster}/{node}/mlx5_0/1"
    return ev.AnomalyEvent(id=f"{dedup}|1", dedup_key=dedup, kind=kind, severity=ev.SEVERITY_CRITICAL,
                           lifecycle=ev.LIFECYCLE_OPEN, onset_unix_ns=now_ns, detected_unix_ns=now_ns,
                           emitted_unix_ns=now_ns, summary=f"{kind} on {node}",
                           entity=ev.EntityPath(cluster=cluster, node=node, device="mlx5_0", port="1"))


async def produce(bootstrap: str, events: list[ev.AnomalyEvent]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for event in events:
            await producer.send(topics.ANOMALIES, event.SerializeToString(), key=event.dedup_key.encode(),
                                headers=anomaly_headers(event))
        await producer.flush()
    finally:
        await producer.stop()


async def committed_all(bootstrap: str, group: str) -> bool:
    """Whether `group` has committed every partition of the anomalies topic up to its end."""
    consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        parts = sorted(consumer.assignment())
        end = await consumer.end_offsets(parts)
    finally:
        await consumer.stop()
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return all(offsets.get(tp) is not None and offsets[tp].offset >= end[tp] for tp in parts)


async def run_responder(bootstrap: str, cluster: str, sink: SlackSink, **service_options):
    executor = RecordingExecutor(f"test:{cluster}")
    responder = Responder(parse_policy(POLICY.format(cluster=cluster)), {DRAIN_NODE: executor.name},
                          {DRAIN_NODE: executor.domain})
    group = f"responder-{cluster}"
    service = ResponderService(bootstrap, responder, {DRAIN_NODE: executor}, [sink], group_id=group,
                               **service_options)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await service.wait_ready(60)
    return service, executor, group, stop, task


async def test_a_storm_is_drained_at_once_behind_60_rate_limited_downgrade_alerts(kafka_bootstrap):
    await topics.ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    cluster = f"q-{uuid.uuid4().hex[:6]}"
    async with SlackStandIn() as slack:
        sink = SlackSink(slack.url)
        service, executor, group, stop, task = await run_responder(kafka_bootstrap, cluster, sink)
        try:
            now = time.time_ns()
            await produce(kafka_bootstrap, [anomaly(cluster, "link_downgrade", f"node-{i}", now) for i in range(60)])
            produced = time.monotonic()
            await produce(kafka_bootstrap, [anomaly(cluster, "pfc_storm", f"{cluster}-storm", now)])
            deadline = time.monotonic() + 60
            while not executor.calls and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert executor.calls, "the storm was never drained"
            delay_s = executor.calls[0][0] - produced
            backlog = service.alerts.backlog()["slack"]
            assert delay_s < 10.0 and backlog > 30, (delay_s, backlog)     # drained while alerts still queue
            while slack.posts < 61 and time.monotonic() < deadline + 60:  # and every alert still goes out
                await asyncio.sleep(0.2)
            assert slack.posts == 61
        finally:
            stop.set()
            await task
            await sink.close()
    assert executor.calls[0][1].target.node == f"{cluster}-storm"
    print(f"storm drain {delay_s:.2f} s after it was produced, behind 60 downgrade alerts "
          f"({backlog} still queued for Slack then)")


async def test_250_anomalies_behind_a_slow_sink_keep_the_consumer_polling_and_drop_what_cannot_wait(
        kafka_bootstrap):
    await topics.ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    cluster = f"q-{uuid.uuid4().hex[:6]}"
    async with SlackStandIn(delay_s=1.0) as slack:
        sink = SlackSink(slack.url)
        service, executor, group, stop, task = await run_responder(kafka_bootstrap, cluster, sink,
                                                                   alert_backlog={"slack": 50})
        try:
            now = time.time_ns()
            await produce(kafka_bootstrap, [anomaly(cluster, "link_downgrade", f"node-{i}", now) for i in range(250)])
            deadline = time.monotonic() + 30
            while not await committed_all(kafka_bootstrap, group):
                assert time.monotonic() < deadline, "the responder stopped polling Kafka"
                await asyncio.sleep(0.5)
            handled_s = 30 - (deadline - time.monotonic())
            assert service.stats.anomalies >= 250 and slack.posts < 50          # the sink is far behind
            assert service.alerts.dropped()["slack"] >= 250 - 50 - slack.posts - 1
        finally:
            stop.set()
            await task
            await sink.close()
    audited = [d for d in service.stats.decisions]
    assert "alert_failed" in audited               # dropped alerts are audited as not sent
    print(f"250 anomalies committed within {handled_s:.1f} s with a 1 s/alert sink; "
          f"{service.alerts.dropped()['slack']} alerts dropped from its backlog of 50")
