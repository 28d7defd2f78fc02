"""Read the facts topic, all of it, into this worker's `FactBook`.

Every worker runs one `FactReader`: a consumer outside the consumer group, assigned every
partition of the FACTS topic, from the beginning (the topic is compacted: that is every
node's latest digest, vote and placement, and every partition's progress) and then live.
`ready` is set once it has read up to the end offsets it found at start: before that, "no
telemetry at all" cannot be told from "not read yet", and the straggler stages hold their
reports. `moved` is set whenever the watermark advanced, for the worker to release the
rank steps it now covers.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from . import facts as fact_codec
from .facts import FactBook
from .topics import partitions_of

log = logging.getLogger("fabricwatch.facts")
FETCH_MAX_WAIT_MS = 20
MAX_RECORDS = 5000
# Connection errors are logged at most this often (a broker outage must not flood the log).
ERROR_LOG_INTERVAL_S = 30.0


class FactReader:
    def __init__(self, bootstrap: str, topic: str, book: FactBook) -> None:
        self.bootstrap, self.topic, self.book = bootstrap, topic, book
        self.ready = asyncio.Event()
        self.moved = asyncio.Event()
        self.stats: Counter[str] = Counter()
        self._task: asyncio.Task | None = None
        self._logged_error_s = 0.0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def run(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        while True:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
                                        max_partition_fetch_bytes=4 << 20)
            try:
                await consumer.start()
                partitions = await partitions_of(self.bootstrap, self.topic)
                while not partitions:
                    await asyncio.sleep(0.5)
                    partitions = await partitions_of(self.bootstrap, self.topic)
                tps = [TopicPartition(self.topic, p) for p in partitions]
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                targets = await consumer.end_offsets(tps)
                if not any(targets.values()):
                    self.ready.set()
                while True:
                    batches = await consumer.getmany(timeout_ms=200, max_records=MAX_RECORDS)
                    before = self.book.watermark_ns
                    for _tp, records in batches.items():
                        for r in records:
                            self._apply(r.value)
                    if self.book.watermark_ns > before:
                        self.moved.set()
                    if not self.ready.is_set():
                        positions = {tp: await consumer.position(tp) for tp in tps}
                        if all(positions[tp] >= end for tp, end in targets.items()):
                            self.ready.set()
                            self.moved.set()
                            log.info("facts read: %d records, watermark %d", self.stats["facts"],
                                     self.book.watermark_ns)
            except asyncio.CancelledError:
                raise
            except Exception as exc:            # broker away: retry, without flooding the log
                self.stats["read_errors"] += 1
                now = time.monotonic()
                if now - self._logged_error_s >= ERROR_LOG_INTERVAL_S:
                    self._logged_error_s = now
                    log.warning("reading the facts topic failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await consumer.stop()
                except Exception:
                    pass

    def _apply(self, value: bytes | None) -> None:
        if value is None:                       # a tombstone
            return
        try:
            self.book.apply(fact_codec.decode(value))
            self.stats["facts"] += 1
        except fact_codec.FactError as exc:
            self.stats["malformed_facts"] += 1
            if self.stats["malformed_facts"] <= 10:
                log.warning("skipping a malformed facts record: %s", exc)
