"""The local Kafka broker (deploy/kafka/kafka-local.sh via fabricwatch.localkafka) and
topic creation (fabricwatch.streams.topics) against it."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from fabricwatch.localkafka import wait_for_broker
from fabricwatch.streams import topics
from fabricwatch.streams.topics import TopicSpec, ensure_topics

pytestmark = pytest.mark.kafka


async def _partition_counts(bootstrap: str, names: list[str]) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}


async def _topic_configs(bootstrap: str, name: str, keys: list[str]) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, dict.fromkeys(keys))]
        )
    finally:
        await admin.close()
    [resource] = response.to_object()["resources"]
    assert resource["error_code"] == 0, resource
    return {e["config_names"]: e["config_value"] for e in resource["config_entries"]}


async def test_broker_answers(kafka_bootstrap: str) -> None:
    assert kafka_bootstrap.startswith("127.0.0.1:")
    await wait_for_broker(kafka_bootstrap, timeout_s=10)


async def test_ensure_topics_creates_project_topics(kafka_bootstrap: str) -> None:
    await ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)

    names = [s.name for s in topics.ALL_TOPICS]
    counts = await _partition_counts(kafka_bootstrap, names)
    assert counts == {
        topics.TELEMETRY: 12,
        topics.RANK_STEPS: 12,
        topics.PAUSE_STATES: 3,
        topics.ANOMALIES: 6,
        topics.ACTIONS: 6,
        topics.AUDIT: 6,
        topics.FACTS: 12,
        topics.STATE: 12,
    }
    configs = await _topic_configs(kafka_bootstrap, topics.FACTS, ["cleanup.policy", "segment.ms"])
    assert configs == {"cleanup.policy": "compact", "segment.ms": str(10 * 60_000)}
    configs = await _topic_configs(kafka_bootstrap, topics.STATE, ["cleanup.policy", "retention.ms"])
    assert configs == {"cleanup.policy": "compact,delete", "retention.ms": str(3600 * 1000)}
    configs = await _topic_configs(kafka_bootstrap, topics.ANOMALIES, ["retention.ms", "cleanup.policy"])
    assert configs == {"retention.ms": str(7 * 24 * 3600 * 1000), "cleanup.policy": "delete"}
    configs = await _topic_configs(kafka_bootstrap, topics.TELEMETRY, ["retention.ms"])
    assert configs == {"retention.ms": str(6 * 3600 * 1000)}

    # Idempotent: a second call leaves everything as it is.
    await ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    assert await _partition_counts(kafka_bootstrap, names) == counts


async def test_ensure_topics_leaves_existing_topics_and_tolerates_races(kafka_bootstrap: str) -> None:
    name = f"fabricwatch.test-{uuid.uuid4().hex[:8]}"
    spec = TopicSpec(name, partitions=3, retention_ms=60_000, cleanup_policy="compact,delete")
    # Two concurrent creators of the same topic: one wins, the other sees TopicAlreadyExists.
    await asyncio.gather(ensure_topics(kafka_bootstrap, [spec]), ensure_topics(kafka_bootstrap, [spec]))
    assert await _partition_counts(kafka_bootstrap, [name]) == {name: 3}
    configs = await _topic_configs(kafka_bootstrap, name, ["cleanup.policy", "retention.ms"])
    assert configs == {"cleanup.policy": "compact,delete", "retention.ms": "60000"}

    # An existing topic is not touched, even if the spec now says otherwise.
    await ensure_topics(kafka_bootstrap, [spec.with_partitions(5)])
    assert await _partition_counts(kafka_bootstrap, [name]) == {name: 3}


async def test_partition_override(kafka_bootstrap: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    specs = [
        TopicSpec(f"{s.name}.{suffix}", s.partitions, s.retention_ms, s.cleanup_policy)
        for s in topics.all_topics(partitions=2)
    ]
    await ensure_topics(kafka_bootstrap, specs)
    counts = await _partition_counts(kafka_bootstrap, [s.name for s in specs])
    assert counts == {s.name: 2 for s in specs}


async def test_produce_consume_round_trip(kafka_bootstrap: str) -> None:
    await ensure_topics(kafka_bootstrap, topics.ALL_TOPICS)
    run = uuid.uuid4().hex
    sent = {f"switch-{i}-{run}".encode(): f"sample-{i}".encode() for i in range(20)}

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in sent.items():
            await producer.send(topics.TELEMETRY, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topics.TELEMETRY,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"fabricwatch-test-{run}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    received: dict[bytes, bytes] = {}
    partitions_seen: set[int] = set()
    try:
        async with asyncio.timeout(60):
            while not set(sent) <= set(received):
                batch = await consumer.getmany(timeout_ms=1000)
                for tp, records in batch.items():
                    for r in records:
                        if r.key in sent:
                            received[r.key] = r.value
                            partitions_seen.add(tp.partition)
        await consumer.commit()
    finally:
        await consumer.stop()

    assert received == sent
    assert len(partitions_seen) > 1  # keyed records spread over the 12 partitions
