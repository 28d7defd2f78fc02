"""Kafka -> `FabricState`: follow the telemetry, rank-steps, anomalies, actions and audit topics.

No consumer group: the dashboard reads every partition itself, starting a bounded look-back
before now (`FeedSettings`), so a restart shows the last minutes of telemetry and the
anomalies still open from the last day without committing offsets anywhere. A record that
does not decode, or that the state refuses, is counted (`state.stats["bad_records:<topic>"]`)
and skipped; the feed never stops for one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import records_pb2 as rec
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams import topics
from fabricwatch.streams.decode import to_batch, unpack

from .state import FabricState

log = logging.getLogger("fabricwatch.dashboard.feed")

TOPIC_RETRY_S = 2.0          # topics not created yet (the worker creates them): look again
BATCH_MAX_RECORDS = 2_000    # per poll; the web server gets the loop back between batches
MAX_LOGGED_BAD_RECORDS = 10


@dataclass(frozen=True)
class FeedSettings:
    bootstrap: str
    telemetry_lookback_s: float = 300.0     # telemetry and rank steps: enough to draw recent history
    events_lookback_s: float = 86_400.0     # anomalies and decisions: to know what is still open

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ValueError("bootstrap must name a Kafka broker (host:port)")
        for name in ("telemetry_lookback_s", "events_lookback_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


def apply_record(state: FabricState, topic: str, value: bytes | None) -> bool:
    """Decode one record of `topic` into the state; False (and counted) if it was not usable."""
    try:
        if value is None:
            raise DecodeError("empty record value")
        if topic == topics.TELEMETRY:      # a record carries several ticks of one source
            record = rec.SourceRecord.FromString(value)
            accepted = all([state.add_snapshot(snap) for snap in unpack(record)])
            if accepted:
                state.fabric.add(to_batch(record))
            return accepted
        if topic == topics.RANK_STEPS:
            return state.add_rank_steps(pb.Snapshot.FromString(value))
        if topic == topics.ANOMALIES:
            return state.add_anomaly(ev.AnomalyEvent.FromString(value))
        if topic in (topics.ACTIONS, topics.AUDIT):
            return state.add_decision(ev.ActionDecision.FromString(value))
        state.stats[f"bad_records:{topic}"] += 1
        return False
    except Exception as exc:  # any malformed record: count it, log the first few, go on
        state.stats[f"bad_records:{topic}"] += 1
        if sum(v for k, v in state.stats.items() if k.startswith("bad_records:")) <= MAX_LOGGED_BAD_RECORDS:
            log.warning("skipping a bad record on %s: %s", topic, str(exc)[:200])
        return False


FOLLOWED_TOPICS = (topics.TELEMETRY, topics.RANK_STEPS, topics.ANOMALIES, topics.ACTIONS, topics.AUDIT)


async def follow(settings: FeedSettings, state: FabricState, stop: asyncio.Event,
                 on_following: Callable[[], None] | None = None) -> None:
    """Feed `state` from Kafka until `stop` is set; reconnects by itself (aiokafka retries).

    `on_following` is called once every topic is assigned and positioned.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="latest", client_id="fabricwatch-dashboard")
    try:
        await consumer.start()
        assigned: set[str] = set()
        next_look_s = 0.0
        while not stop.is_set():
            # Topics that do not exist yet are looked for again while the others are read.
            if len(assigned) < len(FOLLOWED_TOPICS) and time.monotonic() >= next_look_s:
                await _assign_new(consumer, assigned, settings, TopicPartition)
                state.stats["topics_followed"] = len(assigned)
                if len(assigned) == len(FOLLOWED_TOPICS):
                    state.stats["feed_connected"] = 1
                    if on_following is not None:
                        on_following()
                else:
                    if not next_look_s:
                        log.info("waiting for topics %s", sorted(set(FOLLOWED_TOPICS) - assigned))
                    next_look_s = time.monotonic() + TOPIC_RETRY_S
            if assigned:
                await _drain(consumer, state, stop, 0.5)
            else:
                await _wait(stop, TOPIC_RETRY_S)
    finally:
        state.stats["feed_connected"] = 0
        await consumer.stop()


async def _assign_new(consumer, assigned: set[str], settings: FeedSettings, TopicPartition) -> None:
    existing = await consumer.topics()
    new = [t for t in FOLLOWED_TOPICS if t in existing and t not in assigned]
    if not new:
        return
    tps = list(consumer.assignment())
    # assign() replaces the assignment: keep the place reached on the partitions already read.
    positions = {tp: await consumer.position(tp) for tp in tps}
    fresh = []
    for topic in new:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            continue
        fresh += [TopicPartition(topic, p) for p in sorted(parts)]
        assigned.add(topic)
    consumer.assign(tps + fresh)
    for tp, offset in positions.items():
        consumer.seek(tp, offset)
    now_ms = int(time.time() * 1000)
    lookback = {tp: now_ms - int(1000 * (settings.telemetry_lookback_s
                                         if tp.topic in (topics.TELEMETRY, topics.RANK_STEPS)
                                         else settings.events_lookback_s)) for tp in fresh}
    offsets = await consumer.offsets_for_times(lookback)
    for tp in fresh:
        found = offsets.get(tp)
        if found is None:
            await consumer.seek_to_end(tp)       # nothing that recent: only new records
        else:
            consumer.seek(tp, found.offset)
    log.info("following %s", ", ".join(sorted({tp.topic for tp in fresh})))


async def _drain(consumer, state: FabricState, stop: asyncio.Event, timeout_s: float) -> None:
    batches = await consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=BATCH_MAX_RECORDS)
    for tp, records in batches.items():
        for record in records:
            apply_record(state, tp.topic, record.value)
        state.stats[f"records:{tp.topic}"] += len(records)
    await asyncio.sleep(0)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
