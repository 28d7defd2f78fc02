"""Checkpoints of each partition's detection state, on the compacted state topic.

A stage instance (stage 1 of telemetry partition p, stage 2 of a pause-states partition,
stage 3 of a rank-steps partition) is the state of its partition; it moves with the
partition. Every ``--checkpoint-interval`` seconds, and when the partition is revoked, the
worker that owns it writes it to the STATE topic: pickled (objects every worker shares,
the topology and the facts, by reference: `dumps` / `loads`), compressed, cut into
`CHUNK_BYTES` records, then a manifest naming the generation, its chunk count and the last
input offset folded in. Records go to the state partition of the same number (mod the
topic's partitions). Generations alternate between two key slots, so compaction (which
keeps the newest record of each key) always keeps one complete generation, even when a
worker dies half-way through writing the next.

The worker that is assigned the partition next reads the latest complete generation
back (`StateStore.load`: the tail of the state partition, `LOAD_LOOKBACK_INTERVALS`
checkpoint intervals of it, or all of it if that finds none) and folds in what came after
its offset from the partition's history (`streams.rebuild`), its outputs sent again. Moving a
partition costs one read of its state and at most one interval of records, not minutes of
history.

A checkpoint written for another version, configuration or topology is ignored (and says
so), never half-loaded. The topic is written and read only by the workers; pickle is not a
format for data from anyone else.

>>> from fabricwatch.models.topology import rail_optimised
>>> topo = rail_optimised("c1", n_nodes=2)
>>> state = {"topology": topo, "counts": [1, 2, 3]}
>>> back = loads(dumps(state, {"topology": topo}), {"topology": topo})
>>> back["topology"] is topo, back["counts"]
(True, [1, 2, 3])
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import pickle
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fabricwatch.protos.v1 import records_pb2 as rec

log = logging.getLogger("fabricwatch.state")
FORMAT = "fabricwatch-stage-state/1"
# Below Kafka's default 1 MB message limit with room for the record's envelope.
CHUNK_BYTES = 512 * 1024
# How much of the state partition's tail a load reads first, in checkpoint intervals.
LOAD_LOOKBACK_INTERVALS = 3
FETCH_MAX_WAIT_MS = 20
STALL_TIMEOUT_S = 10.0


class _Pickler(pickle.Pickler):
    def __init__(self, fh, externals: dict[str, object]) -> None:
        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._ids = {id(obj): name for name, obj in externals.items()}

    def persistent_id(self, obj):
        return self._ids.get(id(obj))


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, externals: dict[str, object]) -> None:
        super().__init__(fh)
        self._externals = externals

    def persistent_load(self, pid):
        try:
            return self._externals[pid]
        except KeyError:
            raise pickle.UnpicklingError(f"checkpoint refers to {pid!r}, which this worker does not share") from None


def pickled(obj: object, externals: dict[str, object]) -> bytes:
    """``obj`` pickled (a consistent copy of it); objects of ``externals`` are stored by name."""
    buf = io.BytesIO()
    _Pickler(buf, externals).dump(obj)
    return buf.getvalue()


def compressed(raw: bytes) -> bytes:
    return zlib.compress(raw, 1)


def dumps(obj: object, externals: dict[str, object]) -> bytes:
    """``obj`` pickled and compressed; objects of ``externals`` are stored by name."""
    return compressed(pickled(obj, externals))


def loads(data: bytes, externals: dict[str, object]) -> object:
    return _Unpickler(io.BytesIO(zlib.decompress(data)), externals).load()


def fingerprint(*parts: object) -> str:
    """What a checkpoint is valid for: the format and the configuration it was made under."""
    return hashlib.sha256(repr((FORMAT, *parts)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Loaded:
    payload: bytes
    covered_offset: int
    generation: int
    size_bytes: int


def _prefix(namespace: str, stage: str, topic: str, partition: int) -> str:
    return f"{namespace}/{stage}/{topic}/{partition}"


class StateLog(Protocol):
    """Where checkpoints are written and read back: the state topic (`KafkaStateLog`)."""

    async def send(self, key: bytes, value: bytes, partition: int) -> None: ...

    def read(self, partition: int, since_ms: int | None) -> AsyncIterator[tuple[bytes | None, bytes]]:
        """(key, value) of a state partition's records from ``since_ms`` (None: the beginning) to its end."""


class StateStore:
    """Writes and reads the checkpoints of the partitions a worker owns, on a `StateLog`.

    ``namespace`` is the workers' consumer group (``--app-id``): groups that share a broker
    and its topics never read each other's state.
    """

    def __init__(self, log: StateLog, partitions: int, fingerprint: str, interval_s: float,
                 namespace: str = "fabricwatch-worker") -> None:
        self.log, self.partitions, self.fingerprint, self.interval_s = log, partitions, fingerprint, interval_s
        self.namespace = namespace
        self._generations: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self.stats = {"saved": 0, "saved_bytes": 0, "loaded": 0, "ignored": 0}

    def state_partition(self, partition: int) -> int:
        return partition % self.partitions

    async def save(self, stage: str, topic: str, partition: int, covered_offset: int, payload: bytes) -> int:
        """Write one checkpoint (already `dumps`-ed); returns its size in bytes."""
        prefix = _prefix(self.namespace, stage, topic, partition)
        generation = max(time.time_ns(), self._generations.get(prefix, 0) + 1)
        self._generations[prefix] = generation
        slot = generation % 2
        chunks = [payload[i:i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [b""]
        target = self.state_partition(partition)
        for index, data in enumerate(chunks):
            chunk = rec.StateChunk(stage=stage, topic=topic, partition=partition, generation=generation, slot=slot,
                                   index=index, covered_offset=covered_offset, fingerprint=self.fingerprint, data=data)
            await self.log.send(f"{prefix}/{slot}/{index}".encode(), chunk.SerializeToString(), target)
        manifest = rec.StateChunk(stage=stage, topic=topic, partition=partition, generation=generation, slot=slot,
                                  count=len(chunks), covered_offset=covered_offset, fingerprint=self.fingerprint)
        await self.log.send(f"{prefix}/manifest".encode(), manifest.SerializeToString(), target)
        self.stats["saved"] += 1
        self.stats["saved_bytes"] += len(payload)
        return len(payload)

    async def load(self, stage: str, topic: str, partition: int) -> Loaded | None:
        """The newest complete checkpoint of a partition's stage, or None."""
        async with self._lock:
            since_ms = int((time.time() - LOAD_LOOKBACK_INTERVALS * self.interval_s - 5) * 1000)
            found = await self._scan(stage, topic, partition, since_ms)
            if found is None:
                found = await self._scan(stage, topic, partition, None)
        if found is not None:
            self.stats["loaded"] += 1
        return found

    async def _scan(self, stage: str, topic: str, partition: int, since_ms: int | None) -> Loaded | None:
        prefix = _prefix(self.namespace, stage, topic, partition) + "/"
        chunks: dict[int, dict[int, bytes]] = {}
        manifests: list[rec.StateChunk] = []
        async for key, value in self.log.read(self.state_partition(partition), since_ms):
            if key is None or not key.decode(errors="replace").startswith(prefix):
                continue
            try:
                chunk = rec.StateChunk.FromString(value)
            except Exception:
                continue
            if chunk.fingerprint != self.fingerprint:
                self.stats["ignored"] += 1
                continue
            if chunk.count:
                manifests.append(chunk)
            else:
                chunks.setdefault(chunk.generation, {})[chunk.index] = chunk.data
                if len(chunks) > 4:                     # a few generations in flight at most
                    del chunks[min(chunks)]
        for manifest in sorted(manifests, key=lambda m: m.generation, reverse=True):
            parts = chunks.get(manifest.generation, {})
            if all(i in parts for i in range(manifest.count)):
                payload = b"".join(parts[i] for i in range(manifest.count))
                return Loaded(payload, manifest.covered_offset, manifest.generation, len(payload))
        return None


class KafkaStateLog:
    """The state topic: writes through the worker's producer, reads with a consumer of its own."""

    def __init__(self, bootstrap: str, topic: str, send: Callable[[bytes, bytes, int], Awaitable[None]]) -> None:
        self.bootstrap, self.topic, self._send = bootstrap, topic, send
        self._consumer = None

    async def send(self, key: bytes, value: bytes, partition: int) -> None:
        await self._send(key, value, partition)

    async def read(self, partition: int, since_ms: int | None) -> AsyncIterator[tuple[bytes | None, bytes]]:
        from aiokafka import TopicPartition

        from .history import HistoryStalled, read_range

        consumer = await self._get()
        tp = TopicPartition(self.topic, partition)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        start = (await consumer.beginning_offsets([tp]))[tp]
        if since_ms is not None:
            found = await consumer.offsets_for_times({tp: max(0, since_ms)})
            start = found[tp].offset if found.get(tp) is not None else end
        if start >= end:
            return
        try:
            async for r in read_range(consumer, tp, start, end, STALL_TIMEOUT_S, max_records=500):
                yield r.key, r.value
        except HistoryStalled as exc:
            log.warning("reading the state stalled: %s", exc)

    async def _get(self):
        if self._consumer is None:
            from aiokafka import AIOKafkaConsumer

            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
                                        max_partition_fetch_bytes=8 << 20)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


class MemoryStateLog:
    """A state log in memory (tests; a single process that needs no Kafka)."""

    def __init__(self) -> None:
        self.records: dict[int, list[tuple[float, bytes, bytes]]] = {}

    async def send(self, key: bytes, value: bytes, partition: int) -> None:
        self.records.setdefault(partition, []).append((time.time(), key, value))

    async def read(self, partition: int, since_ms: int | None) -> AsyncIterator[tuple[bytes | None, bytes]]:
        for at_s, key, value in list(self.records.get(partition, ())):
            if since_ms is None or at_s * 1000 >= since_ms:
                yield key, value
