"""What the Kafka benchmarks share: the broker they run on, and the reference they divide by.

The reference is a bare aiokafka consumer of the same records: records per CPU-second of
this process, re-reading the topic until at least `REFERENCE_S` seconds of CPU time are
measured (a single pass over a small topic takes a fraction of a second, too short to
mean anything on a noisy machine).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

REFERENCE_S = 5.0


async def reference_rate(bootstrap: str, topic: str, n: int, min_cpu_s: float = REFERENCE_S) -> float:
    """Records per CPU-second of a bare consumer reading the ``n`` records of ``topic``."""
    from aiokafka import AIOKafkaConsumer

    got, cpu = 0, 0.0
    while cpu < min_cpu_s:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
        await consumer.start()
        try:
            seen = 0
            c0 = time.process_time()
            while seen < n:
                batches = await consumer.getmany(timeout_ms=1000, max_records=10_000)
                seen += sum(len(r) for r in batches.values())
            cpu += time.process_time() - c0
            got += seen
        finally:
            await consumer.stop()
    return got / cpu


@contextlib.asynccontextmanager
async def broker(given: str | None, port: int, workdir: Path) -> AsyncIterator[str]:
    """The broker at ``given``, or a fresh local one for the run; yields its bootstrap address."""
    if given:
        yield given
        return
    from fabricwatch.localkafka import LocalKafka

    kafka = LocalKafka(port=port, state_dir=workdir)
    bootstrap = kafka.start()
    try:
        yield bootstrap
    finally:
        kafka.stop()
