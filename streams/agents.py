"""Faust agents and timers: thin loops that move records between topics and the stages.

Each agent takes a batch, and under the state lock admits each record (its partition's
stage restored or created, what the stage already holds skipped, a gap rebuilt first:
`streams.partitions`), folds it in, and sends what it produced. Sends bypass Faust's
attachments (``force=True``) so that a checkpoint, which flushes the producer, covers
only records whose outputs were delivered. A rebalance checkpoints the partitions it
revokes and keeps those that come back in memory.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import faust

from . import topics
from .fact_reader import FactReader
from .handlers import ANOMALIES, FACTS, PAUSE_STATES, Record, StageHandlers
from .history import KafkaHistory
from .idleness import Idleness
from .partitions import PartitionStates
from .source_stage import SourceStage, stream_partition
from .storm_stage import StormStage
from .straggler_stage import StragglerStage

log = logging.getLogger("fabricwatch.worker")
# Records are taken in batches so Faust's per-message cost is amortised.
TAKE_MAX_RECORDS = 500
TAKE_WITHIN_S = 0.05
CLUSTER_TIMER_S = 0.5
# Held rank steps are looked at when the facts' watermark moved, at most this often.
RELEASE_INTERVAL_S = 0.1
# How often the telemetry partitions are checked for idleness (`streams.idleness`).
IDLE_CHECK_S = 1.0
# How often the end offsets of idle partitions are looked up, for the storm stages and the
# facts (while one holds a watermark back, its delay is up to this).
PARTITION_ENDS_S = 0.1
# A stalled storm watermark is logged at most this often per partition (`StormStage.stalled`).
STALL_LOG_INTERVAL_S = 10.0


def register(app: faust.App, handlers: StageHandlers, states: PartitionStates, reader: FactReader,
             history: KafkaHistory) -> None:
    outputs = {ANOMALIES: app.anomalies_topic, PAUSE_STATES: app.pause_states_topic, FACTS: app.facts_topic}
    # How a record of a gap is folded in (`streams.rebuild`): its outputs kept when replayed.
    folds = {topics.TELEMETRY: lambda st, p, raw, replay: handlers.on_telemetry(raw, st, p, None, not replay),
             topics.PAUSE_STATES: lambda st, p, raw, replay: handlers.on_pause_state(raw, st, None, not replay),
             topics.RANK_STEPS: lambda st, p, raw, replay: handlers.on_rank_steps(raw, st, p, None, not replay)}
    idleness = Idleness()
    stall_logged_at: dict[int, float] = {}

    async def send_all(records: Iterable[Record]) -> None:
        for r in records:
            await outputs[r.topic].send(key=r.key, value=r.value, headers=list(r.headers), partition=r.partition,
                                        timestamp=r.timestamp_ms / 1000 if r.timestamp_ms else None, force=True)

    async def run_stage(stream, handle: Callable[..., list[Record]]) -> None:
        async for events in stream.take_events(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            async with states.lock:
                for event in events:
                    m = event.message
                    stage, replayed = await states.admit(m.topic, m.partition, m.offset, m.timestamp, folds[m.topic])
                    await send_all(replayed)
                    if stage is None:
                        continue
                    records = handle(event.value, stage, m.partition, int(m.timestamp * 1000), False)
                    states.folded(m.topic, m.partition, m.offset)
                    await send_all(records)

    async def run_telemetry(stream) -> None:
        # Like run_stage, but each partition's records of a batch go through its stage
        # together: the array work of many sources is shared (`SourceStage.observe_many`).
        async for events in stream.take_events(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            async with states.lock:
                admitted = []
                for event in events:
                    m = event.message
                    idleness.read(m.partition, m.offset)
                    stage, replayed = await states.admit(m.topic, m.partition, m.offset, m.timestamp, folds[m.topic])
                    await send_all(replayed)
                    if stage is not None:
                        admitted.append((m, (event.value, stage, m.partition, int(m.timestamp * 1000))))
                records = handlers.on_telemetry_many([item for _, item in admitted])
                for m, _ in admitted:
                    states.folded(m.topic, m.partition, m.offset)
                await send_all(records)

    @app.agent(app.telemetry_topic, name="detect_on_telemetry")
    async def detect_on_telemetry(stream):
        await run_telemetry(stream)

    @app.agent(app.pause_states_topic, name="locate_storms")
    async def locate_storms(stream):
        await run_stage(stream, lambda raw, st, p, ts, rb: handlers.on_pause_state(raw, st, ts, rb))

    @app.agent(app.rank_steps_topic, name="detect_stragglers")
    async def detect_stragglers(stream):
        await run_stage(stream, handlers.on_rank_steps)

    @app.timer(CLUSTER_TIMER_S)
    async def expire_cluster_state():
        # The storm stage caps this wall clock at the newest event time it has seen
        # (catch-up safe); a half-rebuilt picture waits for its rebuild.
        if states.rebuilding:
            return
        async with states.lock:
            now_ns = time.time_ns()
            for partition, stage in states.of_kind(StormStage):
                await send_all(handlers.on_timer(stage, now_ns))
                if time.monotonic() - stall_logged_at.get(partition, -STALL_LOG_INTERVAL_S) >= STALL_LOG_INTERVAL_S:
                    if (stall := stage.stalled()) is not None:
                        stall_logged_at[partition] = time.monotonic()
                        log.warning("pause-states[%d]: %s", partition, stall)
            for partition, stage in states.of_kind(StragglerStage):
                if stage.held:                  # a watermark stalled on the wall clock
                    await send_all(handlers.on_release(stage, partition))

    @app.timer(IDLE_CHECK_S)
    async def declare_idle_partitions():
        if states.rebuilding:
            return
        assigned = [tp for tp in app.consumer.assignment() if tp.topic == topics.TELEMETRY]
        highwaters, positions = {}, {}
        for tp in assigned:
            try:
                highwaters[tp.partition] = app.consumer.highwater(tp)
                if highwaters[tp.partition] is not None and not idleness.has_read(tp.partition):
                    positions[tp.partition] = await app.consumer.position(tp)
            except Exception:               # not assigned any more (a rebalance under way)
                highwaters.pop(tp.partition, None)
        due = idleness.due(highwaters, positions)
        if not due:
            return
        async with states.lock:
            for partition, end_offset in due.items():
                stage = states.stages.get((topics.TELEMETRY, partition))
                await send_all(handlers.on_idle(stage if isinstance(stage, SourceStage) else None,
                                                topics.TELEMETRY, partition, states.telemetry_partitions, end_offset))

    @app.timer(PARTITION_ENDS_S)
    async def look_up_partition_ends():
        # Asked under the lock (what each watermark stood at), looked up outside it: the storm
        # stages' and the facts' (`IdleClaims`).
        async with states.lock:
            asking = [(key, stage, stage.partition_ends()) for key, stage in states.stages.items()
                      if isinstance(stage, StormStage)]
            asking.append((None, reader.book, reader.book.partition_ends()))
        asking = [(key, stage, streams) for key, stage, streams in asking if streams]
        if not asking:
            return
        wanted = {stream: stream_partition(stream) for _, _, streams in asking for stream in streams}
        try:
            ends = await history.end_offsets(set(wanted.values()))
        except Exception as exc:            # the broker away: the watermarks wait for the next look-up
            log.info("looking up idle partitions' end offsets failed: %s", exc)
            return
        by_stream = {stream: ends[tp] for stream, tp in wanted.items() if tp in ends}
        async with states.lock:
            for key, stage, _ in asking:
                if key is None:                         # the facts: the straggler stages release on `moved`
                    if stage.on_partition_ends(by_stream):
                        reader.moved.set()
                elif states.stages.get(key) is stage:   # not moved away meanwhile
                    await send_all(handlers.on_partition_ends(stage, by_stream))

    @app.task
    async def read_facts():
        reader.start()
        await reader.ready.wait()
        states.set_facts_ready()
        while True:
            await reader.moved.wait()
            reader.moved.clear()
            if not states.rebuilding:
                async with states.lock:
                    for partition, stage in states.of_kind(StragglerStage):
                        if stage.held:
                            await send_all(handlers.on_release(stage, partition))
            await asyncio.sleep(RELEASE_INTERVAL_S)

    @app.on_partitions_revoked.connect
    async def _checkpoint_revoked(sender, revoked, **kwargs) -> None:
        await states.revoke_maybe({(tp.topic, tp.partition) for tp in revoked})

    @app.on_partitions_assigned.connect
    async def _check_coverage(sender, assigned, **kwargs) -> None:
        states.assigned({(tp.topic, tp.partition) for tp in assigned})
        idleness.forget({tp.partition for tp in assigned if tp.topic == topics.TELEMETRY})
        asyncio.ensure_future(resume_partitions([tp for tp in assigned if tp.topic in folds]))

    async def resume_partitions(assigned) -> None:
        # A partition that came from another worker resumes at once, not on its next record:
        # there may be none (a drained backlog), and its state holds what is still to come.
        for tp in assigned:
            try:
                async with states.lock:
                    if (tp.topic, tp.partition) in states.stages:
                        continue
                    next_offset = await app.consumer.position(tp)
                    if next_offset is None:
                        continue
                    await send_all(await states.resume(tp.topic, tp.partition, next_offset, folds[tp.topic]))
            except Exception as exc:        # moved again meanwhile: its next owner resumes it
                log.info("resuming %s[%d] stopped: %s", tp.topic, tp.partition, exc)
