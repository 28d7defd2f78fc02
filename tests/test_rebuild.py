"""State rebuild on a gap (`streams.coverage`, `streams.rebuild`), driven without Kafka.

The history here is a list of (offset, timestamp, bytes) standing in for a partition; the
rebuild itself, the coverage decisions and the pipeline are the real ones. The same path
on a real broker with real worker processes is `tests/test_faults.py` (kill -9, takeover).
"""
from __future__ import annotations

import asyncio

import pytest

from fabricwatch.collectors.faults import PfcStorm
from fabricwatch.collectors.simulator import ClusterSimulator
from fabricwatch.models.topology import rail_optimised
from fabricwatch.streams.coverage import PROCESS, SKIP, Coverage, Gap
from fabricwatch.streams.handlers import StageHandlers
from fabricwatch.streams.history import HistoryStalled
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.rebuild import StateKeeper

TOPIC = "telemetry"


class ListHistory:
    """One partition as a list: offsets 0.., a record timestamp (ms) each."""

    def __init__(self, records: list[tuple[int, bytes]], fail_after: int | None = None) -> None:
        self.records = records                    # (timestamp_ms, value) at offset = index
        self.fail_after = fail_after
        self.reads: list[tuple[int, int]] = []

    async def offset_at(self, topic, partition, timestamp_ms):
        return next((i for i, (ts, _) in enumerate(self.records) if ts >= timestamp_ms), None)

    async def read(self, topic, partition, start, end):
        self.reads.append((start, end))
        for offset in range(start, end):
            if self.fail_after is not None and offset - start >= self.fail_after:
                raise HistoryStalled("broker went away")
            yield offset, self.records[offset][1]
            await asyncio.sleep(0)


def test_coverage_decisions():
    c = Coverage({(TOPIC, 0): 9})
    assert c.admit(TOPIC, 0, 5) == SKIP                  # redelivered, already folded in
    assert c.admit(TOPIC, 0, 10) == PROCESS              # follows the covered offset
    assert c.admit(TOPIC, 1, 0) == Gap(TOPIC, 1, None, 0)
    c.folded(TOPIC, 0, 10)
    c.folded(TOPIC, 0, 4)                                # never moves backwards
    assert c.offsets[(TOPIC, 0)] == 10
    assert c.admit(TOPIC, 0, 30) == PROCESS              # checked already: non-contiguous offsets are fine
    c.on_assignment()
    assert c.admit(TOPIC, 0, 30) == Gap(TOPIC, 0, 11, 30)


def storm_partition():
    """One partition holding a storm episode, 0.1 s per tick, record timestamps = event time."""
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, interval_s=0.1,
                           faults=[PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=2.0, offset_s=4.0)])
    snaps = [s for _ in range(60) for s in sim.tick()]
    return topo, [(s.time_unix_ns // 1_000_000, s.SerializeToString()) for s in snaps]


def storm_states(handlers: StageHandlers, values: list[bytes]) -> list[str]:
    out = []
    for raw in values:
        anomalies, changes = handlers.on_snapshot(raw)
        for change in changes:
            out += [e.value for e in handlers.on_pause_state(change.value)]
        out += [a.value for a in anomalies]
    return out


async def takeover(topo, records, taken_at: int, lookback_s: float, history=None):
    """A worker with no state for the partition gets it at offset `taken_at`: what does it emit after?"""
    handlers = StageHandlers(DetectionPipeline(topology=topo))
    history = history or ListHistory(records)
    keeper = StateKeeper(Coverage(), history, {TOPIC: lookback_s})

    def both_stages(raw: bytes) -> None:
        _, changes = handlers.on_snapshot(raw)
        for change in changes:
            handlers.on_pause_state(change.value)

    fold = handlers.rebuild_with(both_stages)
    emitted = []
    for offset in range(taken_at, len(records)):
        ts, raw = records[offset]
        if await keeper.admit(TOPIC, 0, offset, ts / 1000, fold):
            emitted += storm_states(handlers, [raw])
            keeper.folded(TOPIC, 0, offset)
    return emitted, keeper, history, handlers


def lifecycles(values: list[bytes]) -> list[tuple[str, int, str]]:
    from fabricwatch.protos.v1 import events_pb2 as ev

    events = [ev.AnomalyEvent.FromString(v) for v in values]
    return [(e.dedup_key, e.lifecycle, e.id) for e in events if e.kind == "pfc_storm"]


async def test_a_worker_taking_over_mid_storm_resolves_it_under_the_same_ids_and_never_reopens():
    from fabricwatch.protos.v1 import events_pb2 as ev

    topo, records = storm_partition()
    oracle = lifecycles(storm_states(StageHandlers(DetectionPipeline(topology=topo)), [r for _, r in records]))
    opened = [e for e in oracle if e[1] == ev.LIFECYCLE_OPEN]
    assert opened and [e for e in oracle if e[1] == ev.LIFECYCLE_RESOLVED]
    taken_at = len(records) // 2                         # 3.0 s: the storm is open

    emitted, keeper, history, _ = await takeover(topo, records, taken_at, lookback_s=30)
    after = lifecycles(emitted)
    assert not [e for e in after if e[1] == ev.LIFECYCLE_OPEN]               # no second OPEN
    resolved = [e for e in oracle if e[1] == ev.LIFECYCLE_RESOLVED]
    assert [e for e in after if e[1] == ev.LIFECYCLE_RESOLVED] == resolved    # same id as uninterrupted
    assert history.reads == [(0, taken_at)] and keeper.stats["rebuilt_records"] == taken_at

    # without the rebuild (lookback 0) the new owner pages a second time, under a new id
    emitted, _, history, _ = await takeover(topo, records, taken_at, lookback_s=0)
    reopened = [e for e in lifecycles(emitted) if e[1] == ev.LIFECYCLE_OPEN]
    assert reopened and reopened[0][2] not in {e[2] for e in opened} and history.reads == []


async def test_lookback_bounds_the_rebuild_and_a_failing_history_still_lets_detection_go_on():
    topo, records = storm_partition()
    taken_at = len(records) // 2
    _, keeper, history, _ = await takeover(topo, records, taken_at, lookback_s=1.0)
    (start, end), = history.reads
    assert end == taken_at and records[start][0] >= records[taken_at][0] - 1000 > records[start - 1][0]

    broken = ListHistory(records, fail_after=10)
    emitted, keeper, _, _ = await takeover(topo, records, taken_at, lookback_s=30, history=broken)
    assert keeper.stats["rebuild_failures"] == 1 and keeper.stats["rebuilt_records"] == 10
    assert keeper.rebuilding == 0 and keeper.coverage.offsets[(TOPIC, 0)] == len(records) - 1


async def test_restart_from_a_checkpoint_behind_the_commit_fills_the_gap_and_skips_what_it_holds():
    """Checkpoint at offset 100, Kafka committed 140: 101..139 are folded in (suppressed), a
    redelivery of 90 is skipped, and live processing goes on at 140."""
    topo, records = storm_partition()
    handlers = StageHandlers(DetectionPipeline(topology=topo))
    for _, raw in records[:101]:
        storm_states(handlers, [raw])
    history = ListHistory(records)
    keeper = StateKeeper(Coverage({(TOPIC, 0): 100}), history, {TOPIC: 600})
    folded = []
    assert await keeper.admit(TOPIC, 0, 140, records[140][0] / 1000, folded.append)
    assert history.reads == [(101, 140)] and len(folded) == 39
    assert not await keeper.admit(TOPIC, 0, 90, records[90][0] / 1000, folded.append)
    assert keeper.stats["covered_records_skipped"] == 1


async def test_a_rebuild_moves_the_open_book_but_counts_and_logs_nothing(caplog):
    from fabricwatch import metrics

    topo, records = storm_partition()
    taken_at = len(records) // 2
    emitted_before = sum(s.value for m in metrics.WORKER_ANOMALIES_EMITTED.collect() for s in m.samples
                         if s.name.endswith("_total"))
    with caplog.at_level("INFO", logger="fabricwatch.pipeline"):
        handlers = StageHandlers(DetectionPipeline(topology=topo))
        keeper = StateKeeper(Coverage(), ListHistory(records), {TOPIC: 30})

        def both_stages(raw):
            for change in handlers.on_snapshot(raw)[1]:
                handlers.on_pause_state(change.value)

        await keeper.admit(TOPIC, 0, taken_at, records[taken_at][0] / 1000, handlers.rebuild_with(both_stages))
    assert [k for k in handlers.pipeline.open_anomalies if k.startswith("pfc_storm:")]    # the storm is open
    assert not [r for r in caplog.records if r.getMessage().startswith("anomaly ")]
    emitted_after = sum(s.value for m in metrics.WORKER_ANOMALIES_EMITTED.collect() for s in m.samples
                        if s.name.endswith("_total"))
    assert emitted_after == emitted_before and not handlers.pipeline.rebuilding


@pytest.mark.parametrize("offsets", [{("t", 0): 3}, {}])
def test_coverage_survives_a_checkpoint_round_trip(tmp_path, offsets):
    from fabricwatch.streams import checkpoint

    pipeline = DetectionPipeline()
    path = tmp_path / "w.checkpoint"
    checkpoint.write(checkpoint.dumps(pipeline, offsets), path)
    restored = checkpoint.load(path, DetectionPipeline())
    assert restored is not None and Coverage(restored.offsets).offsets == offsets
