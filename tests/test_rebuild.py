"""State rebuild on a gap (`streams.coverage`, `streams.rebuild`, `streams.partitions`), driven without Kafka.

The history here is a list of (offset, timestamp, bytes) standing in for a telemetry
partition; the rebuild itself, the coverage decisions, the partition states and the stage
handlers are the real ones. The same path on a real broker with real worker processes is
`tests/test_faults_worker.py` (kill -9, takeover) and `tests/test_scale_out.py`.
"""
from __future__ import annotations

import asyncio

import pytest

from fabricwatch.models.node_health import HealthBook
from fabricwatch.models.nominal import NominalRates
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.streams import topics
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.coverage import PROCESS, SKIP, Coverage, Gap
from fabricwatch.streams.decode import pack
from fabricwatch.streams.facts import FactBook
from fabricwatch.streams.handlers import ANOMALIES, PAUSE_STATES, StageHandlers
from fabricwatch.streams.history import HistoryStalled
from fabricwatch.streams.partitions import PartitionStates
from fabricwatch.streams.storm_stage import StormStage

TOPIC = topics.TELEMETRY


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
    """One telemetry partition holding a storm episode: one record per source per 0.1 s tick."""
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, interval_s=0.1,
                           faults=[PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=2.0, offset_s=4.0)])
    snaps = [s for _ in range(60) for s in sim.tick()]
    return topo, [(s.time_unix_ns // 1_000_000, pack([s]).SerializeToString()) for s in snaps]


class World:
    """A worker's stage-1 partition states plus the storm stage they feed (owned elsewhere)."""

    def __init__(self, topo, history, lookback_s: float, storms: StormStage | None = None) -> None:
        self.facts = FactBook(topo, NominalRates(topo), HealthBook(topology=topo))
        self.handlers = StageHandlers()
        self.states = PartitionStates(DetectionConfig(), topo, self.facts, None, history, {TOPIC: lookback_s},
                                      telemetry_partitions=1)      # the only partition: nothing else to wait for
        self.storms = storms or StormStage(DetectionConfig(), topo, self.facts)
        self.pause_records: list[bytes] = []

    def onsets(self) -> int:
        return sum(b'"active":true' in r for r in self.pause_records)

    def fold(self, stage, partition, raw, replay):
        return self.handlers.on_telemetry(raw, stage, partition, None, not replay)

    async def feed(self, offset: int, ts_ms: int, raw: bytes) -> list[bytes] | None:
        """One live record: the anomaly values it and a gap replayed before it (and the storm
        stage after them) produced; None: skipped."""
        stage, replayed = await self.states.admit(TOPIC, 0, offset, ts_ms / 1000, self.fold)
        self.replayed = self.route(replayed, ts_ms)
        if stage is None:
            return None
        out = self.replayed + self.route(self.handlers.on_telemetry(raw, stage, 0, ts_ms), ts_ms)
        self.states.folded(TOPIC, 0, offset)
        return out

    def route(self, records, ts_ms: int) -> list[bytes]:
        """Stage 1's outputs on: anomaly values, and what the storm stage makes of its pause records."""
        out = []
        for r in records:
            if r.topic == ANOMALIES:
                out.append(r.value)
            elif r.topic == PAUSE_STATES:
                self.pause_records.append(r.value)
                out += [a.value for a in self.handlers.on_pause_state(r.value, self.storms, ts_ms)]
        return out


def lifecycles(values: list[bytes]) -> list[tuple[str, int, str]]:
    events = [ev.AnomalyEvent.FromString(v) for v in values]
    return [(e.dedup_key, e.lifecycle, e.id) for e in events if e.kind == "pfc_storm"]


async def run(world: World, records, start: int = 0, end: int | None = None) -> list[bytes]:
    out = []
    for offset in range(start, len(records) if end is None else end):
        out += await world.feed(offset, *records[offset]) or []
    return out


@pytest.mark.slow
async def test_a_worker_taking_over_mid_storm_resolves_it_under_the_same_ids_and_never_reopens():
    topo, records = storm_partition()
    oracle_world = World(topo, ListHistory(records), 30)
    oracle = lifecycles(await run(oracle_world, records))
    opened = [e for e in oracle if e[1] == ev.LIFECYCLE_OPEN]
    resolved = [e for e in oracle if e[1] == ev.LIFECYCLE_RESOLVED]
    assert opened and resolved
    taken_at = len(records) // 2                         # 3.0 s: the storm is open

    # the storm stage's owner lives on; the telemetry partition moves to a worker with no state for it
    first = World(topo, ListHistory(records), 30)
    before = lifecycles(await run(first, records, 0, taken_at))
    assert [e for e in before if e[1] == ev.LIFECYCLE_OPEN] == opened
    history = ListHistory(records)
    second = World(topo, history, 30, storms=first.storms)
    after = lifecycles(await run(second, records, taken_at))
    assert not [e for e in after if e[1] == ev.LIFECYCLE_OPEN]               # no second OPEN
    assert [e for e in after if e[1] == ev.LIFECYCLE_RESOLVED] == resolved    # same id as uninterrupted
    assert history.reads == [(0, taken_at)] and second.states.keeper.stats["rebuilt_records"] == taken_at
    assert second.onsets() == 0                            # the rebuilt watchdog knew its ports were held

    # without the rebuild (lookback 0) the new owner's watchdog confirms the storm's onsets again
    third = World(topo, ListHistory(records), 0, storms=first.storms)
    await run(third, records, taken_at)
    assert third.onsets() > 0


@pytest.mark.slow
async def test_lookback_bounds_the_rebuild_and_a_failing_history_still_lets_detection_go_on():
    topo, records = storm_partition()
    taken_at = len(records) // 2
    history = ListHistory(records)
    await run(World(topo, history, 1.0), records, taken_at)
    (start, end), = history.reads
    assert end == taken_at and records[start][0] >= records[taken_at][0] - 1000 > records[start - 1][0]

    broken = ListHistory(records, fail_after=10)
    world = World(topo, broken, 30)
    await run(world, records, taken_at)
    keeper = world.states.keeper
    assert keeper.stats["rebuild_failures"] == 1 and keeper.stats["rebuilt_records"] == 10
    assert keeper.rebuilding == 0 and keeper.coverage.offsets[(TOPIC, 0)] == len(records) - 1


async def test_restart_from_a_checkpoint_behind_the_commit_replays_the_gap_and_skips_what_it_holds():
    """A checkpoint a few records before the storm's first event, Kafka committed past its
    last: the records in between are folded in again and what they produced is sent again
    (the commit does not wait for the outputs: the worker that committed them may have died
    before they were delivered), under the ids of their first sending; a redelivery from
    before the checkpoint is skipped, and live processing goes on."""
    topo, records = storm_partition()
    uninterrupted = World(topo, ListHistory(records), 600)
    by_offset = [lifecycles(await uninterrupted.feed(offset, *records[offset])) for offset in range(len(records))]
    with_events = [offset for offset, events in enumerate(by_offset) if events]
    checkpoint, live = with_events[0] - 3, with_events[-1] + 2
    in_gap = [e for events in by_offset[checkpoint + 1:live] for e in events]
    assert {lc for _, lc, _ in in_gap} >= {ev.LIFECYCLE_OPEN, ev.LIFECYCLE_RESOLVED}

    history = ListHistory(records)
    world = World(topo, history, 600)
    await run(world, records, 0, checkpoint + 1)
    history.reads.clear()
    world.states.coverage.on_assignment()                # as after a restart from that checkpoint
    assert await world.feed(live, *records[live]) is not None
    assert history.reads == [(checkpoint + 1, live)]
    assert world.states.keeper.stats["rebuilt_records"] == live - checkpoint - 1
    assert lifecycles(world.replayed) == in_gap          # sent again, same ids
    assert await world.feed(checkpoint - 10, *records[checkpoint - 10]) is None
    assert world.states.keeper.stats["covered_records_skipped"] == 1


async def test_a_rebuild_moves_the_state_but_sends_counts_and_logs_nothing(caplog):
    from fabricwatch import metrics

    topo, records = storm_partition()
    taken_at = len(records) // 2
    emitted_before = sum(s.value for m in metrics.WORKER_ANOMALIES_EMITTED.collect() for s in m.samples
                         if s.name.endswith("_total"))
    with caplog.at_level("INFO", logger="fabricwatch.pipeline"):
        world = World(topo, ListHistory(records), 30)
        stage, replayed = await world.states.admit(TOPIC, 0, taken_at, records[taken_at][0] / 1000, world.fold)
    assert replayed == []                                 # a lookback window: history long delivered
    assert stage.watchdog.active()                        # the storm's ports are held in the rebuilt state
    assert not [r for r in caplog.records if r.getMessage().startswith("anomaly ")]
    emitted_after = sum(s.value for m in metrics.WORKER_ANOMALIES_EMITTED.collect() for s in m.samples
                        if s.name.endswith("_total"))
    assert emitted_after == emitted_before and not stage.accounting.rebuilding
