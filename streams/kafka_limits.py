"""The broker's real limit on one record, read once when the gateway starts.

Kafka refuses a record batch bigger than the topic's ``max.message.bytes`` (which defaults
to the broker's ``message.max.bytes``, 1,048,588 bytes) with ``MessageSizeTooLarge``. The
gateway writes a whole collector batch at once, so one over-size snapshot used to fail
the write of every snapshot of its batch; the collector resent the batch forever and the
others were written again each time. The gateway now asks the broker for the limit of
the topics it writes (``DescribeConfigs``) and refuses, alone and with a reason, a
snapshot whose serialized size would not fit (`IngestService.max_snapshot_bytes`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("fabricwatch.gateway")

#: Kafka's own default for ``message.max.bytes`` (1 MiB + 12 bytes of batch overhead).
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
#: Room left for what Kafka adds around a value: the record batch header (61 bytes), the
#: record's own framing and its key (a source name, at most 253 bytes), and headers.
RECORD_OVERHEAD_MARGIN_BYTES = 1024
DESCRIBE_TIMEOUT_S = 10.0


def snapshot_limit_bytes(max_message_bytes: int) -> int:
    """The largest serialized snapshot the gateway accepts for a topic limit of `max_message_bytes`.

    >>> snapshot_limit_bytes(KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
    1047564
    """
    return max(0, max_message_bytes - RECORD_OVERHEAD_MARGIN_BYTES)


def parse_max_message_bytes(responses) -> dict[str, int]:
    """``max.message.bytes`` per topic from aiokafka `DescribeConfigsResponse` objects."""
    found: dict[str, int] = {}
    for response in responses:
        for resource in response.to_object().get("resources", []):
            if resource.get("error_code"):
                continue
            for entry in resource.get("config_entries", []):
                if entry.get("config_names") == "max.message.bytes":
                    try:
                        found[resource["resource_name"]] = int(entry["config_value"])
                    except (TypeError, ValueError):
                        continue
    return found


async def topic_max_message_bytes(bootstrap: str, topic_names: Iterable[str]) -> int:
    """The smallest ``max.message.bytes`` of `topic_names` as the broker reports it.

    Falls back to Kafka's default (logged) when the broker does not say, e.g. without
    DescribeConfigs permission: refusing a little too much is better than a poison pill.
    """
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    names = list(topic_names)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="fabricwatch-gateway-limits",
                                request_timeout_ms=int(DESCRIBE_TIMEOUT_S * 1000))
    try:
        await admin.start()
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, configs={"max.message.bytes": None}) for name in names])
        found = parse_max_message_bytes(responses)
    except Exception as exc:  # noqa: BLE001 - any failure: the documented default
        log.warning("cannot read max.message.bytes of %s (%s); assuming Kafka's default %d bytes", names, exc,
                    KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        return KAFKA_DEFAULT_MAX_MESSAGE_BYTES
    finally:
        await admin.close()
    missing = [n for n in names if n not in found]
    if missing:
        log.warning("the broker did not report max.message.bytes of %s; assuming Kafka's default %d bytes",
                    missing, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
    return min([found[n] for n in names if n in found] + ([KAFKA_DEFAULT_MAX_MESSAGE_BYTES] if missing else []))
