"""Reading an offset range of one partition (`streams.history.read_range`), as the rebuild's
history and the state store's log do, against a consumer that behaves as aiokafka's does:
records by offset from its position, gaps where the log has none (compaction, a transaction
marker), nothing at all when the broker stalls. tests/test_pipeline_kafka.py reads real topics.
"""
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition

from fabricwatch.streams import state_store
from fabricwatch.streams.history import HistoryStalled, KafkaHistory, read_range
from fabricwatch.streams.state_store import KafkaStateLog


@dataclass
class Record:
    offset: int
    key: bytes
    value: bytes
    timestamp: int


class FakeConsumer:
    """One partition's log: ``offsets`` present (the others compacted away), ``end`` the next
    offset to write; with ``stalled`` the broker answers nothing."""

    def __init__(self, tp, offsets, end, stalled=False):
        self.tp, self.end, self.stalled = tp, end, stalled
        self.log = [Record(o, b"k%d" % o, b"v%d" % o, 1000 * o) for o in offsets]
        self.pos = 0
        self.fetches = 0

    def assign(self, tps):
        assert tps == [self.tp]

    def seek(self, tp, offset):
        self.pos = offset

    async def getmany(self, tp, timeout_ms, max_records):
        self.fetches += 1
        if self.stalled:
            return {}
        out = [r for r in self.log if r.offset >= self.pos][:max_records]
        # past the last record the position moves to the log's end (as a fetch that skips markers does)
        self.pos = out[-1].offset + 1 if out else self.end
        return {tp: out} if out else {}

    async def position(self, tp):
        return self.pos

    async def end_offsets(self, tps):
        return {self.tp: self.end}

    async def beginning_offsets(self, tps):
        return {self.tp: self.log[0].offset if self.log else self.end}

    async def offsets_for_times(self, query):
        at = query[self.tp]
        found = next((r for r in self.log if r.timestamp >= at), None)
        return {self.tp: None if found is None else type("Found", (), {"offset": found.offset})()}


TP = TopicPartition("t", 0)


async def collect(gen):
    return [x async for x in gen]


async def test_a_range_is_read_in_order_skipping_the_offsets_the_log_no_longer_has():
    fake = FakeConsumer(TP, offsets=[0, 1, 3, 4, 7, 8, 9], end=10)
    got = await collect(read_range(fake, TP, 1, 9, stall_timeout_s=5, max_records=2))
    assert [r.offset for r in got] == [1, 3, 4, 7, 8]


async def test_a_range_ending_on_a_marker_ends_at_the_position_not_at_the_stall_timeout():
    fake = FakeConsumer(TP, offsets=[0, 1, 2], end=4)        # offset 3: a transaction marker, no record
    got = await collect(read_range(fake, TP, 0, 4, stall_timeout_s=60))
    assert [r.offset for r in got] == [0, 1, 2] and fake.fetches == 2


async def test_a_broker_that_returns_nothing_is_a_stall():
    fake = FakeConsumer(TP, offsets=[0, 1, 2], end=3, stalled=True)
    with pytest.raises(HistoryStalled, match=r"t\[0\]: nothing read for 0.01 s before offset 3"):
        await collect(read_range(fake, TP, 0, 3, stall_timeout_s=0.01))


async def test_the_history_and_the_state_log_read_through_it(caplog, monkeypatch):
    fake = FakeConsumer(TP, offsets=[2, 3, 5], end=6)
    h = KafkaHistory("unused:9092")
    h._consumer = fake
    assert await collect(h.read("t", 0, 3, 6)) == [(3, b"v3"), (5, b"v5")]

    log = KafkaStateLog("unused:9092", "t", send=None)
    log._consumer = fake
    assert await collect(log.read(0, since_ms=None)) == [(b"k2", b"v2"), (b"k3", b"v3"), (b"k5", b"v5")]
    assert await collect(log.read(0, since_ms=2500)) == [(b"k3", b"v3"), (b"k5", b"v5")]

    monkeypatch.setattr(state_store, "STALL_TIMEOUT_S", 0.01)
    fake.stalled = True
    assert await collect(log.read(0, since_ms=None)) == []     # a stalled state read ends with a warning
    assert "reading the state stalled" in caplog.text
