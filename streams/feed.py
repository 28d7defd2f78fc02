"""The event feed: other platform services subscribe over gRPC to anomalies and decisions.

``EventFeed.Subscribe(SubscribeRequest) returns (stream FeedEvent)`` (``protos/v1/feed.proto``).
One aiokafka consumer, with no consumer group, is assigned every partition of the anomalies,
actions and audit topics and starts at their end. Each record is parsed once as a CloudEvent
(`streams.cloudevents`) and offered to every subscription whose filter matches, through a
bounded queue per subscription: a subscriber that reads too slowly loses its *oldest*
events, counted in ``FeedEvent.dropped``, and never holds up Kafka or the other subscribers.

A subscription may first replay the last ``replay_seconds`` (capped by the server) with a
consumer of its own, read up to the end offsets taken when it subscribed; live events
from those offsets on follow, so nothing is delivered twice or skipped in between.

Security is the gateway's: TLS with ``tls=(cert, key)``, bearer tokens checked by
`streams.auth.TokenAuth` (the same tokens file), and a server that is not on loopback
refuses to start without both. A token scopes what it reads by source and by cluster: an
event is shown only when its entity's node or switch (an action's target's) matches one of
the token's ``sources`` globs, and its cluster is the token's ``cluster:`` (else the
feed's ``cluster``; neither: any), so a rack's collector token cannot watch the rest of
the fleet, nor the same names in another cluster; a platform service that needs
everything gets a token with ``["*"]`` and no cluster. Each token holds at most
``max_subscriptions_per_token`` subscriptions (RESOURCE_EXHAUSTED beyond, counted), so one
token cannot take the feed's ``max_subscriptions`` from everyone else::

    async with FeedServer("127.0.0.1:9092", "127.0.0.1:50071") as feed:
        await stop.wait()
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import functools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from fabricwatch.lograte import RateLimitedLogger, install_reconnect_log_limits
from fabricwatch.models.event_filter import EventFilter
from fabricwatch.netaddr import is_loopback, split_host_port
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import feed_pb2 as fpb
from fabricwatch.protos.v1 import feed_pb2_grpc as fpb_grpc

from . import topics
from .admission import MAX_SUBSCRIPTIONS_PER_TOKEN
from .auth import TokenAuth
from .cloudevents import CloudEventError, FeedEvent, anomaly_headers, decision_headers, parse
from .events import SEVERITY_NAME, anomaly_facts, decision_facts
from .gateway import server_credentials

log = logging.getLogger("fabricwatch.feed")
_limited_log = RateLimitedLogger(log)     # broker outages repeat at the retry pace

DEFAULT_LISTEN = "127.0.0.1:50071"
#: Which kind of event each topic of the feed carries.
FEED_TOPICS: dict[str, str] = {topics.ANOMALIES: "anomaly", topics.ACTIONS: "action", topics.AUDIT: "audit"}
FETCH_TIMEOUT_MS = 500
FETCH_BATCH_RECORDS = 200      # fan out this many, then let the subscribers' streams run
REPLAY_BATCH_RECORDS = 500
KAFKA_RETRY_S = 1.0


# ---------------------------------------------------------------------- what a subscriber wants
@dataclass(frozen=True)
class Subscription:
    """A validated `SubscribeRequest`: the server-side filter of one subscriber."""

    kinds: frozenset[str] = frozenset()
    min_severity: int = ev.SEVERITY_UNSPECIFIED
    cluster: str = ""
    job: str = ""
    include_actions: bool = False
    include_audit: bool = False
    replay_seconds: int = 0
    scope: tuple[str, ...] = ("*",)    # the token's source globs (`streams.auth.Collector.sources`)
    cluster_scope: str = ""            # the token's cluster (or the feed's); "": any
    min_impact_gpu_hours_per_hour: float = 0.0

    @classmethod
    def from_request(cls, request: fpb.SubscribeRequest, max_replay_s: int) -> Subscription:
        """:raises ValueError: with what is wrong, for an INVALID_ARGUMENT answer."""
        if any(not kind for kind in request.kinds):
            raise ValueError("kinds must not contain an empty string")
        if request.min_severity not in ev.Severity.values():
            raise ValueError(f"min_severity {request.min_severity} is not a Severity")
        if request.replay_seconds > max_replay_s:
            raise ValueError(f"replay_seconds {request.replay_seconds} is over this server's limit of {max_replay_s}")
        if not (math.isfinite(request.min_impact_gpu_hours_per_hour) and request.min_impact_gpu_hours_per_hour >= 0):
            raise ValueError(f"min_impact_gpu_hours_per_hour must be a number >= 0, got "
                             f"{request.min_impact_gpu_hours_per_hour}")
        return cls(frozenset(request.kinds), request.min_severity, request.cluster, request.job,
                   request.include_actions, request.include_audit, request.replay_seconds,
                   min_impact_gpu_hours_per_hour=request.min_impact_gpu_hours_per_hour)

    def topics(self) -> list[str]:
        wanted = {"anomaly": True, "action": self.include_actions, "audit": self.include_audit}
        return [topic for topic, kind in FEED_TOPICS.items() if wanted[kind]]

    @functools.cached_property
    def event_filter(self) -> EventFilter:
        """This subscription as the shared filter."""
        return EventFilter(kinds=self.kinds, min_severity=SEVERITY_NAME.get(self.min_severity, ""),
                           clusters=frozenset({self.cluster} - {""}), job=self.job,
                           min_impact_gpu_hours_per_hour=self.min_impact_gpu_hours_per_hour)

    @functools.cached_property
    def _resolution_filter(self) -> EventFilter:
        # A resolution passes any GPU-hour rate: the subscriber saw the anomaly open.
        return dataclasses.replace(self.event_filter, min_impact_gpu_hours_per_hour=0.0)

    def matches(self, event: FeedEvent) -> bool:
        message = event.message
        if isinstance(message, ev.AnomalyEvent):
            core = self._resolution_filter if message.lifecycle == ev.LIFECYCLE_RESOLVED else self.event_filter
            return core.admits(anomaly_facts(message)) and self._scope_ok(message.entity)
        wanted = self.include_actions if event.topic_kind == "action" else self.include_audit
        return wanted and self.event_filter.admits(decision_facts(message)) and self._scope_ok(message.target)

    def _scope_ok(self, entity: ev.EntityPath) -> bool:
        if self.cluster_scope and entity.cluster != self.cluster_scope:
            return False
        if "*" in self.scope:
            return True
        name = entity.node or entity.switch
        return bool(name) and any(fnmatch.fnmatchcase(name, glob) for glob in self.scope)



@dataclass(frozen=True)
class Delivery:
    """A parsed event with where it was read, so a replay and the live stream can be joined."""

    topic: str
    partition: int
    offset: int
    event: FeedEvent


class Outbox:
    """A bounded queue that drops its oldest item when full, so the producer never waits."""

    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._items: collections.deque[Delivery] = collections.deque(maxlen=max_events)
        self._ready = asyncio.Event()
        self.dropped = 0

    def offer(self, item: Delivery) -> bool:
        """Queue `item`; False when that pushed the oldest one out."""
        full = len(self._items) == self._items.maxlen
        if full:
            self.dropped += 1
        self._items.append(item)
        self._ready.set()
        return not full

    async def get(self) -> Delivery:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class FeedStats:
    records: int = 0                 # read from Kafka
    malformed_records: int = 0       # not a usable CloudEvent: counted, logged, skipped
    headerless_records: int = 0      # written before CloudEvents headers: attributes derived from the value
    dropped_events: int = 0          # all subscribers together
    subscriptions: int = 0           # open now
    refused_unauthenticated: int = 0
    refused_invalid: int = 0
    refused_over_share: int = 0      # a token past max_subscriptions_per_token, or the feed full


def to_proto(event: FeedEvent, dropped: int) -> fpb.FeedEvent:
    out = fpb.FeedEvent(ce_id=event.id, ce_type=event.type, ce_source=event.source, ce_subject=event.subject,
                        time_unix_ns=event.time_unix_ns, dropped=dropped)
    if isinstance(event.message, ev.AnomalyEvent):
        out.anomaly.CopyFrom(event.message)
    else:
        out.decision.CopyFrom(event.message)
    return out


def parse_record(topic: str, headers, key: bytes | None, value: bytes | None) -> tuple[FeedEvent, bool]:
    """(event, whether its headers had to be derived) for a record of one of the feed topics.

    :raises CloudEventError: not a usable event, or an event of another kind than its topic carries.
    """
    kind = FEED_TOPICS[topic]
    derived = not any(name == "ce_specversion" or name.lower() == "content-type" for name, _ in headers or ())
    if derived:
        # Written by a worker from before the CloudEvents headers: the value alone says it all.
        if value is None:
            raise CloudEventError(f"{topic}: a record with neither headers nor value")
        headers = _derive_headers(kind, value)
    event = parse(headers, key, value)
    if event.topic_kind != kind:
        raise CloudEventError(f"{topic}: event {event.id} of type {event.type} does not belong on this topic")
    return event, derived


def _derive_headers(kind: str, value: bytes) -> list[tuple[str, bytes]]:
    from google.protobuf.message import DecodeError

    try:
        if kind == "anomaly":
            return anomaly_headers(ev.AnomalyEvent.FromString(value))
        return decision_headers(ev.ActionDecision.FromString(value), kind)
    except DecodeError as exc:
        raise CloudEventError(f"a record without CloudEvents headers whose value is no {kind} protobuf: "
                              f"{exc}") from None


# ---------------------------------------------------------------------- Kafka -> subscribers
@dataclass(eq=False)
class _Subscriber:
    subscription: Subscription
    outbox: Outbox
    token: str = ""                                        # the caller's token name ("" without auth)
    live_from: dict[tuple[str, int], int] | None = None   # after a replay: first live offset per partition


class FeedHub:
    """One consumer over the feed topics, fanning each matching record out to the subscribers."""

    def __init__(self, bootstrap: str, stats: FeedStats) -> None:
        self.bootstrap = bootstrap
        self.stats = stats
        self._subscribers: set[_Subscriber] = set()
        self._consumer = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        # Without a group, aiokafka assigns every partition of these topics (also ones added
        # later) and "latest" starts each at its end.
        self._consumer = AIOKafkaConsumer(*FEED_TOPICS, bootstrap_servers=self.bootstrap, group_id=None,
                                          enable_auto_commit=False, auto_offset_reset="latest",
                                          client_id="fabricwatch-feed")
        await self._consumer.start()
        try:
            for tp in self._consumer.assignment():      # resolve "end" now: a record written after start() is seen
                await self._consumer.position(tp)
        except BaseException:
            await self._consumer.stop()
            raise
        self._task = asyncio.create_task(self._run(), name="feed-consumer")
        self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._consumer is not None:
            await self._consumer.stop()

    def add(self, subscription: Subscription, outbox: Outbox, token: str = "") -> _Subscriber:
        subscriber = _Subscriber(subscription, outbox, token)
        self._subscribers.add(subscriber)
        self.stats.subscriptions = len(self._subscribers)
        return subscriber

    def held_by(self, token: str) -> int:
        return sum(s.token == token for s in self._subscribers)

    def remove(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        self.stats.subscriptions = len(self._subscribers)

    async def _run(self) -> None:
        from aiokafka.errors import KafkaError

        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=FETCH_BATCH_RECORDS)
            except KafkaError as exc:   # the broker is away: aiokafka reconnects, we keep asking
                _limited_log.warning("feed consumer: %s; retrying in %.0f s", exc, KAFKA_RETRY_S)
                await asyncio.sleep(KAFKA_RETRY_S)
                continue
            for tp, records in batches.items():
                for record in records:
                    self._fan_out(tp.topic, tp.partition, record)
            await asyncio.sleep(0)   # getmany returns prefetched records without yielding to the loop

    def _fan_out(self, topic: str, partition: int, record) -> None:
        self.stats.records += 1
        if not self._subscribers:
            return   # nobody to parse it for
        delivery = _delivery(self.stats, topic, partition, record)
        if delivery is None:
            return
        for subscriber in self._subscribers:
            if subscriber.subscription.matches(delivery.event) and not subscriber.outbox.offer(delivery):
                self.stats.dropped_events += 1

    async def replay(self, subscriber: _Subscriber) -> AsyncIterator[Delivery]:
        """The matching records of the subscriber's replay window, up to the end offsets of now.

        Sets ``subscriber.live_from`` to those end offsets; the subscriber must already be
        added, so that live records from there on are in its outbox.
        """
        from aiokafka import AIOKafkaConsumer

        subscription = subscriber.subscription
        consumer = AIOKafkaConsumer(*subscription.topics(), bootstrap_servers=self.bootstrap, group_id=None,
                                    enable_auto_commit=False, client_id="fabricwatch-feed-replay")
        await consumer.start()
        try:
            partitions = sorted(consumer.assignment())
            end = await consumer.end_offsets(partitions)
            subscriber.live_from = {(tp.topic, tp.partition): offset for tp, offset in end.items()}
            since_ms = int(time.time() * 1000) - subscription.replay_seconds * 1000
            start = await consumer.offsets_for_times({tp: since_ms for tp in partitions})
            pending = {tp for tp in partitions if start[tp] is not None and start[tp].offset < end[tp]}
            consumer.pause(*(set(partitions) - pending))
            for tp in pending:
                consumer.seek(tp, start[tp].offset)
            while pending:
                batches = await consumer.getmany(*pending, timeout_ms=FETCH_TIMEOUT_MS,
                                                 max_records=REPLAY_BATCH_RECORDS)
                for tp, records in batches.items():
                    for record in records:
                        if record.offset >= end[tp]:
                            break
                        delivery = _delivery(self.stats, tp.topic, tp.partition, record)
                        if delivery is not None and subscription.matches(delivery.event):
                            yield delivery
                for tp in list(pending):
                    if await consumer.position(tp) >= end[tp]:
                        pending.discard(tp)
                        consumer.pause(tp)
        finally:
            await consumer.stop()


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the feed consumer stopped; subscribers get no more events", exc_info=task.exception())


def _delivery(stats: FeedStats, topic: str, partition: int, record) -> Delivery | None:
    try:
        event, derived = parse_record(topic, record.headers, record.key, record.value)
    except CloudEventError as exc:
        stats.malformed_records += 1
        log.warning("skipping %s[%d]@%d: %s", topic, partition, record.offset, exc)
        return None
    stats.headerless_records += derived
    return Delivery(topic, partition, record.offset, event)


# ---------------------------------------------------------------------- gRPC
@dataclass(frozen=True)
class _Reader:
    """Who subscribes: the token's name and what it may read."""

    token: str
    sources: tuple[str, ...]
    cluster: str


class EventFeedService(fpb_grpc.EventFeedServicer):
    def __init__(self, hub: FeedHub, auth: TokenAuth | None, queue_events: int, max_replay_s: int,
                 max_subscriptions: int, max_subscriptions_per_token: int | None = None, cluster: str = "") -> None:
        self.hub = hub
        self.auth = auth
        self.queue_events = queue_events
        self.max_replay_s = max_replay_s
        self.max_subscriptions = max_subscriptions
        self.max_subscriptions_per_token = max_subscriptions_per_token or max_subscriptions
        self.cluster = cluster

    def _reader(self, context: grpc.aio.ServicerContext) -> _Reader | None:
        """The caller and its scope; None when its token is missing or unknown."""
        if self.auth is None:
            return _Reader("", ("*",), self.cluster)
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("authorization", "")
        collector = self.auth.identify(header[7:] if header.lower().startswith("bearer ") else "")
        if collector is None:
            return None
        return _Reader(collector.name, collector.sources, collector.cluster or self.cluster)

    async def Subscribe(self, request: fpb.SubscribeRequest, context) -> AsyncIterator[fpb.FeedEvent]:
        stats = self.hub.stats
        reader = self._reader(context)
        if reader is None:
            stats.refused_unauthenticated += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token")
        try:
            subscription = dataclasses.replace(Subscription.from_request(request, self.max_replay_s),
                                               scope=reader.sources, cluster_scope=reader.cluster)
        except ValueError as exc:
            stats.refused_invalid += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if stats.subscriptions >= self.max_subscriptions:
            stats.refused_over_share += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this feed serves at most {self.max_subscriptions} subscriptions")
        if self.hub.held_by(reader.token) >= self.max_subscriptions_per_token:
            stats.refused_over_share += 1
            _limited_log.warning("token %r refused a subscription: it holds its share of %d", reader.token,
                                 self.max_subscriptions_per_token)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this token holds its share of {self.max_subscriptions_per_token} subscriptions")
        outbox = Outbox(self.queue_events)
        subscriber = self.hub.add(subscription, outbox, reader.token)
        log.info("subscription from %s (token %r): %s", context.peer(), reader.token, subscription)
        try:
            if subscription.replay_seconds:
                async for delivery in self.hub.replay(subscriber):
                    yield to_proto(delivery.event, outbox.dropped)
            live_from = subscriber.live_from or {}
            while True:
                delivery = await outbox.get()
                if delivery.offset < live_from.get((delivery.topic, delivery.partition), 0):
                    continue   # already sent by the replay
                yield to_proto(delivery.event, outbox.dropped)
        finally:
            self.hub.remove(subscriber)


class FeedServer:
    """The feed's Kafka consumer and gRPC server, started and stopped together.

    ``listen`` may use port 0; :attr:`port` is the one bound. Off loopback, ``tls`` and
    ``auth`` are both required (a ``ValueError`` otherwise, before anything starts).
    """

    def __init__(self, bootstrap: str, listen: str = DEFAULT_LISTEN, *, tls: tuple[str, str] | None = None,
                 client_ca: str | None = None, auth: TokenAuth | None = None, queue_events: int = 1000,
                 max_replay_s: int = 3600, max_subscriptions: int = 100,
                 max_subscriptions_per_token: int = MAX_SUBSCRIPTIONS_PER_TOKEN, cluster: str = "") -> None:
        if not is_loopback(split_host_port(listen, "feed listen address")[0]):
            if tls is None:
                raise ValueError(f"refusing to serve the feed on {listen} without TLS (only loopback may be plaintext)")
            if auth is None:
                raise ValueError(f"refusing to serve the feed on {listen} without tokens")
        if queue_events < 1 or max_replay_s < 0 or max_subscriptions < 1 or max_subscriptions_per_token < 1:
            raise ValueError("queue_events and max_subscriptions(_per_token) must be >= 1, max_replay_s >= 0")
        self.bootstrap = bootstrap
        self.listen = listen
        self.tls = tls
        self.client_ca = client_ca
        self.auth = auth
        self.queue_events = queue_events
        self.max_replay_s = max_replay_s
        self.max_subscriptions = max_subscriptions
        self.max_subscriptions_per_token = max_subscriptions_per_token
        self.cluster = cluster
        self.stats = FeedStats()
        self.port = 0
        self._hub = FeedHub(bootstrap, self.stats)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        install_reconnect_log_limits()
        await topics.ensure_topics(self.bootstrap, [topics.SPECS[t] for t in FEED_TOPICS])
        await self._hub.start()
        try:
            self._server = grpc.aio.server()
            fpb_grpc.add_EventFeedServicer_to_server(
                EventFeedService(self._hub, self.auth, self.queue_events, self.max_replay_s, self.max_subscriptions,
                                 self.max_subscriptions_per_token, self.cluster),
                self._server)
            if self.tls:
                self.port = self._server.add_secure_port(
                    self.listen, server_credentials(self.tls[0], self.tls[1], self.client_ca))
            else:
                self.port = self._server.add_insecure_port(self.listen)
            if self.port == 0:
                raise OSError(f"cannot listen on {self.listen}")
            await self._server.start()
        except BaseException:
            await self._hub.stop()
            raise
        log.info("event feed on %s (%s, %s), reading %s", self.listen, "TLS" if self.tls else "plaintext",
                 "token auth" if self.auth else "no auth", self.bootstrap)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace=grace_s)
        await self._hub.stop()

    async def __aenter__(self) -> FeedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()


async def serve_feed(bootstrap: str, listen: str = DEFAULT_LISTEN, *, ready: asyncio.Event | None = None,
                     stop: asyncio.Event | None = None, **options) -> None:
    """Run a :class:`FeedServer` until `stop` is set (or forever); `options` are its keywords."""
    async with FeedServer(bootstrap, listen, **options):
        if ready is not None:
            ready.set()
        await (stop.wait() if stop is not None else asyncio.Event().wait())
