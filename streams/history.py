"""Read one partition's past records, outside the worker's consumer group.

Used by `streams.rebuild` to fold the records another worker processed into this worker's
detection state, and by the storm stages to look up idle partitions' end offsets. A plain aiokafka consumer with no group: it commits nothing and joins no
rebalance, so reading history cannot disturb the group that moves the live records.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

FETCH_TIMEOUT_MS = 500
MAX_RECORDS_PER_FETCH = 1000
# The broker holds a fetch this long for data; aiokafka's 500 ms default made every rebuild
# wait half a second after each seek.
FETCH_MAX_WAIT_MS = 20


class HistoryStalled(RuntimeError):
    """The broker returned nothing for longer than the stall timeout."""


class KafkaHistory:
    """Offsets by time and records by offset range, for any partition."""

    def __init__(self, bootstrap: str, stall_timeout_s: float = 10.0) -> None:
        self.bootstrap = bootstrap
        self.stall_timeout_s = stall_timeout_s
        self._consumer: AIOKafkaConsumer | None = None

    async def _get(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def offset_at(self, topic: str, partition: int, timestamp_ms: int) -> int | None:
        """The first offset whose record timestamp is >= `timestamp_ms`; None when there is none."""
        consumer = await self._get()
        tp = TopicPartition(topic, partition)
        found = await consumer.offsets_for_times({tp: max(0, int(timestamp_ms))})
        return found[tp].offset if found.get(tp) is not None else None

    async def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next record written to the partition will get."""
        consumer = await self._get()
        tp = TopicPartition(topic, partition)
        return (await consumer.end_offsets([tp]))[tp]

    async def end_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the offset the next record written there will get."""
        consumer = await self._get()
        found = await consumer.end_offsets([TopicPartition(t, p) for t, p in partitions])
        return {(tp.topic, tp.partition): offset for tp, offset in found.items()}

    async def read(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[tuple[int, bytes]]:
        """(offset, value) of the records in [start, end); offsets the log no longer has are skipped."""
        consumer = await self._get()
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        async for record in read_range(consumer, tp, start, end, self.stall_timeout_s):
            yield record.offset, record.value

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


async def read_range(consumer, tp, start: int, end: int, stall_timeout_s: float,
                     max_records: int = MAX_RECORDS_PER_FETCH) -> AsyncIterator:
    """The records of partition ``tp`` in offsets [start, end), read by ``consumer`` (which
    has it assigned), in order. Offsets the log no longer has (compacted, deleted, a
    transaction marker just before ``end``) are skipped: the read ends once the consumer's
    position reaches ``end``. `HistoryStalled` when the broker returns nothing for
    ``stall_timeout_s`` before that.
    """
    consumer.seek(tp, start)
    stalled_at = time.monotonic() + stall_timeout_s
    while True:
        batch = await consumer.getmany(tp, timeout_ms=FETCH_TIMEOUT_MS, max_records=max_records)
        records = batch.get(tp, [])
        if not records:
            if await consumer.position(tp) >= end:
                return
            if time.monotonic() > stalled_at:
                raise HistoryStalled(f"{tp.topic}[{tp.partition}]: nothing read for {stall_timeout_s} s "
                                     f"before offset {end}")
            continue
        stalled_at = time.monotonic() + stall_timeout_s
        for record in records:
            if record.offset >= end:
                return
            yield record
        if records[-1].offset >= end - 1:
            return
